"""Acceptance math: table-driven greedy cases, the teaching case, edge cases and property tests."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy.stats import chisquare

from specdec.sampling.acceptance import greedy_accept, residual_distribution, speculative_accept
from specdec.sampling.processors import SamplingConfig, sample, sampling_distribution


@pytest.mark.parametrize(
    "drafts, target, expected",
    [
        ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted: bonus from the last row
        ([5, 6, 7], [5, 9, 7, 8], (1, 9)),  # first mismatch: the target's token replaces it
        ([5, 6, 7], [4, 6, 7, 8], (0, 4)),  # mismatch at once
        ([], [3], (0, 3)),  # no drafts: plain decoding
    ],
)
def test_greedy_accept_table(drafts, target, expected):
    assert greedy_accept(np.array(drafts, dtype=np.int64), np.array(target)) == expected


def _first_token_counts(target, draft, draws, seed=0, wrong=False):
    """Empirical distribution of the first emitted token with gamma=1, the draft sampling from ``draft``."""
    rng = np.random.default_rng(seed)
    target_probs = np.array([target, target])  # row 1 (bonus) is irrelevant to the first token
    counts = np.zeros(len(target))
    for _ in range(draws):
        token = sample(np.array(draft), rng)
        recorded = np.full(len(draft), 1.0 / len(draft)) if wrong else np.array(draft)
        accepted, nxt = speculative_accept(np.array([token]), recorded[None], target_probs, rng)
        counts[token if accepted else nxt] += 1
    return counts


def test_teaching_case_yields_the_target_not_the_mixture():
    """target (0.6, 0.4), draft (0.8, 0.2): output (0.6, 0.4), not (0.72, 0.28) or the draft."""
    counts = _first_token_counts([0.6, 0.4], [0.8, 0.2], 20000)
    assert chisquare(counts, np.array([0.6, 0.4]) * counts.sum()).pvalue > 1e-3
    assert chisquare(counts, np.array([0.72, 0.28]) * counts.sum()).pvalue < 1e-6


def test_wrong_recorded_draft_distribution_is_detected():
    """The same check has teeth: recording a distribution other than the sampled one biases the output."""
    counts = _first_token_counts([0.6, 0.4], [0.8, 0.2], 20000, wrong=True)
    assert chisquare(counts, np.array([0.6, 0.4]) * counts.sum()).pvalue < 1e-6


def test_bonus_is_drawn_from_the_row_after_the_last_draft():
    """All drafts accepted: the bonus comes from row gamma (one-hot rows that all differ), not row gamma - 1."""
    eye = np.eye(5)
    drafts = np.array([1, 2], dtype=np.int64)
    accepted, bonus = speculative_accept(drafts, eye[[1, 2]], eye[[1, 2, 4]], np.random.default_rng(0))
    assert (accepted, bonus) == (2, 4)


def test_residual_is_the_normalised_positive_part():
    """normalize(max(p - q, 0)) sums to 1: target (.1,.2,.3,.4) vs draft (.4,.3,.2,.1) gives (0, 0, .25, .75)."""
    residual = residual_distribution(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.4, 0.3, 0.2, 0.1]))
    assert np.allclose(residual, [0.0, 0.0, 0.25, 0.75], atol=1e-12)


def test_residual_of_equal_distributions_falls_back_to_target():
    probs = np.array([0.25, 0.25, 0.5])
    assert np.allclose(residual_distribution(probs, probs), probs)


def test_zero_draft_probability_never_divides():
    rng = np.random.default_rng(0)
    target = np.array([[0.0, 1.0], [0.5, 0.5]])
    draft = np.array([[0.0, 1.0]])
    accepted, token = speculative_accept(np.array([0]), draft, target, rng)  # a token the draft "could not" sample
    assert accepted == 0 and token == 1  # rejected: the target gives it no mass


def _distribution(draw, vocab):
    weights = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=vocab, max_size=vocab)))
    weights[draw(st.integers(0, vocab - 1))] += 1e-3  # some mass somewhere
    return weights / weights.sum()


@st.composite
def rounds(draw):
    vocab = draw(st.integers(2, 12))
    gamma = draw(st.integers(0, 6))
    target = np.stack([_distribution(draw, vocab) for _ in range(gamma + 1)])
    draft = np.stack([_distribution(draw, vocab) for _ in range(gamma)]) if gamma else np.zeros((0, vocab))
    seed = draw(st.integers(0, 2**32 - 1))
    return target, draft, seed


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_property_acceptance_emits_1_to_gamma_plus_1_valid_tokens(case):
    target, draft, seed = case
    rng = np.random.default_rng(seed)
    gamma = len(draft)
    drafts = np.array([sample(draft[i], rng) for i in range(gamma)], dtype=np.int64)
    accepted, token = speculative_accept(drafts, draft, target, rng)
    assert 0 <= accepted <= gamma
    assert target[accepted, token] > 0  # never a token with zero target probability
    emitted = list(drafts[:accepted]) + [token]
    assert 1 <= len(emitted) <= gamma + 1


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=40),
    temperature=st.sampled_from([1e-4, 1e-2, 0.5, 1.0, 7.0, 100.0]),
    top_k=st.integers(0, 50),
    top_p=st.sampled_from([1e-6, 0.01, 0.5, 0.9, 0.999999, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 0.99]),
    penalty=st.sampled_from([1.0, 1.3, 0.7]),
    ties=st.booleans(),
)
def test_property_processed_distribution_is_finite_and_normalized(logits, temperature, top_k, top_p, min_p, penalty, ties):
    logits = np.array(logits, dtype=np.float32)
    if ties:
        logits[: len(logits) // 2] = logits[0]
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty)
    probs = sampling_distribution(logits, np.array([0, 1], dtype=np.int64), config)
    assert np.all(np.isfinite(probs)) and np.all(probs >= 0)
    assert abs(probs.sum() - 1.0) < 1e-9
    token = sample(probs, np.random.default_rng(0))
    assert probs[token] > 0
