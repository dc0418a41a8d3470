"""Token trees: greedy path acceptance, exact tree sampling math, KV compaction, identical greedy output."""

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec.decoding import tree as tree_module
from specdec.decoding.tree import (ROOT, DraftTree, allocate_children, greedy_tree_accept, parse_tree,
                                  pick_children, tree_size, tree_speculative_accept)
from toy_chain import ToyPair, exactness_pvalue, tree_tokens

TREE_RUNS = 6000

#        root
#       /    \\
#   n0:5      n1:6
#    |         |
#   n2:7      n3:8
TREE = DraftTree(tokens=[5, 6, 7, 8], parents=[ROOT, ROOT, 0, 1], depths=[1, 1, 2, 2], fed=2, draw_dists={})


@pytest.mark.parametrize(
    "choices, expected",
    [
        ({0: 6, 2: 8, 4: 1}, ([1, 3], 1)),  # second branch all the way, bonus after the leaf
        ({0: 5, 1: 7, 3: 9}, ([0, 2], 9)),
        ({0: 5, 1: 3}, ([0], 3)),  # first token right, then a miss
        ({0: 4}, ([], 4)),  # no child matches
    ],
)
def test_greedy_tree_accept_takes_the_longest_matching_path(choices, expected):
    assert greedy_tree_accept(TREE, lambda expansion: choices[expansion]) == expected


def test_parse_tree():
    assert parse_tree("4,2,2,1") == (4, 2, 2, 1)
    assert parse_tree([2, 1]) == (2, 1)
    assert parse_tree("auto") == "auto" and parse_tree(None) is None
    assert tree_size((4, 2, 2, 1)) == 4 + 8 + 16 + 16
    for bad in ("0,2", "a,b", "", [-1]):
        with pytest.raises(ValueError):
            parse_tree(bad)


def test_pick_children_without_replacement_and_in_support():
    dist = np.array([0.5, 0.0, 0.3, 0.2])
    assert pick_children(dist, 3, greedy=True, rng=None) == [0, 2, 3]
    rng = np.random.default_rng(0)
    for _ in range(200):
        picked = pick_children(dist, 3, greedy=False, rng=rng)
        assert len(set(picked)) == 3 and 1 not in picked


def test_allocation_depends_only_on_the_draft_distributions():
    confident, unsure = np.array([0.9, 0.05, 0.05]), np.array([0.4, 0.3, 0.3])
    assert allocate_children([1.0, 1.0], [confident, unsure], 3) == [1, 2]
    assert allocate_children([1.0, 0.1], [confident, unsure], 3) == [3, 0]


def _root_only_tree(children, draft):
    return DraftTree(tokens=children, parents=[ROOT] * len(children), depths=[1] * len(children), fed=0,
                     draw_dists={0: draft})


def _unnormalised_residual(target, draft):
    """Planted bug: max(p - q, 0) kept unnormalised (same ~0 fallback), so later siblings are accepted too rarely."""
    residual = np.maximum(np.asarray(target, dtype=np.float64) - draft, 0.0)
    return residual if residual.sum() > 1e-12 else target


def _with_replacement(tree, target_dist, rng):
    """Planted bug: the with-replacement correction (q unchanged) on children drawn without replacement."""
    return tree_speculative_accept(tree, target_dist, rng, without_replacement=False)


def _plant(monkeypatch, mutant):
    """The accept function to call; the residual mutant is planted where tree.py looks it up."""
    if mutant == "residual-unnormalised":
        monkeypatch.setattr(tree_module, "residual_distribution", _unnormalised_residual)
    return _with_replacement if mutant == "with-replacement" else tree_speculative_accept


def _one_node_pvalue(accept, target, draft, children, runs=20000, seed=1):
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(target))
    for _ in range(runs):
        picked = pick_children(draft, children, greedy=False, rng=rng)
        path, token = accept(_root_only_tree(picked, draft), lambda e: target, rng)
        counts[picked[path[0]] if path else token] += 1
    return chisquare(counts, target * runs).pvalue


# The issue's example is not blind to an unnormalised residual (token 2: 0.24 instead of 0.30) nor to
# the with-replacement correction (0.343); the older example (2nd row) is blind to the residual bug.
ISSUE_TARGET, ISSUE_DRAFT = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.4, 0.3, 0.2, 0.1])


@pytest.mark.parametrize("mutant, target, draft, children, caught", [
    ("correct", ISSUE_TARGET, ISSUE_DRAFT, 2, False),
    ("correct", np.array([0.2, 0.5, 0.3]), np.array([0.6, 0.3, 0.1]), 2, False),
    ("correct", ISSUE_TARGET, ISSUE_DRAFT, 3, False),
    ("residual-unnormalised", ISSUE_TARGET, ISSUE_DRAFT, 2, True),
    ("with-replacement", ISSUE_TARGET, ISSUE_DRAFT, 2, True),
], ids=["correct-2", "correct-older-example", "correct-3", "residual-unnormalised", "with-replacement"])
def test_sibling_rejection_sampling_is_exact_and_planted_bugs_fail(monkeypatch, mutant, target, draft, children, caught):
    """At one node, siblings drawn without replacement then recursive rejection give exactly the target (chi-square)."""
    pvalue = _one_node_pvalue(_plant(monkeypatch, mutant), target, draft, children)
    assert (pvalue < 1e-4) if caught else (pvalue > 1e-3), pvalue


def _bonus_from_the_parent_row(tree, target_dist, rng):
    """Planted bug: after a leaf is accepted, the bonus is drawn from the leaf's parent's row (one row too early)."""
    def shifted(expansion):
        if expansion > 0 and expansion not in tree.draw_dists:  # a leaf: only its bonus is drawn here
            return target_dist(tree.parents[expansion - 1] + 1)
        return target_dist(expansion)
    return tree_speculative_accept(tree, shifted, rng)


@pytest.mark.parametrize("mutant, caught", [
    ("correct", False), ("residual-unnormalised", True), ("with-replacement", True), ("bonus-from-parent-row", True),
], ids=["correct", "residual-unnormalised", "with-replacement", "bonus-from-parent-row"])
def test_tree_rounds_match_the_exact_target_joint(monkeypatch, mutant, caught):
    """Rounds of (2, 1) trees on the toy pair: the first 3 tokens (bonus included) follow the target's exact joint."""
    accept = _bonus_from_the_parent_row if mutant == "bonus-from-parent-row" else _plant(monkeypatch, mutant)
    pair = ToyPair()
    rng = np.random.default_rng(2)
    samples = [tree_tokens(pair, (2, 1), 3, rng, accept=accept) for _ in range(TREE_RUNS)]
    pvalue = exactness_pvalue(samples, pair.exact_joint(3))
    assert (pvalue < 1e-4) if caught else (pvalue > 1e-3), pvalue


PROMPTS = ["def add(a, b):\n    return", "x", "The quick brown fox jumps over the lazy dog. " * 2]


@pytest.mark.parametrize("tree", ["1,1,1", "2,2,1", "4,2,2,1", "3", "auto"])
def test_greedy_tree_decoding_equals_target_only(tiny_decoder, tree):
    for prompt in PROMPTS:
        baseline = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
        result = tiny_decoder.generate(prompt, max_new_tokens=40, tree=tree)
        assert result.token_ids == baseline.token_ids, (tree, prompt)
        assert result.stats.tree_nodes > 0


def test_trees_accept_more_per_target_pass_than_a_chain(tiny_decoder):
    chain = tiny_decoder.generate(PROMPTS[0], max_new_tokens=60, num_draft_tokens=3).stats
    tree = tiny_decoder.generate(PROMPTS[0], max_new_tokens=60, tree="4,2,2").stats
    assert tree.mean_accepted_per_round > chain.mean_accepted_per_round


def test_kv_compaction_leaves_caches_as_if_the_path_was_decoded(tiny_decoder):
    """After tree rounds, both caches hold exactly the rows target-only decoding would have written."""
    prompt = PROMPTS[0]
    tiny_decoder.generate(prompt, max_new_tokens=20, tree="3,2")
    target = tiny_decoder.target
    tree_rows = target.cache[:, :, :, : target.length].copy()
    tree_positions = target.slot_positions[: target.length].copy()
    tiny_decoder.generate(prompt, max_new_tokens=20, num_draft_tokens=0)
    plain_length = tiny_decoder.target.length
    assert plain_length == len(tree_positions)
    assert np.array_equal(tree_positions, np.arange(plain_length))
    assert np.allclose(tree_rows, tiny_decoder.target.cache[:, :, :, :plain_length], atol=1e-5)


def test_a_tree_request_never_calibrates_chain_costs(tiny_decoder, monkeypatch):
    """A tree sizes itself (shape or draft confidence): it neither waits for nor needs the chain planner's
    calibrated pass costs; an "auto" chain on the same decoder still gets them."""
    from specdec.decoding import decoder as decoder_module

    worker = tiny_decoder.fork()
    worker._costs = None
    worker._calibration_key = None  # costs another test measured are on disk: this decoder must measure its own
    calls = []
    monkeypatch.setattr(decoder_module, "calibrate", lambda *args, **kwargs: calls.append(1) or _refuse_calibration())
    for tree in ("2,2,1", "auto"):
        assert worker.generate(PROMPTS[0], max_new_tokens=8, tree=tree).stats.tree_nodes > 0
    assert calls == []
    with pytest.raises(RuntimeError, match="calibrated"):
        worker.generate(PROMPTS[0], max_new_tokens=8)  # the default: an auto chain
    assert calls == [1]


def _refuse_calibration():
    raise RuntimeError("calibrated")


def test_a_widest_draft_tree_after_given_back_rows_still_fits_one_pass(monkeypatch):
    """A draft tree of 62 nodes (2, 2, 2, 2, 2) whose accepted path went through a second child: its rows are given
    back, and the next verify pass feeds them only as far as the widest pass a runner takes (the rest in a catch-up
    pass), so the request completes with target-only's tokens. Planted: feeding every given-back row beside the
    next 62 nodes asks the runner for more than 64 tokens in one pass."""
    from scripted import scripted_decoder
    from specdec.contract.limits import REFEED_ROWS
    from specdec.decoding import rounds

    decoder = scripted_decoder(seed=1)
    base = decoder.generate([1, 2, 3], max_new_tokens=60, num_draft_tokens=0).token_ids
    result = decoder.generate([1, 2, 3], max_new_tokens=60, tree=(2, 2, 2, 2, 2), num_draft_tokens=5)
    assert result.token_ids == base and result.stats.tree_nodes > 62
    monkeypatch.setattr(rounds, "refeed_room", lambda candidates: REFEED_ROWS)
    decoder = scripted_decoder(seed=1)
    with pytest.raises(ValueError, match="exceed this runner's 64"):
        decoder.generate([1, 2, 3], max_new_tokens=60, tree=(2, 2, 2, 2, 2), num_draft_tokens=5)
