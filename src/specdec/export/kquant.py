"""llama.cpp's Q4_K quantization of a float weight, as a ``gguf_blocks.Grid``: the ``k-quant`` method.

A weight ``[N, K]`` (rows: output channels) is cut along K into super-blocks of 256 = 8 sub-blocks of 32. Each
sub-block gets a scale and a minimum from ``make_qkx2_quants`` (llama.cpp ggml-quants.c): the importance of a
weight is ``rms(sub-block) + |w|``, 22 candidate scales ``(14 + 0.1 i) / (max - min)`` (and ``15 / (max - min)``)
are tried, each followed by the weighted least-squares scale and minimum for its rounding (the minimum held at
or below zero), and the candidate with the least weighted squared error is kept. The 8 scales and 8 minimums
of a super-block are then stored as 6-bit multiples of two fp16 steps (``d``, ``dmin``), and the weights
rounded again on the stored grid: ``w = d * sc_j * q - dmin * m_j``, q in 0..15, exactly what a Q4_K block holds
(``quantize_row_q4_K_ref``, the path llama-quantize takes without an importance matrix).

The result is a 4-bit Grid with zero point 8 and a per-block correction ``8 * d * sc_j - dmin * m_j``: the form
``gguf_carry`` writes into a MatMulNBits (the correction through extra rows fed by the activation's block
sums), so the float minimum is kept instead of being rounded to a 4-bit zero point (onnxruntime's own k-quant
rounds it, which gives back most of what the search won).

Vectorized in torch over row chunks (each chunk's temporaries stay near the L2 cache); the weighted error of a
candidate is expanded into per-block sums, so a candidate costs a few passes over the chunk. Against llama.cpp's
own ``quantize_row_q4_K_ref`` (tests/data/q4_k_llama_cpp.npz, made through its ggml library) over 99.9% of the
4-bit values are equal and the squared error the same to 0.1%: the rest are ties the two sums' rounding order
breaks differently.
"""

from __future__ import annotations

import numpy as np

from specdec.export.gguf_blocks import BLOCK, Grid

SUPER = 256  # weights per super-block (8 sub-blocks of 32)
STEPS = 20  # make_qkx2_quants' nstep: candidates 0..STEPS after the first
CHUNK_ROWS = 1 << 13  # sub-blocks per vectorized chunk (256 KiB of float32)
NARROW_ROWS = 8192  # rows of a wider grid turned to floats at a time


def _sub_block_fit(x):
    """x [R, 32] float32 torch -> (scale [R], minimum [R] <= 0): make_qkx2_quants(32, 15, rmin=-1, rdelta=0.1), as
    llama.cpp runs it: a candidate that wins moves the minimum the later candidates round against."""
    import torch

    weight = torch.sqrt((x * x).mean(-1, keepdim=True)) + x.abs()
    low = torch.clamp(x.amin(-1), max=0.0)
    high = x.amax(-1)
    flat = high == low
    wx = weight * x
    sum_w, sum_x, sum_x2 = weight.sum(-1), wx.sum(-1), (wx * x).sum(-1)
    levels, wl, product = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def sums(inverse, minimum):
        torch.sub(x, minimum[:, None], out=levels)
        levels.mul_(inverse[:, None]).round_().clamp_(0, 15)
        torch.mul(weight, levels, out=wl)
        torch.mul(wl, levels, out=product)
        sum_l2 = product.sum(-1)
        torch.mul(wx, levels, out=product)
        return wl.sum(-1), sum_l2, product.sum(-1)

    def error(scale, minimum, sum_l, sum_l2, sum_xl):  # sum of weight * (scale * l + minimum - x)^2
        return (scale * scale * sum_l2 + 2 * scale * minimum * sum_l - 2 * scale * sum_xl + minimum * minimum * sum_w
                - 2 * minimum * sum_x + sum_x2)

    span = torch.where(flat, torch.ones_like(high), high - low)
    inverse = 15.0 / span
    best_scale, best_min = 1.0 / inverse, low
    best_error = error(best_scale, best_min, *sums(inverse, low))
    for step in range(STEPS + 1):
        span = torch.where(flat, torch.ones_like(high), high - best_min)
        sum_l, sum_l2, sum_xl = sums((-1.0 + 0.1 * step + 15.0) / span, best_min)
        det = sum_w * sum_l2 - sum_l * sum_l
        solvable = det > 0
        det = torch.where(solvable, det, torch.ones_like(det))
        scale = (sum_w * sum_xl - sum_x * sum_l) / det
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / det
        above = minimum > 0  # a minimum above zero is held at zero and the scale refitted alone
        scale = torch.where(above, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), scale)
        minimum = torch.where(above, torch.zeros_like(minimum), minimum)
        candidate = error(scale, minimum, sum_l, sum_l2, sum_xl)
        better = solvable & (candidate < best_error)
        best_error = torch.where(better, candidate, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, minimum, best_min)
    return torch.where(flat, torch.zeros_like(best_scale), best_scale), best_min


def _fits(sub):
    """sub [R, 32] float32 torch -> (scale [R], offset [R] = -minimum >= 0) of every sub-block, in chunks."""
    import torch

    scales, offsets = torch.empty(sub.shape[0]), torch.empty(sub.shape[0])
    with torch.no_grad():
        for start in range(0, sub.shape[0], CHUNK_ROWS):
            scale, minimum = _sub_block_fit(sub[start:start + CHUNK_ROWS])
            scales[start:start + CHUNK_ROWS], offsets[start:start + CHUNK_ROWS] = scale, -minimum
    return scales, offsets


def _grid(sub, step, offset, n: int, k: int) -> Grid:
    """The 4-bit Grid of ``sub`` [n * k / 32, 32] on per-sub-block ``step`` and ``offset`` ([n * k / 32] torch):
    w = step * q - offset, q in 0..15 (a flat block, step 0, is its offset)."""
    import torch

    divisor = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.empty(sub.shape, dtype=torch.uint8)
    with torch.no_grad():
        for start in range(0, sub.shape[0], CHUNK_ROWS):
            end = start + CHUNK_ROWS
            levels = torch.round((sub[start:end] + offset[start:end, None]) / divisor[start:end, None]).clamp_(0, 15)
            levels[step[start:end] == 0] = 0
            q[start:end] = levels.to(torch.uint8)
    step, offset = step.numpy().reshape(n, k // BLOCK), offset.numpy().reshape(n, k // BLOCK)
    return Grid(4, q.numpy().reshape(n, k), step.astype(np.float32), np.full(step.shape, 8, np.uint8),
                (8 * step - offset).astype(np.float32))


def q4_k_grid(weight: np.ndarray) -> Grid:
    """The Q4_K grid of ``weight`` [N, K] float32 (K a multiple of 256; see ``q4_k_fits``)."""
    import torch

    n, k = weight.shape
    if k % SUPER:
        raise ValueError(f"Q4_K needs rows of whole super-blocks of {SUPER} weights, got {k}")
    sub = torch.from_numpy(np.ascontiguousarray(weight, np.float32)).reshape(-1, BLOCK)
    scales, minimums = _fits(sub)
    with torch.no_grad():
        scales, minimums = scales.reshape(-1, 8), minimums.reshape(-1, 8)  # per super-block
        top_scale, top_min = scales.amax(-1, keepdim=True), minimums.amax(-1, keepdim=True)
        six_scale = torch.clamp(torch.round(torch.where(top_scale > 0, 63.0 / top_scale, 0 * top_scale) * scales), max=63)
        six_min = torch.clamp(torch.round(torch.where(top_min > 0, 63.0 / top_min, 0 * top_min) * minimums), max=63)
        d = (top_scale / 63.0).half().float()  # stored as fp16, as a Q4_K block stores them
        dmin = (top_min / 63.0).half().float()
        step, offset = (d * six_scale).reshape(-1), (dmin * six_min).reshape(-1)  # per sub-block
    return _grid(sub, step, offset, n, k)


def q4_k_fits(weight_shape) -> bool:
    return weight_shape[-1] % SUPER == 0


def float_k_grid(weight: np.ndarray) -> Grid:
    """The same search for rows that are not whole super-blocks (K a multiple of 32 only: the Qwen2.5 0.5B's
    896-wide projections and table): each sub-block keeps the scale and minimum ``make_qkx2_quants`` found as
    floats, with no super-block to round them to 6 bits (a MatMulNBits block holds a float32 scale, and the
    correction rows a minimum). llama.cpp stores such rows as Q5_0 instead (``llama_tensor_get_type``'s fallback
    for k-quants), 5.5 bits per weight.

    Measured on the real pair from a float folder (benchmarks/results/2026-12-04-float-k-grid): the 0.5B as its
    own model goes from +4.2% perplexity over llama.cpp's Q4_K_M of the same folder (symmetric 4-bit rounding)
    to +0.55%, but as the draft it steps 1.15x the time for +0.01 accepted tokens per proposal, and the pair
    decodes 0.96x as fast: the export gives it to targets only (``WeightPlan.float_scales``)."""
    import torch

    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"a grid needs rows of whole blocks of {BLOCK} weights, got {k}")
    sub = torch.from_numpy(np.ascontiguousarray(weight, np.float32)).reshape(-1, BLOCK)
    return _grid(sub, *_fits(sub), n, k)


def symmetric_grid(weight: np.ndarray, bits: int) -> Grid:
    """Round-to-nearest on a symmetric grid per block of 32 (scale max|w| / 7 or / 127, default zero point)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"a grid needs rows of whole blocks of {BLOCK} weights, got {k}")
    top = 7.0 if bits == 4 else 127.0
    blocks = weight.reshape(n, -1, BLOCK)
    scale = np.abs(blocks).max(axis=-1) / top
    scale[scale == 0] = 1.0
    zero = 8 if bits == 4 else 128
    q = np.clip(np.rint(blocks / scale[..., None]), -top - (bits == 4), top) + zero
    return Grid(bits, q.astype(np.uint8).reshape(n, k), scale.astype(np.float32), np.full(scale.shape, zero, np.uint8),
                None)


def narrowed(grid: Grid, float_scales: bool = True) -> Grid:
    """A GGUF tensor held in more than 4 bits (an 8-bit grid of Q5_0, Q8_0 or Q6_K values) on a 4-bit grid
    (``gguf-int4``), in row chunks (a 150k-row lm_head's float copy would be several GB); a 4-bit grid as it is.
    ``float_scales`` (the target's): the float-scale search over its values (``float_k_grid``); else (the draft's)
    symmetric rounding at max |w| / 7 (``symmetric_grid``), which needs no correction rows.

    Measured on the Qwen2.5-Coder pair (benchmarks/results/2026-12-04-float-k-grid): the search takes the target
    from 3.6653 to 3.6545 perplexity (``specdec eval``, c=512) at the same pass cost (0.99x at T=1, 1.01x at T=5)
    and the draft from 6.6826 to 6.5485, but the draft, whose GGUF holds almost every projection in Q5_0, then
    steps 1.12x the time (the minimums' correction rows) for +0.01 accepted tokens per proposal on the same texts,
    and the pair decoded 0.94x as fast. Before the search, the symmetric rounding had beaten a per-block
    least-squares scale search without a minimum (target 3.731 / draft 6.848: it clipped the largest weights) and
    llama.cpp's Q4_0 rounding (largest |w| kept at -8: 3.706 / 6.990)."""
    from dataclasses import replace

    if grid.bits == 4:
        return grid
    fit = float_k_grid if float_scales else (lambda values: symmetric_grid(values, 4))
    parts = []
    for start in range(0, grid.q.shape[0], NARROW_ROWS):
        rows = slice(start, start + NARROW_ROWS)
        part = replace(grid, q=grid.q[rows], scale=grid.scale[rows], zero=grid.zero[rows],
                       correction=None if grid.correction is None else grid.correction[rows])
        parts.append(fit(part.values()))
    joined = {name: np.concatenate([getattr(p, name) for p in parts]) for name in ("q", "scale", "zero")}
    correction = None if parts[0].correction is None else np.concatenate([p.correction for p in parts])
    return Grid(4, joined["q"], joined["scale"], joined["zero"], correction, 0.0)
