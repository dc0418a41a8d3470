"""Suffix decoding: the matcher against brute force, the tree, the shared store's bound, and exactness in the loop."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.decoding.cost_model import Costs
from specdec.decoding.suffix_store import (MAX_SUFFIX_NODES, MIN_PATH_PROB, SEPARATOR, Calibration, RequestSuffix,
                                     SuffixCache, build_tree, continuations, cost_cut, longest_match)
from specdec.sampling.processors import SamplingConfig

from scripted import scripted_decoder
from test_decoder_loop import PROMPT, SAMPLED, STAT_CONFIG, STAT_PROMPT, VOCAB, chi_square_pvalue


def brute_longest(store, context, limit):
    """(sorted ends, length) by trying every length from the longest down."""
    for length in range(len(context), 0, -1):
        tail = list(context[-length:])
        ends = [end for end in range(length - 1, limit)
                if list(store[end - length + 1 : end + 1]) == tail]
        if ends:
            return ends, length
    return [], 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-1, 3), max_size=40), st.lists(st.integers(0, 3), min_size=1, max_size=6),
       st.integers(0, 40))
def test_longest_match_equals_brute_force(store, context, limit):
    store_arr = np.array(store, dtype=np.int64)
    limit = min(limit, len(store))
    ends, length = longest_match(store_arr, np.array(context), limit)
    assert (ends.tolist(), length) == brute_longest(store, context, limit)


def test_continuations_stop_at_a_request_boundary_and_take_the_most_recent_first():
    store = np.array([5, 1, 2, SEPARATOR, 5, 3, 4, 6, SEPARATOR, 5], dtype=np.int64)
    ends, length = longest_match(store, np.array([5]), len(store) - 1)
    assert length == 1 and ends.tolist() == [0, 4]
    assert continuations(store, ends, len(store), depth=8) == [[3, 4, 6], [1, 2]]
    assert continuations(store, ends, len(store), depth=2) == [[3, 4], [1, 2]]


def test_tree_follows_frequencies_best_first_and_every_prefix_is_a_tree():
    calibration = Calibration()
    calibration.hits[:] = calibration.predicted[:]  # factor 1: path probabilities are plain frequencies
    pieces = [[7, 8, 9], [7, 8, 1], [7, 8, 9], [2]]
    tree = build_tree(pieces, match_length=3, calibration=calibration, max_nodes=16, max_depth=8)
    assert tree.tokens[:3] == (7, 8, 9) and tree.parents[:3] == (-1, 0, 1)
    assert tree.path_probs[:3] == pytest.approx((0.75, 0.75, 0.5))
    assert set(tree.tokens) == {7, 8, 9, 1, 2}
    assert all(parent < node for node, parent in enumerate(tree.parents))
    assert all(p >= MIN_PATH_PROB for p in tree.path_probs)
    assert list(tree.path_probs) == sorted(tree.path_probs, reverse=True)


def test_cost_cut_maximizes_expected_tokens_per_second():
    calibration = Calibration()
    calibration.hits[:] = calibration.predicted[:]
    tree = build_tree([[1, 2, 3, 4, 5, 6]] * 3 + [[1, 2, 9]], 8, calibration, 16, 8)
    flat = Costs(0.0, tuple([1.0] * 9))  # wider passes cost nothing extra: take everything
    assert len(cost_cut(tree, flat.verify_cost, 1).tokens) == len(tree.tokens)
    steep = Costs(0.0, tuple(1.0 + t for t in range(9)))  # each node costs a whole pass: nothing pays
    assert cost_cut(tree, steep.verify_cost, 1).tokens == ()
    mid = Costs(0.0, tuple(1.0 + 0.2 * t for t in range(9)))
    cut = cost_cut(tree, mid.verify_cost, 1)
    rates = [tree.cut(k).expected_tokens / mid.verify_cost(1 + k) for k in range(len(tree.tokens) + 1)]
    assert len(cut.tokens) == int(np.argmax(rates))


def test_the_plan_prices_a_proposal_by_the_rows_it_adds_to_a_pass_that_feeds_given_back_rows():
    """Rows a tree gave back are fed by the next verify pass whatever is proposed: a proposal is priced by the rows
    it adds, c(pending + k) - c(pending), against target-only's 1 / c(1). A node of confidence 0.75 (1.75 tokens):
    - a first row as dear as a whole pass, later rows 0.1: after one pending row it adds 1.0 (0.75 tokens for 1.0:
      nothing), after two it adds 0.1 (it pays);
    - every row a whole pass: adding one costs 1.0 however many rows are pending, so nothing pays either way
      (sunk rows do not lower the bar: 1.75 tokens for 9 looks better than 1 for 8, but is worse than 2 for 9)."""
    from types import SimpleNamespace

    from specdec.decoding.proposers import ProposerResources, RoundInput, make_proposer
    from specdec.decoding.options import GenerationOptions
    from specdec.decoding.request import Request

    cache = SuffixCache(1 << 16)
    cache.calibration.hits[:] = cache.calibration.predicted[:] * 0.75  # every path probability 0.75
    cache.add([3, 4])  # after "3": one node, 4
    request = Request((1, 2, 3), GenerationOptions(max_new_tokens=8, sampling=SamplingConfig(temperature=0.0)),
                      "suffix")

    def proposer_for(verify):
        proposer = make_proposer(request, ProposerResources(64, costs=lambda: Costs(0.0, verify), suffix_cache=cache))
        proposer.rounds = 1  # past the first round, which proposes nothing
        return proposer

    def source(proposer, lag):
        proposal = proposer.propose(RoundInput(SimpleNamespace(tokens=[1, 2, 3]), None, 8, MAX_SUFFIX_NODES, lag))
        return "none" if proposal is None else proposal.source

    concave = proposer_for((1.0,) + tuple(2.0 + 0.1 * t for t in range(39)))
    assert source(concave, 1) == "none"
    proposal = concave.propose(RoundInput(SimpleNamespace(tokens=[1, 2, 3]), None, 8, MAX_SUFFIX_NODES, 2))
    assert proposal.source == "suffix" and proposal.tree.tokens[:1] == [4]
    linear = proposer_for(tuple(1.0 + t for t in range(40)))
    assert [source(linear, lag) for lag in (1, 2, 8, 20)] == ["none"] * 4


def test_the_decoder_tells_the_plan_how_many_rows_a_tree_gave_back(monkeypatch):
    """After a path through a second child the target lacks the given-back rows; the next round's plan hears how many
    (``target_lag``). Planted: without the give-back every round after the first sees only the pending token."""
    from specdec.decoding.proposers.suffix import Suffix
    from specdec.runners.runner import Runner

    propose = Suffix.propose

    def lags() -> list:
        seen = []

        def spy(proposer, round):
            seen.append(round.target_lag)
            return propose(proposer, round)

        monkeypatch.setattr(Suffix, "propose", spy)
        decoder, prompt, base = _second_child_store()
        assert decoder.generate(prompt, max_new_tokens=12, proposer="suffix", num_draft_tokens=8).token_ids == base
        return seen[1:]  # the first round's lag is the prompt's last two tokens (reuse_cache leaves them)

    assert max(lags()) > 1
    monkeypatch.setattr(Runner, "first_inexact", lambda self, start: None)
    assert set(lags()) == {1}


def test_request_suffix_matches_its_own_text_and_the_shared_store():
    cache = SuffixCache(1 << 16)
    own = RequestSuffix(64, cache)
    assert own.tree([4, 5, 6, 4, 5], 8, 8).tokens[:1] == (6,)  # its own text: ... 4 5 -> 6
    cache.add([9, 1, 2, 3])
    fresh = RequestSuffix(64, cache)
    assert fresh.tree([7, 9, 1], 8, 8).tokens[:2] == (2, 3)  # an earlier output: 9 1 -> 2 3
    assert RequestSuffix(64, None).tree([7, 9, 1], 8, 8).tokens == ()


def test_shared_store_stays_within_its_bound_and_keeps_the_newest():
    cache = SuffixCache(4 * 1000)  # 1,000 tokens
    rng = np.random.default_rng(0)
    for request in range(1000):
        cache.add(rng.integers(0, 50_000, size=int(rng.integers(1, 300))).tolist() + [request + 100_000])
        assert cache.used <= cache.max_tokens and cache.nbytes <= 4 * 1000
    assert cache.store[cache.used - 2] == 100_999 and cache.store[cache.used - 1] == SEPARATOR
    assert cache.evicted_tokens > 0
    cache.add(list(range(5000)))  # longer than the whole store: its last part
    assert cache.store[cache.used - 2] == 4999 and cache.used <= cache.max_tokens


def test_shared_store_is_safe_under_threads():
    cache = SuffixCache(4 * 5000)

    def work(offset):
        for i in range(300):
            cache.add([offset, i % 7, i % 5, offset])
            cache.match(np.array([offset, i % 7]), 8)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store = cache.store[: cache.used]
    pieces = np.split(store, np.flatnonzero(store == SEPARATOR) + 1)[:-1]
    assert all(len(p) == 5 and p[0] == p[3] and p[4] == SEPARATOR for p in pieces)  # no interleaved writes


# ---------------------------------------------------------------- the loop: exact whatever the store proposes
SUFFIX_MODES = [dict(proposer="suffix"), dict(proposer="suffix", num_draft_tokens=4), dict(proposer="hybrid")]


@pytest.fixture
def warm_decoder():
    """A scripted decoder whose shared store has seen related and unrelated outputs (trees branch)."""
    decoder = scripted_decoder()
    decoder.suffix_cache = SuffixCache(1 << 20)
    for prompt in (PROMPT, [4, 4], [2, 3, 1], [3, 1, 2, 5]):
        for config, seed in [(None, 0), (SAMPLED[0], 1), (SAMPLED[1], 2)] + [(SAMPLED[2], s) for s in range(3, 9)]:
            decoder.generate(prompt, max_new_tokens=30, sampling=config, seed=seed, proposer="suffix")
    return decoder


@pytest.mark.parametrize("mode", SUFFIX_MODES, ids=str)
def test_suffix_greedy_equals_target_only_with_a_warm_store(warm_decoder, mode):
    for prompt in (PROMPT, [4], [3, 1, 2, 5, 3, 1]):
        base = warm_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
        for _ in range(2):  # the second run finds the first's output in the store
            spec = warm_decoder.generate(prompt, max_new_tokens=40, **mode)
            assert spec.token_ids == base.token_ids
    assert warm_decoder.suffix_cache.requests > 12


@pytest.mark.parametrize("config", SAMPLED, ids=str)
@pytest.mark.parametrize("mode", SUFFIX_MODES, ids=str)
def test_suffix_coupled_sampling_equals_target_only_sampling(warm_decoder, mode, config):
    for seed in range(4):
        base = warm_decoder.generate(PROMPT, max_new_tokens=30, sampling=config, num_draft_tokens=0, seed=seed)
        spec = warm_decoder.generate(PROMPT, max_new_tokens=30, sampling=config, seed=seed, **mode)
        assert spec.token_ids == base.token_ids, seed


def test_an_earlier_output_makes_a_repeat_request_cheaper_not_different():
    decoder = scripted_decoder(with_draft=False)
    decoder.suffix_cache = SuffixCache(1 << 20)
    first = decoder.generate([5, 6], max_new_tokens=60, proposer="suffix")
    again = decoder.generate([5, 6], max_new_tokens=60, proposer="suffix")
    assert again.token_ids == first.token_ids
    assert again.stats.target_forwards < first.stats.target_forwards / 2, (again.stats, first.stats)
    assert again.stats.suffix_rounds > 0


def test_suffix_trees_branch_and_compact_the_cache(warm_decoder):
    """The store's continuations branch: tree rounds run, rows of rejected branches never leak (greedy equal)."""
    nodes = 0
    for prompt in ([2, 3], [3, 1], [4, 4, 2]):
        base = warm_decoder.generate(prompt, max_new_tokens=30, num_draft_tokens=0)
        spec = warm_decoder.generate(prompt, max_new_tokens=30, proposer="suffix", num_draft_tokens=6,
                                     sampling=SamplingConfig(temperature=0.0))
        assert spec.token_ids == base.token_ids
        nodes += spec.stats.tree_nodes
    assert nodes > 0


# ---------------------------------------------------------------- exact distribution with branching suffix trees
@pytest.fixture
def stat_suffix_decoder(monkeypatch):
    """The distribution tests' decoder with a fixed store whose continuations of [1, 2] branch three ways."""
    decoder = scripted_decoder(vocab=VOCAB, eos=VOCAB + 10, draft_noise=1.0, seed=5)
    cache = SuffixCache(1 << 16)
    for piece in ([1, 2, 0, 1, 3], [1, 2, 1, 1, 0], [1, 2, 3, 0, 2], [1, 2, 0, 4, 4]):
        cache.add(piece)
    monkeypatch.setattr(cache, "add", lambda tokens: None)  # every draw sees the same store
    decoder.suffix_cache = cache
    return decoder


SUFFIX_STAT_MODE = dict(proposer="suffix", num_draft_tokens=4)
SUFFIX_RUNS = 4000


@pytest.mark.parametrize("acceptance", ["coupled", "rejection"])
def test_suffix_trees_follow_the_target_distribution(stat_suffix_decoder, acceptance):
    probe = stat_suffix_decoder.generate(STAT_PROMPT, max_new_tokens=3, sampling=STAT_CONFIG, seed=0,
                                         acceptance=acceptance, **SUFFIX_STAT_MODE)
    assert probe.stats.tree_nodes > 0  # the test exercises branching trees
    assert chi_square_pvalue(stat_suffix_decoder, SUFFIX_STAT_MODE, acceptance, runs=SUFFIX_RUNS) > 1e-3


def test_planted_bug_keeping_a_rejected_childs_mass_fails_the_distribution_test(stat_suffix_decoder, monkeypatch):
    """Negative control: accepting a deterministic child with its probability but not removing it from the
    residual (drawing the fallback from the unchanged target) over-weights the proposed tokens."""
    from specdec.decoding import tree as tree_module

    def planted(tree, children, target, rng):
        for child in children:
            if rng.random() < target[tree.tokens[child]]:
                return child, target
        return None, target

    monkeypatch.setattr(tree_module, "_accept_chosen", planted)
    assert chi_square_pvalue(stat_suffix_decoder, SUFFIX_STAT_MODE, "rejection", runs=SUFFIX_RUNS) < 1e-4


def _second_child_store():
    """(decoder, prompt, target-only output): a suffix store whose likeliest continuation of the prompt is wrong and
    whose second is the target's own, so a suffix request accepts a path through a second child."""
    decoder = scripted_decoder(with_draft=False, eos=99)  # no EOS: rows kept wrongly are read later
    prompt = [1, 2, 3]
    base = decoder.generate(prompt, max_new_tokens=12, num_draft_tokens=0).token_ids
    wrong = (base[0] + 1) % 15
    decoder.suffix_cache = SuffixCache(1 << 16)
    for piece in ([2, 3, wrong, 5, 6], [2, 3, wrong, 5, 6], [2, 3] + base):
        decoder.suffix_cache.add(piece)
    return decoder, prompt, base


def test_planted_bug_in_tree_compaction_fails_greedy_identity(monkeypatch):
    """Negative control for the identity tests: a store whose likeliest continuation is wrong and whose second
    is the target's own makes the accepted path a second child; keeping the tree's first rows instead of the
    accepted path's (no compaction) then changes the output or is caught by the runner."""
    from specdec.runners.runner import Runner

    decoder, prompt, base = _second_child_store()
    right = decoder.generate(prompt, max_new_tokens=12, proposer="suffix", num_draft_tokens=8)
    assert right.token_ids == base and right.stats.tree_nodes > 0

    original = Runner.keep_path

    def planted(self, sources, first_slot):  # the first rows of the tree kept, not the accepted path's
        original(self, list(range(first_slot, first_slot + len(sources))), first_slot)
        self.slot_exact[first_slot : first_slot + len(sources)] = True  # and claimed chain rows: none given back

    monkeypatch.setattr(Runner, "keep_path", planted)
    try:
        planted_run = decoder.generate(prompt, max_new_tokens=12, proposer="suffix", num_draft_tokens=8).token_ids
    except AssertionError:  # the scripted runner saw a sequence no causal LM could
        return
    assert planted_run != base


def test_a_path_through_a_second_child_stays_reusable_by_the_next_request(monkeypatch):
    """A suffix tree whose accepted path is a second child: that node's row skipped its first sibling (not a chain
    row), so it is never offered to another request. Its rows are given back and recomputed as chain rows by the
    next pass, so the next turn reuses the whole prompt and output (all but the last token, never computed). The
    output is unchanged. Planted: without giving them back the cache ends at the prompt."""
    from specdec.runners.runner import Runner

    def reused() -> tuple:
        decoder, prompt, base = _second_child_store()
        decoder.clear_cache()
        result = decoder.generate(prompt, max_new_tokens=12, proposer="suffix", num_draft_tokens=8)
        assert result.token_ids == base and result.stats.tree_nodes > 0
        held = prompt + result.token_ids
        return decoder.cached_prefix(held), len(held)

    cached, total = reused()
    assert cached == total - 1
    monkeypatch.setattr(Runner, "first_inexact", lambda self, start: None)
    assert reused()[0] == 3
