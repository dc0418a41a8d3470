"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the suffix.

Saxena 2023, "Prompt Lookup Decoding"; the same idea as llama.cpp's n-gram drafting. The
proposal is deterministic, i.e. a one-hot draft distribution, so the usual acceptance rule
stays lossless: a proposed token d is accepted with probability target_probs[d], and on
rejection the residual is the target distribution with d removed. No draft model is
needed: a bundle may hold only a target.
"""

from __future__ import annotations

import numpy as np


MAX_NGRAM = 3


def lookup_proposal(
    tokens: np.ndarray,  # [N] int64: the committed sequence (prompt + output)
    max_tokens: int,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = 1,
) -> list[int]:
    """Up to ``max_tokens`` ids that followed the most recent earlier match of the longest suffix n-gram."""
    return lookup_match(tokens, max_tokens, max_ngram, min_ngram)[0]


def lookup_match(
    tokens: np.ndarray,  # [N] int64: the committed sequence (prompt + output)
    max_tokens: int,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = 1,
) -> tuple[list[int], int]:
    """(proposal, n-gram size it matched; 0 when none). A longer match predicts its continuation better."""
    length = len(tokens)
    if max_tokens <= 0 or length < 2:
        return [], 0
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - size :]
        # candidate starts of earlier occurrences (the suffix itself, at length - size, is excluded)
        window = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], size)
        matches = np.flatnonzero((window == suffix).all(axis=1))
        matches = matches[matches < length - size]
        if len(matches):
            start = int(matches[-1]) + size
            return [int(t) for t in tokens[start : start + max_tokens]], size
    return [], 0


def one_hot_rows(tokens: list[int], vocab: int) -> np.ndarray:
    """[len(tokens), vocab] float64: the 'distribution' a deterministic proposer sampled from."""
    rows = np.zeros((len(tokens), vocab), dtype=np.float64)
    rows[np.arange(len(tokens)), tokens] = 1.0
    return rows
