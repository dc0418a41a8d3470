"""A GGUF tensor's quantized blocks as integer grids in blocks of 32: what MatMulNBits can hold.

``grid_of(data, kind)`` decodes the raw blocks of one GGUF tensor (``data``: uint8 [N rows, bytes per row], the
rows being what a MatMul weight holds as columns) into a ``Grid``: per weight an unsigned integer, per block of 32
weights along a row a float scale, an integer zero point and (Q4_K only) a float correction, so that

    weight[n, k] = scale[n, b] * (q[n, k] - zero[n, b]) + correction[n, b],   b = k // 32

| GGUF type | its blocks | as a Grid | equal to the GGUF's weights? |
|---|---|---|---|
| Q4_K | super-blocks of 256, sub-blocks of 32: w = d_b * q - m_b | 4-bit, scale d_b, zero point 8, correction 8 * d_b - m_b | yes (the correction carries the minimum) |
| Q5_0 | 32: w = d * (q - 16) | 8-bit, scale d | yes |
| Q8_0 | 32: w = d * q | 8-bit, scale d | yes |
| Q6_K | super-blocks of 256, sub-blocks of 16: w = d * s_j * (q - 32) | 8-bit, one scale per two sub-blocks | yes where the two sub-blocks' scales share a factor that keeps every value in int8 (``Grid.exact_blocks``), else the nearest 8-bit value (within 1/8 of a Q6_K step) |

Every zero point is MatMulNBits' default (8 for 4 bits, 128 for 8 bits): its kernels run no zero-point path
(on a 2-core AVX2 CPU, 4-bit zero points cost 21% per 1536 x 8960 product at one row). The decoding follows the
gguf package's own ``dequantize_blocks`` (the code transformers dequantizes with), so
``values()`` of a Grid equals ``gguf.quants.dequantize`` of the same blocks up to float32 rounding (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per scale in every Grid: the MatMulNBits block size the carried weights use
KINDS = ("Q4_K", "Q5_0", "Q8_0", "Q6_K")


@dataclass(frozen=True)
class Grid:
    """One tensor's weights as integers on per-block grids (module docstring)."""

    bits: int  # 4 or 8
    q: np.ndarray  # [N, K] uint8: 0..15 (bits 4) or 0..255 (bits 8)
    scale: np.ndarray  # [N, K/32] float32
    zero: np.ndarray  # [N, K/32] uint8: 0..15 or 0..255
    correction: np.ndarray | None  # [N, K/32] float32 added to every weight of the block, or None
    exact_blocks: float = 1.0  # share of blocks whose grid holds the GGUF's values exactly

    def values(self) -> np.ndarray:
        """[N, K] float32 weights the grid stands for."""
        n, k = self.q.shape
        blocks = (self.q.reshape(n, -1, BLOCK).astype(np.float32) - self.zero[..., None]) * self.scale[..., None]
        if self.correction is not None:
            blocks = blocks + self.correction[..., None]
        return blocks.reshape(n, k)


def grid_of(data: np.ndarray, kind: str) -> Grid:
    """The Grid of a GGUF tensor's raw blocks: ``data`` uint8 [N, bytes per row], ``kind`` one of ``KINDS``."""
    if kind not in KINDS:
        raise ValueError(f"GGUF type {kind} is not carried over (carried: {', '.join(KINDS)})")
    rows = data.shape[0]
    return {"Q4_K": _q4_k, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q6_K": _q6_k}[kind](np.ascontiguousarray(data), rows)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[blocks, 1] float32 of the fp16 at byte ``start`` of every block (blocks: uint8 [blocks, bytes])."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _q4_k(data: np.ndarray, rows: int) -> Grid:
    from gguf.quants import Q4_K

    blocks = data.reshape(-1, 144)  # [super-blocks, 144]: d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
    count = blocks.shape[0]
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = _fp16(blocks, 0) * sc.astype(np.float32)  # [super-blocks, 8]
    minimum = _fp16(blocks, 2) * mn.astype(np.float32)
    nibbles = blocks[:, 16:].reshape(count, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (nibbles & np.uint8(0x0F)).reshape(rows, -1)
    scale, minimum = scale.reshape(rows, -1), minimum.reshape(rows, -1)
    zero = np.full(scale.shape, 8, np.uint8)
    return Grid(4, q, scale, zero, (8 * scale - minimum).astype(np.float32))


def _q5_0(data: np.ndarray, rows: int) -> Grid:
    blocks = data.reshape(-1, 22)  # d, 4 bytes of high bits, 16 bytes of nibbles
    count = blocks.shape[0]
    high = blocks[:, 2:6].copy().view(np.uint32).reshape(count, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    low = blocks[:, 6:].reshape(count, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    value = (low & np.uint8(0x0F)).reshape(count, 32) | ((high & np.uint32(1)).astype(np.uint8) << np.uint8(4))
    q = (value.astype(np.int16) - 16 + 128).astype(np.uint8).reshape(rows, -1)
    return Grid(8, q, _fp16(blocks, 0).reshape(rows, -1), np.full((rows, q.shape[1] // BLOCK), 128, np.uint8), None)


def _q8_0(data: np.ndarray, rows: int) -> Grid:
    blocks = data.reshape(-1, 34)  # d, 32 int8
    q = (blocks[:, 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(rows, -1)
    return Grid(8, q, _fp16(blocks, 0).reshape(rows, -1), np.full((rows, q.shape[1] // BLOCK), 128, np.uint8), None)


def _q6_k(data: np.ndarray, rows: int) -> Grid:
    from gguf.quants import Q6_K

    blocks = data.reshape(-1, 210)  # 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, d
    count = blocks.shape[0]
    values = Q6_K.dequantize_blocks(blocks).reshape(count * 8, 2, 16)  # [32-blocks, 2 sub-blocks, 16]
    sub_scales = blocks[:, 192:208].copy().view(np.int8).astype(np.int32).reshape(count * 8, 2)
    d = np.repeat(_fp16(blocks, 208)[:, 0], 8)  # [32-blocks]
    # exact where both sub-blocks' values are multiples of one step d * g that int8 reaches: g = gcd(s1, s2)
    common = np.gcd(sub_scales[:, 0], sub_scales[:, 1])
    common[common == 0] = 1
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.rint(values / (d * common)[:, None, None])
    exact = (np.abs(steps).reshape(-1, 32).max(axis=1) <= 127) & np.isfinite(steps).reshape(-1, 32).all(axis=1)
    flat = values.reshape(-1, 32)
    nearest = np.abs(flat).max(axis=1) / 127.0
    nearest[nearest == 0] = 1.0
    scale = np.where(exact, (d * common).astype(np.float32), nearest).astype(np.float32)
    q = np.clip(np.rint(flat / scale[:, None]), -127, 127).astype(np.int16) + 128
    return Grid(8, q.astype(np.uint8).reshape(rows, -1), scale.reshape(rows, -1),
                np.full((rows, flat.shape[0] // rows), 128, np.uint8), None, float(exact.mean()))


def concat_grids(grids: list[Grid]) -> Grid:
    """Grids side by side (rows: output columns); a grid without corrections gets zeros if another has them."""
    def cat(name):
        parts = [getattr(g, name) for g in grids]
        return np.concatenate(parts, axis=0)

    corrections = None
    if any(g.correction is not None for g in grids):
        corrections = np.concatenate([g.correction if g.correction is not None else np.zeros_like(g.scale)
                                      for g in grids], axis=0)
    return Grid(grids[0].bits, cat("q"), cat("scale"), cat("zero"), corrections)


def join_runs(grids: list[tuple[str, Grid]]) -> list[tuple[Grid, list]]:
    """Consecutive (GGUF type, grid) pairs of the same width, joined: [(grid, [GGUF types])]."""
    runs = []
    for kind, grid in grids:
        shape = grid.bits
        if runs and runs[-1][0] == shape:
            runs[-1][1].append(grid)
            runs[-1][2].append(kind)
        else:
            runs.append((shape, [grid], [kind]))
    return [(concat_grids(parts) if len(parts) > 1 else parts[0], kinds) for _, parts, kinds in runs]


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """[N, K'] integers -> MatMulNBits data [N, blocks, 32 * bits / 8] uint8 (4-bit: low nibble first)."""
    n, k = q.shape
    blocks = -(-k // BLOCK)
    padded = np.zeros((n, blocks * BLOCK), np.uint8)
    padded[:, :k] = q
    if bits == 4:
        padded = padded[:, 0::2] | (padded[:, 1::2] << 4)
    return padded.reshape(n, blocks, -1)


def pack_zero_points(zero: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return zero
    if zero.shape[1] % 2:
        zero = np.concatenate([zero, np.zeros((zero.shape[0], 1), np.uint8)], axis=1)
    return zero[:, 0::2] | (zero[:, 1::2] << 4)


def correction_rows(correction: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The corrections ([N, C] float32, one per block of 32 weights) as two 4-bit rows each, zero point 8:
    (q [N, 2 * Cp] high nibbles then low nibbles, scales [N, 2 * Cp / 32]), Cp = C padded to whole blocks.
    correction = s * (16 * (hi - 8) + (lo - 8)) = s * v, v = rint(correction / s) in -119..119, s per 32."""
    n, count = correction.shape
    blocks = -(-count // BLOCK)
    padded = np.zeros((n, blocks, BLOCK), np.float32)
    padded.reshape(n, -1)[:, :count] = correction
    step = np.abs(padded).max(axis=-1) / 119.0  # [N, blocks]
    step[step == 0] = 1.0
    value = np.clip(np.rint(padded / step[..., None]), -119, 119).astype(np.int16) + 136  # 17..255 = 16 hi + lo
    high, low = (value // 16).astype(np.uint8), (value % 16).astype(np.uint8)
    q = np.concatenate([high.reshape(n, -1), low.reshape(n, -1)], axis=1)
    return q, np.concatenate([16 * step, step], axis=1).astype(np.float32)
