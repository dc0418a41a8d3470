"""Chain speculative sampling is exact over several rounds, bonus included; planted bugs are caught.

A numpy toy pair (tests/toy_chain.py: bigram tables through the runtime's processors, draft
deliberately different) runs full speculative rounds with the real ``speculative_accept``; the
first 3 (gamma <= 2) or 4 (gamma = 3) emitted tokens are compared with their exact joint under
the target by chi-square. A bonus token lies inside that window in 82% (gamma = 1), 28% / 43%
(gamma = 2, top-k / full support) and 17% / 30% (gamma = 3) of the runs (lower bounds asserted
below, so the bonus row is really exercised). Each classic bug, planted in a test-local copy of the procedure, must fail
the same check with p < 1e-4 while the real code passes it with p > 1e-3 (fixed seeds:
deterministic).
"""

import numpy as np
import pytest

from specdec.sampling.acceptance import speculative_accept
from specdec.sampling.processors import SamplingConfig, sample
from toy_chain import CONFIG, ToyPair, chain_tokens, exactness_pvalue

RUNS = 10000
TOP_K = ToyPair(config=CONFIG)  # top-k 3 of 5: truncated supports, so untruncated q differs from q
FULL = ToyPair(config=SamplingConfig(temperature=0.9, repetition_penalty=3.0))  # full support: only frequencies tell


def _window(gamma: int) -> int:
    return max(3, gamma + 1)  # the bonus of a round that accepts all gamma drafts is token gamma + 1


def _pvalue_and_bonus_rate(pair, gamma, seed=1, **mutation):
    rng = np.random.default_rng(seed)
    runs = [chain_tokens(pair, gamma, _window(gamma), rng, **mutation) for _ in range(RUNS)]
    joint = pair.exact_joint(_window(gamma))
    return exactness_pvalue([tokens for tokens, _ in runs], joint), np.mean([bonus for _, bonus in runs])


# --- planted bugs: each is speculative_accept with one classic mistake -------------------------

def bonus_from_previous_row(drafts, draft_probs, target_probs, rng):
    """The bonus drawn from row gamma - 1 (the last draft's row) instead of row gamma."""
    gamma = len(drafts)
    shifted = np.concatenate([target_probs[:gamma], target_probs[gamma - 1: gamma]])
    return speculative_accept(drafts, draft_probs, shifted, rng)


def _rejection_loop(drafts, draft_probs, target_probs, rng, recover):
    gamma = len(drafts)
    for i in range(gamma):
        token = int(drafts[i])
        if rng.random() * draft_probs[i, token] < target_probs[i, token]:
            continue
        return i, recover(target_probs[i], draft_probs[i], rng)
    return gamma, sample(target_probs[gamma], rng)


def residual_not_renormalised(drafts, draft_probs, target_probs, rng):
    """max(p - q, 0) sampled by inverse CDF as if it summed to 1: the missing mass lands on the last token."""
    def recover(p, q, rng):
        cumulative = np.cumsum(np.maximum(p - q, 0.0))
        return min(int(np.searchsorted(cumulative, rng.random(), side="right")), len(p) - 1)
    return _rejection_loop(drafts, draft_probs, target_probs, rng, recover)


def recovered_from_the_target(drafts, draft_probs, target_probs, rng):
    """On rejection, a fresh draw from p instead of the residual (double-counts the accepted mass)."""
    return _rejection_loop(drafts, draft_probs, target_probs, rng, lambda p, q, rng: sample(p, rng))


@pytest.mark.parametrize("pair, gamma, min_bonus_rate", [
    (TOP_K, 1, 0.7), (TOP_K, 2, 0.2), (FULL, 2, 0.35), (TOP_K, 3, 0.1), (FULL, 3, 0.2),
], ids=["topk-g1", "topk-g2", "full-g2", "topk-g3", "full-g3"])
def test_speculative_rounds_match_the_exact_target_joint(pair, gamma, min_bonus_rate):
    """The first tokens of repeated speculative rounds follow the target's exact joint (p > 1e-3)."""
    pvalue, bonus_rate = _pvalue_and_bonus_rate(pair, gamma)
    assert bonus_rate > min_bonus_rate, bonus_rate  # the bonus row is exercised inside the window
    assert pvalue > 1e-3, pvalue


@pytest.mark.parametrize("pair, gamma, mutation", [
    (FULL, 2, dict(accept=bonus_from_previous_row)),
    (FULL, 3, dict(accept=bonus_from_previous_row)),
    (TOP_K, 2, dict(accept=residual_not_renormalised)),
    (TOP_K, 2, dict(accept=recovered_from_the_target)),
    (TOP_K, 2, dict(record_untruncated=True)),  # the draft samples top-k q but records the full softmax
    (TOP_K, 2, dict(stale_processor_context=True)),  # target processors see the context before the drafts
], ids=["bonus-row-g2", "bonus-row-g3", "residual-unnormalised", "recovered-from-p", "untruncated-q",
        "processors-stale-prefix"])
def test_planted_bug_fails_the_same_check(pair, gamma, mutation):
    """The check has teeth: each classic mistake gives p < 1e-4 on the same runs and seed."""
    pvalue, _ = _pvalue_and_bonus_rate(pair, gamma, **mutation)
    assert pvalue < 1e-4, pvalue
