"""One weight as onnxruntime's block-quantized operators: ``MatMulNBits`` for a projection, ``GatherBlockQuantized``
for the token embedding; the weight quantized from floats (MLAS's round-to-nearest) or written from a ``Grid``.

A ``Packed`` weight is what one MatMulNBits node holds: the packed data ``[N, blocks, block * bits / 8]``, the
scales ``[N, blocks]`` and, for asymmetric weights, the packed zero points; a Grid with a per-block correction
(Q4_K's minimum: gguf_carry.py, kquant.py) holds it as extra weight rows fed by the activation's block sums
(``Packed.block_sums``). A weight may be several Packed parts side by side (a packed QKV whose v is wider): one
node each and a Concat. ``write_parts`` writes a weight's initializers (then only their names are kept), so a
4-bit lm_head written early can also serve the embedding's GatherBlockQuantized. The nodes go into any ``sink`` with ``initializer(name, array)``, ``constant(values)``
and ``node(op, inputs, outputs, name, domain, **attrs)`` (``graph_writer.GraphWriter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.export.gguf_blocks import BLOCK, Grid, correction_rows, pack_bits, pack_zero_points


@dataclass
class Packed:
    bits: int  # 4 or 8
    block: int  # weights per scale along K
    data: np.ndarray  # uint8 [N, blocks, block * bits / 8]
    scales: np.ndarray  # float32 [N, blocks]
    zero_points: np.ndarray | None  # uint8, packed (None: the default zero point, 8 or 128)
    k: int  # input rows the node reads: K, or K + the correction rows
    block_sums: bool = False  # the input is [x, block sums of x, block sums of x] (a Grid's correction rows)
    shape: tuple = ()  # (data shape, scales shape): kept once the arrays are written and dropped

    @property
    def n(self) -> int:
        return (self.data.shape if self.data is not None else self.shape[0])[0]


def pack_float(weight: np.ndarray, bits: int, block: int, symmetric: bool = True) -> Packed:
    """``weight`` [N, K] float32 through onnxruntime's own quantizer (MLAS round-to-nearest: the bytes the
    MatMulNBitsQuantizer writes)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    n, k = weight.shape
    blocks = -(-k // block)
    source = np.ascontiguousarray(weight.T, dtype=np.float32)  # MLAS reads B as [K, N], contiguous
    data = np.zeros((n, blocks, block * bits // 8), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zeros = np.zeros((n, -(-blocks // 2) if bits == 4 else blocks), np.uint8)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(data, source, scales, zeros, block, n, k,
                                                                     symmetric)
    return Packed(bits, block, data, scales, None if symmetric else zeros, k)


def pack_table(table: np.ndarray, block: int) -> Packed:
    """A token-embedding table [vocab, hidden] as 4-bit blocks of ``block`` along the hidden axis: symmetric
    round-to-nearest, scale max |w| / 7, the default zero point 8 (what GatherBlockQuantized reads; the traced
    exporter's ``quantize.quantize_embedding`` writes the same bytes)."""
    vocab, hidden = table.shape
    padded = -(-hidden // block) * block
    weights = np.zeros((vocab, padded), np.float32)
    weights[:, :hidden] = table
    blocks = weights.reshape(vocab, padded // block, block)
    scales = np.abs(blocks).max(axis=-1) / 7.0
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(blocks / scales[..., None]) + 8, 0, 15).astype(np.uint8).reshape(vocab, padded)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(vocab, padded // block, block // 2)
    return Packed(4, block, packed, scales.astype(np.float32), None, hidden)


def pack_grid(grid: Grid) -> Packed:
    """A Grid (block 32, default zero points) as MatMulNBits data; a correction becomes extra rows."""

    default = 8 if grid.bits == 4 else 128
    if not np.all(grid.zero == default):
        raise ValueError(f"a {grid.bits}-bit grid must use the default zero point {default}")
    q, scale = grid.q, grid.scale
    if grid.correction is not None:
        cq, cscale = correction_rows(grid.correction)
        q, scale = np.concatenate([q, cq], axis=1), np.concatenate([scale, cscale], axis=1)
    return Packed(grid.bits, BLOCK, pack_bits(q, grid.bits), scale.astype(np.float32), None, q.shape[1],
                  grid.correction is not None)


def _augmented(sink, x: str, k: int, cache: dict) -> str:
    """``x`` [B, T, K] with its K/32 block sums, padded to whole blocks, concatenated after it twice (the high- and
    low-nibble correction rows read the same sums); made once per activation (``cache``)."""
    if x not in cache:
        count = k // BLOCK
        pad = -(-count // BLOCK) * BLOCK - count
        blocks = sink.one("Reshape", [x, sink.constant([0, 0, count, BLOCK])], name=f"{x}/block_view")
        sums = sink.one("ReduceSum", [blocks, sink.constant([-1])], name=f"{x}/block_sums", keepdims=0)
        if pad:
            sums = sink.one("Pad", [sums, sink.constant([0, 0, 0, 0, 0, pad])], name=f"{x}/block_sums_padded")
        cache[x] = sink.one("Concat", [x, sums, sums], name=f"{x}/augmented", axis=-1)
    return cache[x]


def write_parts(sink, parts: list, name: str) -> list:
    """Write each part's initializers now; returns [(part, [data, scales(, zero points)] names)]. The arrays
    are dropped from the parts (the sink holds them): what ``matmul`` and ``gather_quantized`` take."""
    written = []
    for index, part in enumerate(parts):
        prefix = f"{name}.part{index}" if len(parts) > 1 else name
        names = [sink.initializer(f"{prefix}.weight_q{part.bits}", part.data),
                 sink.initializer(f"{prefix}.scales", part.scales)]
        if part.zero_points is not None:
            names.append(sink.initializer(f"{prefix}.zero_points", part.zero_points))
        shape = (part.data.shape, part.scales.shape)
        written.append((Packed(part.bits, part.block, None, None, None, part.k, part.block_sums, shape), names))
    return written


def matmul(sink, x: str, written: list, name: str, out: str, accuracy_level: int | None, k: int,
           block_sums: dict) -> str:
    """``out`` = x @ W for W held as ``written`` parts (``write_parts``) side by side along N; ``block_sums``
    caches augmented inputs."""
    level = {"accuracy_level": accuracy_level} if accuracy_level is not None else {}
    outputs = []
    for index, (part, names) in enumerate(written):
        prefix = f"{name}.part{index}" if len(written) > 1 else name
        inputs = [_augmented(sink, x, k, block_sums) if part.block_sums else x, *names]
        target = out if len(written) == 1 else f"{out}/part{index}"
        sink.node("MatMulNBits", inputs, [target], name=f"{prefix}/MatMulNBits", domain="com.microsoft",
                  K=part.k, N=part.n, bits=part.bits, block_size=part.block, **level)
        outputs.append(target)
    if len(written) > 1:
        sink.node("Concat", outputs, [out], name=f"{name}/concat", axis=-1)
    return out


def gather_quantized(sink, table, ids: str, name: str, out: str, hidden: int) -> str:
    """The embedding rows of ``ids`` from a quantized table [vocab, hidden]: a GatherBlockQuantized of its data.
    ``table``: a Grid, or one written part ``(Packed, names)`` of ``write_parts`` (a 4-bit lm_head holding the same
    table: the data is read through a Reshape, stored once)."""
    if isinstance(table, Grid):
        return _gather_grid(sink, table, ids, name, out)
    part, names = table
    (vocab, blocks, width), _ = part.shape
    padded = blocks * part.block
    rows = sink.one("Reshape", [names[0], sink.constant([vocab, blocks * width])], name=f"{name}/rows")
    inputs = [rows, ids, *names[1:]]
    gathered = out if padded == hidden else f"{out}/padded"
    sink.node("GatherBlockQuantized", inputs, [gathered], name=f"{name}/GatherBlockQuantized",
              domain="com.microsoft", bits=part.bits, block_size=part.block, gather_axis=0, quantize_axis=1)
    if padded != hidden:
        sink.node("Slice", [gathered, sink.constant([0]), sink.constant([hidden]), sink.constant([-1])], [out],
                  name=f"{name}/unpad")
    return out


def _gather_grid(sink, grid: Grid, ids: str, name: str, out: str) -> str:

    vocab, hidden = grid.q.shape
    data = sink.initializer(f"{name}.weight_q{grid.bits}", pack_bits(grid.q, grid.bits).reshape(vocab, -1))
    inputs = [data, ids, sink.initializer(f"{name}.scales", grid.scale.astype(np.float32))]
    if grid.bits == 4:  # 8-bit grids use GatherBlockQuantized's default zero point, 128
        inputs.append(sink.initializer(f"{name}.zero_points", pack_zero_points(grid.zero, 4)))
    gathered = out if grid.correction is None else f"{out}/grid"
    sink.node("GatherBlockQuantized", inputs, [gathered], name=f"{name}/GatherBlockQuantized",
              domain="com.microsoft", bits=grid.bits, block_size=BLOCK, gather_axis=0, quantize_axis=1)
    if grid.correction is None:
        return out
    corrections = sink.initializer(f"{name}.corrections", grid.correction.astype(np.float32))
    picked = sink.one("Gather", [corrections, ids], name=f"{name}/corrections", axis=0)
    blocks = sink.one("Reshape", [gathered, sink.constant([0, 0, hidden // BLOCK, BLOCK])], name=f"{name}/blocks")
    per_block = sink.one("Reshape", [picked, sink.constant([0, 0, hidden // BLOCK, 1])], name=f"{name}/per_block")
    corrected = sink.one("Add", [blocks, per_block], name=f"{name}/corrected")
    sink.node("Reshape", [corrected, sink.constant([0, 0, hidden])], [out], name=f"{name}/flat")
    return out
