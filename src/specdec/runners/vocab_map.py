"""A draft with a pruned vocabulary (FR-Spec): its logits over K kept token ids, mapped back to the full vocabulary.

A pruned draft's lm_head scores only ``kept_ids`` (the K most frequent tokens of a corpus,
ascending ids, stored in the bundle as ``ModelSpec.vocab_subset``). Every other token gets
logit -inf, so its probability under the draft is exactly 0: the draft can never propose
it, and the acceptance test ``min(1, p/q)`` with q the distribution the draft sampled from
stays exact (the target's residual distribution still covers every token). Only the
draft's cost and its acceptance rate change.

Pure numpy; no onnxruntime, no torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.contract.manifest import BundleError

NEG_INF = np.float32(-np.inf)


def expand_logits(
    sub_logits: np.ndarray,  # [T, K] float32, the pruned draft's output
    kept_ids: np.ndarray,  # [K] int64, ascending: column k scores token kept_ids[k]
    vocab_size: int,
) -> np.ndarray:  # [T, V] float32, -inf outside kept_ids
    out = np.empty((sub_logits.shape[0], vocab_size), dtype=np.float32)
    return expand_logits_into(sub_logits, kept_ids, out)


def expand_logits_into(
    sub_logits: np.ndarray,  # [T, K]
    kept_ids: np.ndarray,  # [K]
    out: np.ndarray,  # [T, V] float32, preallocated (e.g. a view of a [max_T, V] buffer)
) -> np.ndarray:
    """``expand_logits`` into ``out`` (every cell is rewritten: samplers may edit logits in place)."""
    if sub_logits.shape[-1] != kept_ids.shape[0] or out.shape[0] != sub_logits.shape[0]:
        raise ValueError(f"expand_logits: sub_logits {sub_logits.shape}, kept_ids {kept_ids.shape}, out {out.shape}")
    out.fill(NEG_INF)
    out[:, kept_ids] = sub_logits
    return out


def check_kept_ids(kept_ids: np.ndarray, vocab_size: int, logits_width: int | None = None) -> np.ndarray:
    """The kept ids as int64, refusing what would map logits wrongly: not 1-D, unsorted or repeated ids,
    ids outside the vocabulary, or a count different from the graph's logits width."""
    ids = np.asarray(kept_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise BundleError(f"a vocabulary subset must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64)
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise BundleError(f"a vocabulary subset must hold ascending unique ids in 0..{vocab_size - 1}")
    if logits_width is not None and ids.size != logits_width:
        raise BundleError(f"the vocabulary subset has {ids.size} ids but the draft's logits have {logits_width} columns")
    return ids


def load_kept_ids(bundle_dir: str | Path, spec) -> np.ndarray | None:
    """The kept ids of a model spec with ``vocab_subset`` (a bundle-relative .npy), or None for a full vocabulary.
    Call after the bundle's file hashes were checked (``open_bundle``)."""
    relative = getattr(spec, "vocab_subset", None)
    if relative is None:
        return None
    from specdec.contract.bundle import inside

    try:
        ids = np.load(inside(Path(bundle_dir), relative), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{spec.role}: cannot read its vocabulary subset {relative}: {exc}") from None
    width = next((s.shape[-1] for s in spec.outputs if s.name == "logits"), None)
    return check_kept_ids(ids, spec.vocab_size, width if isinstance(width, int) else None)
