"""An int8 KV cache's rows in numpy: the rule the folded graph writes them by, and the snapshot layout.

A row (one token's keys or values for one KV head, ``head_dim`` values) is stored symmetric: int8 steps and one
float32 scale, ``max|x| / 127`` (1e-30 for an all-zero row), so ``x ~= steps * scale`` within half a step. The
graph's ``folded_attention._int8_rows`` is the same rule in ONNX (round half to even, clip to +-127); tests hold the
two equal. A snapshot (``Runner.snapshot``, the RAM cache and slot files) packs each row's scale after its steps:
``[..., rows, head_dim + 4]`` int8, the scale's four bytes little-endian.
"""

from __future__ import annotations

import numpy as np

SCALE_BYTES = 4  # a float32 per row
SMALLEST_SCALE = np.float32(1e-30)


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows: [..., D] float32 -> (steps [..., D] int8, scales [..., 1] float32)."""
    rows = np.asarray(rows, dtype=np.float32)
    scales = np.maximum(np.abs(rows).max(axis=-1, keepdims=True) / np.float32(127.0), SMALLEST_SCALE)
    steps = np.clip(np.round(rows / scales), -127, 127).astype(np.int8)
    return steps, scales.astype(np.float32)


def dequantize_rows(steps: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """steps: [..., D] int8, scales: [..., 1] float32 -> [..., D] float32."""
    return steps.astype(np.float32) * scales


def pack_rows(steps: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """steps: [..., N, D] int8, scales: [..., N, 1] float32 -> [..., N, D + 4] int8 (a snapshot's layout)."""
    scale_bytes = np.ascontiguousarray(scales, dtype="<f4").view(np.int8)  # [..., N, 4]
    return np.concatenate([steps, scale_bytes], axis=-1)


def unpack_rows(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """packed: [..., N, D + 4] int8 -> (steps [..., N, D] int8, scales [..., N, 1] float32)."""
    steps = packed[..., :-SCALE_BYTES]
    scales = np.ascontiguousarray(packed[..., -SCALE_BYTES:]).view("<f4").astype(np.float32)
    return steps, scales
