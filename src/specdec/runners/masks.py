"""Attention masks of the graph contract, built from slot positions and a tree of new tokens.

Pure numpy, shared by the runtime and the exporter's parity check. ``mask[t, j]`` is True
where new token t may attend to slot j (past slots first, then the new tokens).
"""

from __future__ import annotations

import numpy as np


def chain_parents(num_new: int) -> np.ndarray:
    """Parents of a chain of new tokens: each token's parent is the one before it (-1 = the past)."""
    return np.arange(-1, num_new - 1, dtype=np.int64)


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """[T, T] bool: entry (t, s) is True when s is t itself or an ancestor of t.

    parents: [T] int, parent index of each new token (-1 = attached to the past); parents come before children.
    """
    num_new = len(parents)
    visible = np.eye(num_new, dtype=bool)
    for node in range(num_new):
        parent = parents[node]
        if parent >= 0:
            if parent >= node:
                raise ValueError("tree parents must come before their children")
            visible[node] |= visible[parent]
    return visible


def fill_masks(
    mask: np.ndarray,  # [T, P+T] bool, written in place
    sliding: np.ndarray | None,  # [T, P+T] bool or None, written in place
    past_len: int,
    visible_new: np.ndarray,  # [T, T] bool, from ancestor_matrix
    past_positions: np.ndarray,  # [P] int64: position of each past slot
    new_positions: np.ndarray,  # [T] int64
    sliding_window: int | None,
    visible_past: np.ndarray | None = None,  # [T, P] bool; None = every past slot is visible
) -> None:
    """Past slots are all valid unless ``visible_past`` says otherwise; new tokens see what ``visible_new`` allows."""
    if visible_past is None:
        mask[:, :past_len] = True
    else:
        mask[:, :past_len] = visible_past
    mask[:, past_len:] = visible_new
    if sliding is not None:
        # Hugging Face's sliding window: a query at position q sees keys at positions > q - window.
        all_positions = np.concatenate([past_positions, new_positions])
        in_window = (new_positions[:, None] - all_positions[None, :]) < sliding_window
        np.logical_and(mask, in_window, out=sliding)


def build_masks(past_positions, new_positions, parents=None, sliding_window=None):
    """Allocate and fill masks for a batch of one: returns (mask [1,T,P+T], sliding [1,T,P+T] or None)."""
    past_positions = np.asarray(past_positions, dtype=np.int64)
    new_positions = np.asarray(new_positions, dtype=np.int64)
    past_len, num_new = len(past_positions), len(new_positions)
    parents = chain_parents(num_new) if parents is None else np.asarray(parents, dtype=np.int64)
    mask = np.zeros((1, num_new, past_len + num_new), dtype=bool)
    sliding = np.zeros_like(mask) if sliding_window else None
    fill_masks(mask[0], None if sliding is None else sliding[0], past_len, ancestor_matrix(parents),
               past_positions, new_positions, sliding_window)
    return mask, sliding
