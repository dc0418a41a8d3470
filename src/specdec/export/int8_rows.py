"""A decoder layer's projection as an integer product: 7-bit weights per output channel, 8-bit activations per row.

``--layer-products int8`` (``QuantRecipe.layer_products``) writes each of a layer's projections (packed QKV, the
output projection, packed gate|up, down) as an integer product (MLAS u8 x s8) over weights rounded per output channel
and activations rounded per token row, then the two scales:

    s_row = max|x_row| / 127            (per row: ReduceMax, no row reads another)
    q_row = round(x_row / s_row) + 128  (uint8, zero point 128: one QuantizeLinear along the rows)
    y     = float(q_row @ W_q) * w_scale * s_row   (MatMulIntegerToFloat, then the two scales)

MLAS runs the u8 x s8 product with AMX tiles, VNNI or AVX2 ``vpmaddubsw``, on weights packed once at load.
Where MatMulNBits' int4 kernel is compute-bound from ~8 rows on (a 64-token prefill chunk costs 13.6x one token
on a Xeon with AMX), the integer product of 64 rows costs about 2.7x one row there, and its weights read 8 bits per
weight against MatMulNBits' ~6 (4 + a float32 scale and block sum per 32).

The activation codes come from one ``QuantizeLinear`` per row (``round(x / s) + 128``, saturated: the same bits
as Div, Round, Add and Cast) and the integer product from com.microsoft's ``MatMulIntegerToFloat`` with unit scales
(``float(acc) * 1``, a Cast in the kernel's output loop); the channel scales stay a Mul: handed to the kernel as B's
scales per column they made the widest product (gate|up, 17,920 columns) 3% slower at one row and 10% at 64 on
onnxruntime 1.32. 9 nodes a product instead of 12, a 64-token prefill pass of the 1.5B target 3-6% faster, the
same bits (benchmarks/results/2026-12-07-int8-chain-zen5).

Rows stay exact in every pass width by construction: each row's scale is its own, the product is integer
(exact whatever the kernel's tiling), and the scaling is elementwise. Weights keep 7 bits (63 levels either side,
onnxruntime's ``reduce_range``) so a pair of u8 x s8 products never saturates ``vpmaddubsw``'s int16 sum
(255 * 63 * 2 = 32,130 < 32,767) on AVX2 CPUs without VNNI, where 8-bit weights would silently clip.
"""

from __future__ import annotations

import numpy as np

WEIGHT_LEVELS = 63  # 7-bit weights (module docstring: AVX2's vpmaddubsw)
ROW_LEVELS = 127.0  # 8-bit activations, zero point 128
ZERO_POINT = 128
TINY = 1e-30  # a row of zeros keeps a scale (its products are 0 whatever the scale)


def channel_quantized(weight: np.ndarray, levels: int = WEIGHT_LEVELS) -> tuple[np.ndarray, np.ndarray]:
    """weight: [N, K] float32 -> (q [K, N] int8 in [-levels, levels], scale [N] float32): per output channel,
    scale = max |w| / levels, round to nearest (ties to even)."""
    peak = np.abs(weight).max(axis=1).astype(np.float32)
    scale = np.where(peak > 0, peak / np.float32(levels), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(weight / scale[:, None]), -levels, levels).astype(np.int8)
    return np.ascontiguousarray(q.T), scale


def row_zero_points(sink, rows: str) -> str:
    """The activation codes' zero points, one per row: [T] uint8 of 128 for ``rows``, any [1, T, ...] tensor of the
    pass (the fused graph's ``position_ids``, or a product's input). Made once for a whole graph: QuantizeLinear
    takes a zero point per scale."""
    count = sink.one("Shape", [rows], name="int8_rows/rows", start=1, end=2)  # [1]: T
    return sink.one("Expand", [sink.constant([ZERO_POINT], np.uint8), count], name="int8_rows/zero_points")


def row_quantized_matmul(sink, x: str, q: str, scale: str, name: str, out: str, zero_points: str) -> str:
    """``out`` = x @ W for W held as ``q`` [K, N] int8 and ``scale`` [N] (initializer names), ``x`` [1, T, K];
    ``zero_points``: the graph's ``row_zero_points``."""
    peak = sink.one("ReduceMax", [sink.one("Abs", [x], name=f"{name}/abs"), sink.constant([-1])],
                    name=f"{name}/row_peak", keepdims=1)
    row_scale = sink.one("Div", [sink.one("Max", [peak, sink.constant(TINY, np.float32)], name=f"{name}/row_peak_min"),
                                 sink.constant(ROW_LEVELS, np.float32)], name=f"{name}/row_scale")  # [1, T, 1]
    scales = sink.one("Reshape", [row_scale, sink.constant([-1])], name=f"{name}/row_scales")  # [T]
    codes = sink.one("QuantizeLinear", [x, scales, zero_points], name=f"{name}/codes", axis=1)  # [1, T, K] uint8
    one = sink.constant(1.0, np.float32)
    product = sink.one("MatMulIntegerToFloat", [codes, q, one, one, sink.constant(ZERO_POINT, np.uint8)],
                       name=f"{name}/MatMulIntegerToFloat", domain="com.microsoft")  # float(q_row @ W_q)
    scaled = sink.one("Mul", [product, scale], name=f"{name}/channel_scale")
    sink.node("Mul", [scaled, row_scale], [out], name=f"{name}/row_scale_mul")
    return out


def reference_rows(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The same product in numpy (float64 accumulation of the integers: exact), x: [T, K] float32 -> [T, N]."""
    peak = np.maximum(np.abs(x).max(axis=-1, keepdims=True), np.float32(TINY))
    row_scale = (peak / np.float32(ROW_LEVELS)).astype(np.float32)
    codes = np.rint(x / row_scale)
    product = (codes.astype(np.int64) @ q.astype(np.int64)).astype(np.float32)
    return product * scale[None, :] * row_scale
