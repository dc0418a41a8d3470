"""Quantization methods ``gguf`` / ``gguf-int4``: the float graph's weights carried over from the GGUF they were
dequantized from.

A model exported from a GGUF holds float32 copies of the GGUF's dequantized tensors. Quantizing those again
(round-to-nearest int4) stacks a second rounding on the first: measured on the Qwen2.5-Coder pair, perplexity
10% (target) and 17% (draft) above llama.cpp's on the same files. Here each MatMul weight and the token
embedding are found in the GGUF by value and written from the GGUF's own blocks (``gguf_blocks.Grid``):

- a weight is one GGUF tensor, or several side by side (the fused graph's packed QKV: q, k, v); every column
  range must equal a GGUF tensor's dequantized rows bit for bit, else the weight is left to the generic method;
- 4-bit grids (Q4_K) become a 4-bit MatMulNBits (zero point 8, the kernels' fast path). Q4_K's per-block
  minimum goes into ``correction[n, b]`` (one float per block of 32), applied as extra input rows of the same
  MatMulNBits: the activation's block sums (``ReduceSum`` over each 32, padded to whole blocks) are concatenated
  after it twice, and the extra rows hold each correction as 8 bits split into a high and a low nibble (their
  own scales, 16:1): within 1/30 of a Q4_K step of the GGUF's weights;
- 8-bit grids (Q5_0, Q8_0, Q6_K) become an 8-bit MatMulNBits (block 32);
- a weight whose columns mix 4- and 8-bit tensors (QKV where v is Q6_K) becomes one MatMulNBits per run of
  columns and a Concat;
- the embedding becomes a GatherBlockQuantized of the same grid (plus a Gather of the corrections);
- ``gguf-int4`` (``narrow``): 8-bit grids are put on 4-bit grids instead (``kquant.narrowed``: a target's by the
  float-scale search, a draft's symmetric), but the named
  ``wide_weights`` and the block roles in ``wide_roles`` (``quantize.GGUF_INT4_WIDE_ROLES``), so a token reads
  about the bytes of plain int4 while Q4_K tensors keep the GGUF's values.

Where a tensor is not found (another source, a type not in ``gguf_blocks.KINDS``), it is left as it is and the
caller's generic quantization takes it.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec.export.gguf_blocks import BLOCK, KINDS, Grid, grid_of, join_runs, pack_bits, pack_zero_points
from specdec.export.nbits import pack_grid

log = logging.getLogger(__name__)


@dataclass
class CarryReport:
    """What was carried: per GGUF type the tensors written from their blocks, and the weights left alone."""

    carried: dict = field(default_factory=dict)  # GGUF type -> count
    exact_blocks: dict = field(default_factory=dict)  # GGUF type -> share of blocks held exactly (Q6_K)
    left: list = field(default_factory=list)  # initializer names not found in the GGUF
    rounded: dict = field(default_factory=dict)  # GGUF type -> tensors rounded to 4 bits (gguf-int4), of those carried

    def to_dict(self) -> dict:
        return {"carried": dict(sorted(self.carried.items())), "left": len(self.left),
                "rounded_to_4_bits": dict(sorted(self.rounded.items())),
                "exact_blocks": {k: round(v, 4) for k, v in sorted(self.exact_blocks.items())}}


class GGUFTensors:
    """The 2-D tensors of one GGUF file, found by the value of their first dequantized row."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        self._dequantize = dequantize
        self._by_row = {}
        for tensor in GGUFReader(str(path)).tensors:
            kind = tensor.tensor_type.name
            if kind not in KINDS or len(tensor.shape) != 2:
                continue
            rows = tensor.data  # uint8 [N, bytes per row], memory-mapped
            first = dequantize(rows[:1], tensor.tensor_type).reshape(-1)
            self._by_row.setdefault(_key(first), []).append(tensor)

    def find(self, column: np.ndarray):
        """The tensors whose first dequantized row equals ``column`` (float32 [K]) bit for bit."""
        return self._by_row.get(_key(column), [])

    def values(self, tensor) -> np.ndarray:
        return self._dequantize(tensor.data, tensor.tensor_type).reshape(tensor.data.shape[0], -1)


def _key(row: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(row, np.float32).tobytes()).hexdigest()


def block_role(name: str) -> str:
    """``attn_v`` of ``blk.3.attn_v.weight``; a tensor outside the blocks (``output.weight``) has no role: "".
    A fused GGUF tensor (``attn_qkv``, other architectures) has its own role: its v is not ``attn_v``."""
    match = re.fullmatch(r"blk\.\d+\.([^.]+)\.weight", name)
    return match.group(1) if match else ""


def match_columns(weight: np.ndarray, tensors: GGUFTensors) -> list | None:
    """[(tensor, first column, end column)] covering ``weight`` ([K, N] float32), or None where any column range
    is not a GGUF tensor's dequantized rows."""
    segments, start = [], 0
    while start < weight.shape[1]:
        for tensor in tensors.find(weight[:, start]):
            end = start + tensor.data.shape[0]
            if end <= weight.shape[1] and np.array_equal(tensors.values(tensor).T, weight[:, start:end]):
                segments.append((tensor, start, end))
                start = end
                break
        else:
            return None
    return segments


def matmul_initializers(grid: Grid, prefix: str) -> tuple[int, list]:
    """(K' rows, [data, scales] TensorProtos) of one MatMulNBits holding ``grid`` (default zero points); with a
    correction K' = K + 2 * Cp (``gguf_blocks.correction_rows``: the rows the doubled, padded block sums feed)."""
    from onnx import numpy_helper

    packed = pack_grid(grid)
    return packed.k, [numpy_helper.from_array(packed.data, f"{prefix}_data"),
                      numpy_helper.from_array(packed.scales, f"{prefix}_scales")]


class _Builder:
    """Adds the carried nodes to one graph; block sums of each activation are made once and shared."""

    def __init__(self, model, accuracy_level: int | None):
        self.graph = model.graph
        self.level = {"accuracy_level": accuracy_level} if accuracy_level is not None else {}
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.block_sums = {}
        self.new_initializers = []

    def const(self, name: str, values) -> str:
        from onnx import numpy_helper

        if name not in self.initializers:
            tensor = numpy_helper.from_array(np.asarray(values, np.int64), name)
            self.initializers[name] = tensor
            self.new_initializers.append(tensor)
        return name

    def augmented(self, x: str, k: int, nodes: list) -> str:
        """``x`` ([..., K], rank 3: batch, new tokens, K) with its K/32 block sums, padded with zeros to whole blocks
        of 32, concatenated after it twice (the high- and low-nibble correction rows read the same sums)."""
        from onnx import helper

        if x not in self.block_sums:
            count = k // BLOCK
            pad = -(-count // BLOCK) * BLOCK - count
            shape = self.const(f"carry_blocks_{k}", [0, 0, count, BLOCK])
            axes = self.const("carry_last_axis", [-1])
            sums = f"{x}_carry_sums"
            nodes += [
                helper.make_node("Reshape", [x, shape], [f"{x}_carry_blocks"], name=f"{x}_carry_blocks"),
                helper.make_node("ReduceSum", [f"{x}_carry_blocks", axes], [sums], keepdims=0,
                                 name=f"{x}_carry_sums"),
            ]
            if pad:
                pads = self.const(f"carry_pad_{pad}", [0, 0, 0, 0, 0, pad])
                nodes.append(helper.make_node("Pad", [sums, pads], [f"{sums}_padded"], name=f"{x}_carry_pad"))
                sums = f"{sums}_padded"
            nodes.append(helper.make_node("Concat", [x, sums, sums], [f"{x}_carry_augmented"], axis=-1,
                                          name=f"{x}_carry_augment"))
            self.block_sums[x] = f"{x}_carry_augmented"
        return self.block_sums[x]

    def matmul(self, node, runs: list) -> list:
        """The nodes replacing MatMul ``node`` by the carried ``runs``."""
        from onnx import helper

        nodes, outputs = [], []
        for index, (grid, _) in enumerate(runs):
            prefix = f"{node.input[1]}_carried{index}"
            rows, tensors = matmul_initializers(grid, prefix)
            self.new_initializers += tensors
            x = node.input[0] if grid.correction is None else self.augmented(node.input[0], grid.q.shape[1], nodes)
            out = node.output[0] if len(runs) == 1 else f"{node.output[0]}_part{index}"
            nodes.append(helper.make_node("MatMulNBits", [x, *(t.name for t in tensors)], [out],
                                          name=f"{node.name}_carried{index}", domain="com.microsoft", K=rows,
                                          N=grid.q.shape[0], bits=grid.bits, block_size=BLOCK, **self.level))
            outputs.append(out)
        if len(runs) > 1:
            nodes.append(helper.make_node("Concat", outputs, [node.output[0]], axis=-1, name=f"{node.name}_concat"))
        return nodes

    def gather(self, node, grid: Grid) -> list:
        """The nodes replacing the embedding Gather ``node`` (indices rank 2) by a GatherBlockQuantized of ``grid``."""
        from onnx import helper, numpy_helper

        table, ids, out = node.input[0], node.input[1], node.output[0]
        vocab, hidden = grid.q.shape
        data = pack_bits(grid.q, grid.bits).reshape(vocab, -1)
        tensors = [numpy_helper.from_array(data, f"{table}_carried_data"),
                   numpy_helper.from_array(grid.scale.astype(np.float32), f"{table}_carried_scales")]
        if grid.bits == 4:  # 8-bit grids use GatherBlockQuantized's default zero point, 128
            tensors.append(numpy_helper.from_array(pack_zero_points(grid.zero, 4), f"{table}_carried_zero_points"))
        self.new_initializers += tensors
        gathered = out if grid.correction is None else f"{out}_embed_grid"
        nodes = [helper.make_node("GatherBlockQuantized", [tensors[0].name, ids, tensors[1].name]
                                  + ([tensors[2].name] if grid.bits == 4 else []), [gathered],
                                  name=f"{node.name}_carried", domain="com.microsoft", bits=grid.bits,
                                  block_size=BLOCK, gather_axis=0, quantize_axis=1)]
        if grid.correction is not None:
            corrections = numpy_helper.from_array(grid.correction.astype(np.float32), f"{table}_carried_corrections")
            self.new_initializers.append(corrections)
            blocks = self.const(f"carry_blocks_{hidden}", [0, 0, hidden // BLOCK, BLOCK])
            per_block = self.const(f"carry_per_block_{hidden}", [0, 0, hidden // BLOCK, 1])
            flat = self.const(f"carry_flat_{hidden}", [0, 0, hidden])
            nodes += [
                helper.make_node("Gather", [corrections.name, ids], [f"{out}_embed_corr"], axis=0, name=f"{node.name}_corr"),
                helper.make_node("Reshape", [gathered, blocks], [f"{out}_embed_grid_blocks"], name=f"{node.name}_blocks"),
                helper.make_node("Reshape", [f"{out}_embed_corr", per_block], [f"{out}_embed_corr_blocks"],
                                 name=f"{node.name}_corr_blocks"),
                helper.make_node("Add", [f"{out}_embed_grid_blocks", f"{out}_embed_corr_blocks"], [f"{out}_embed_blocks"],
                                 name=f"{node.name}_corrected"),
                helper.make_node("Reshape", [f"{out}_embed_blocks", flat], [out], name=f"{node.name}_flat"),
            ]
        return nodes


def carry_gguf_weights(model, gguf_path: Path, accuracy_level: int | None, narrow: bool = False,
                       wide_weights: frozenset = frozenset(), wide_roles: frozenset = frozenset(),
                       float_scales: bool = True) -> CarryReport:
    """Replace every MatMul (constant 2-D float weight) and the token-embedding Gather whose values are found in
    ``gguf_path`` by nodes holding the GGUF's own blocks, in place (module docstring).

    ``narrow``: every tensor the GGUF stores in more than 4 bits (Q5_0, Q6_K, Q8_0) is put on a 4-bit grid instead
    (``kquant.narrowed``: with ``float_scales`` the k-quant search with float scales over its values, else
    symmetric rounding) but the initializers named in ``wide_weights`` (e.g. the lm_head's) and the GGUF tensors
    of the block roles in ``wide_roles`` (``blk.N.ROLE.weight``, e.g. ``attn_v``), which keep their width even
    where they share a weight with 4-bit tensors (the packed QKV)."""
    from onnx import helper, numpy_helper

    from specdec.export.kquant import narrowed

    tensors = GGUFTensors(gguf_path)
    builder = _Builder(model, accuracy_level)
    graph, report = model.graph, CarryReport()
    uses = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    replaced = {}
    exact = {}  # GGUF type -> [exact blocks, blocks]
    for node in list(graph.node):
        is_matmul = node.op_type == "MatMul" and len(node.input) == 2
        is_embedding = node.op_type == "Gather" and node.input[1] == "input_ids"
        weight = builder.initializers.get(node.input[1] if is_matmul else node.input[0]) \
            if (is_matmul or is_embedding) else None
        if weight is None or len(weight.dims) != 2 or weight.data_type != 1:
            continue
        values = numpy_helper.to_array(weight)
        segments = match_columns(values if is_matmul else values.T, tensors)
        if segments is None or (is_embedding and len(segments) != 1):
            report.left.append(weight.name)
            continue
        grids = [(tensor.tensor_type.name, grid_of(tensor.data, tensor.tensor_type.name)) for tensor, _, _ in segments]
        if narrow and weight.name not in wide_weights:
            grids = [(kind, grid if block_role(tensor.name) in wide_roles else narrowed(grid, float_scales))
                     for (kind, grid), (tensor, _, _) in zip(grids, segments)]
        for kind, grid in grids:
            report.carried[kind] = report.carried.get(kind, 0) + 1
            if grid.bits == 4 and kind != "Q4_K":  # a wider type rounded (gguf-int4)
                report.rounded[kind] = report.rounded.get(kind, 0) + 1
            count = exact.setdefault(kind, [0.0, 0])
            count[0] += grid.exact_blocks * grid.scale.size  # a rounded grid holds none exactly
            count[1] += grid.scale.size
        runs = join_runs(grids)
        replaced[node.name] = builder.matmul(node, runs) if is_matmul else builder.gather(node, runs[0][0])
        del values
        uses[weight.name] -= 1
        if uses[weight.name] == 0:
            graph.initializer.remove(weight)
            del builder.initializers[weight.name]
    report.exact_blocks = {kind: held / total for kind, (held, total) in exact.items()}
    new_nodes = []
    for node in graph.node:
        new_nodes += replaced.get(node.name, [node])
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(builder.new_initializers)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    log.info("carried from %s: %s", gguf_path.name, report.to_dict())
    return report
