"""Prompt lookup and hybrid proposals: lossless (greedy identical, sampling exact) and useful on repeats."""

import numpy as np
import pytest

from specdec.decoding.proposers.lookup import lookup_match
from specdec.sampling.acceptance import one_hot_rows, speculative_accept


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([1, 2, 3, 9, 1, 2, 3], [9, 1, 2]),  # longest suffix n-gram (1 2 3) -> what followed it
        ([5, 6, 7, 5, 6, 8, 5, 6], [8, 5, 6]),  # the most recent earlier match wins
        ([1, 2, 3, 4], []),  # nothing repeats
        ([4, 4], [4]),
    ],
)
def test_lookup_proposal_table(tokens, expected):
    assert lookup_match(np.array(tokens), max_tokens=3)[0] == expected


def test_lookup_match_reports_the_matched_ngram_size():
    assert lookup_match(np.array([1, 2, 3, 9, 1, 2, 3]), 2) == ([9, 1], 3)
    assert lookup_match(np.array([7, 2, 3, 9, 1, 2, 3]), 2) == ([9, 1], 2)
    assert lookup_match(np.array([7, 8, 3, 9, 1, 2, 3]), 2) == ([9, 1], 1)
    assert lookup_match(np.array([7, 8, 3, 9, 1, 2, 3]), 2, min_ngram=2) == ([], 0)


def test_one_hot_draft_accepts_with_target_probability():
    """A deterministic proposal d is accepted with probability target[d]; rejection resamples without d."""
    rng = np.random.default_rng(0)
    target = np.array([[0.3, 0.5, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    counts = np.zeros(3)
    for _ in range(20000):
        accepted, token = speculative_accept(np.array([1]), one_hot_rows([1], 3), target, rng)
        counts[1 if accepted else token] += 1
    assert np.allclose(counts / counts.sum(), target[0], atol=0.015)


REPEATING = "def area(width, height):\n    return width * height\n\n\ndef area(width, height):\n    return"


@pytest.mark.parametrize("proposer", ["lookup", "hybrid"])
@pytest.mark.parametrize("length", [1, 3, 6, "auto"])
def test_greedy_lookup_and_hybrid_equal_target_only(tiny_decoder, proposer, length):
    for prompt in (REPEATING, "x"):
        baseline = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
        result = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=length, proposer=proposer)
        assert result.token_ids == baseline.token_ids


def test_lookup_runs_on_a_target_only_bundle(tiny_pair_dirs, tmp_path):
    pytest.importorskip("torch")
    from specdec import SpeculativeDecoder
    from specdec.export.bundle import ExportOptions, export_bundle

    export_bundle(ExportOptions(target=str(tiny_pair_dirs[0]), draft=None, out=tmp_path / "b", parity=False),
                  progress=lambda m: None)
    decoder = SpeculativeDecoder.load(tmp_path / "b")
    baseline = decoder.generate(REPEATING, max_new_tokens=30, num_draft_tokens=0)
    result = decoder.generate(REPEATING, max_new_tokens=30, num_draft_tokens=4, proposer="lookup")
    assert result.token_ids == baseline.token_ids
    assert result.stats.lookup_rounds > 0
    with pytest.raises(ValueError, match="no draft model"):
        decoder.generate(REPEATING, max_new_tokens=5, num_draft_tokens=4, proposer="draft")
