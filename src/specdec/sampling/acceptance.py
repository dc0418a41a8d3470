"""Accept or reject a chain of draft tokens: the step that keeps the output the target's.

Vocabulary (as vLLM's rejection sampler defines it): the tokens a round emits are the
accepted draft tokens, then either one *recovered* token (at the first rejection) or one
*bonus* token (when every draft token was accepted). A round therefore emits 1..gamma+1
tokens.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023 ("modified rejection
sampling"): accept draft token d_i with probability min(1, target_probs[i, d_i] /
draft_probs[i, d_i]); at the first rejection draw from normalize(max(target_probs[i] -
draft_probs[i], 0)); if all are accepted draw the bonus from target_probs[gamma]. The
emitted tokens are then distributed exactly as the target's own samples.

Position convention: row i of ``target_probs`` is the target's distribution for the token
*after* the first i draft tokens, i.e. it scores draft token i (0-based); row gamma scores
the bonus token.
"""

from __future__ import annotations

import numpy as np

from specdec.sampling.processors import sample

# Residual mass below this is treated as zero: the distributions are equal to float
# precision, so a rejection had (numerically) zero probability and any draw from the target
# is unbiased.
RESIDUAL_EPSILON = 1e-12


def greedy_accept(
    draft_tokens: np.ndarray,  # [gamma] int64
    target_choices: np.ndarray,  # [gamma + 1] int64: the target's greedy token at each position
) -> tuple[int, int]:
    """(number of accepted draft tokens, the recovered or bonus token)."""
    gamma = len(draft_tokens)
    for i in range(gamma):
        if draft_tokens[i] != target_choices[i]:
            return i, int(target_choices[i])
    return gamma, int(target_choices[gamma])


def residual_distribution(
    target_probs: np.ndarray,  # [V]
    draft_probs: np.ndarray,  # [V]
) -> np.ndarray:
    """normalize(max(target - draft, 0)); falls back to the target when the residual is ~0. [V] float64."""
    residual = np.maximum(target_probs.astype(np.float64) - draft_probs, 0.0)
    total = residual.sum()
    if not total > RESIDUAL_EPSILON:
        return target_probs.astype(np.float64) / target_probs.sum()
    return residual / total


def speculative_accept(
    draft_tokens: np.ndarray,  # [gamma] int64
    draft_probs: np.ndarray,  # [gamma, V]: the distributions the draft really sampled from
    target_probs: np.ndarray,  # [gamma + 1, V]: the target's processed distributions
    rng: np.random.Generator,
) -> tuple[int, int]:
    """(number of accepted draft tokens, the recovered or bonus token)."""
    gamma = len(draft_tokens)
    for i in range(gamma):
        token = int(draft_tokens[i])
        target_p, draft_p = float(target_probs[i, token]), float(draft_probs[i, token])
        # u < target/draft without dividing: a draft probability of 0 (which the draft cannot
        # have sampled, but floats) accepts only when the target gives the token mass.
        if rng.random() * draft_p < target_p:
            continue
        return i, sample(residual_distribution(target_probs[i], draft_probs[i]), rng)
    return gamma, sample(target_probs[gamma], rng)


def one_hot_rows(tokens: list[int], vocab: int) -> np.ndarray:
    """[len(tokens), vocab] float64: the 'distribution' a deterministic proposer (lookup, suffix) sampled from."""
    rows = np.zeros((len(tokens), vocab), dtype=np.float64)
    rows[np.arange(len(tokens)), tokens] = 1.0
    return rows
