"""Weight-only quantization with onnxruntime's own tools, block-wise and symmetric.

- ``int4`` / ``int8``: every MatMul whose weight is a constant (projections, MLP, lm_head)
  becomes ``com.microsoft.MatMulNBits`` (bits=4 or 8): onnxruntime's fastest CPU form.
- ``int4-qdq``: the same weights as standard ONNX ``DequantizeLinear`` (int4, blocked:
  ``block_size`` attribute, opset 21) feeding a plain ``MatMul``: the form TensorRT 10.x builds as int4
  weight-only quantization; onnxruntime runs it too (its CPU optimizer fuses DQ + MatMul back
  into MatMulNBits).
Activations, the KV cache and attention stay in the model dtype.

With ``int4`` the token embedding is quantized too (``com.microsoft.GatherBlockQuantized``, the
same 4-bit blocks): a tied embedding reads the lm_head's MatMulNBits weights themselves, so
the table is stored once, in int4, instead of once in float32 beside the int4 lm_head.

How the int4 weights are chosen (``QuantRecipe``; each measured on the Qwen2.5-Coder pair: docs/bundle.md,
"int4 weights"):

- ``method``: ``rtn`` = onnxruntime's symmetric round-to-nearest (scale = max|w| / 7, zero point 8);
  ``rtn-asym`` = its min/max round-to-nearest with a 4-bit zero point per block; ``k-quant`` = llama.cpp's
  k-quant search (onnxruntime's ``quant_tensor_k_quant_cpu``: per block, the scale and minimum that minimise
  an importance-weighted squared error over 20 candidate scales), stored as a scale and a 4-bit zero point,
  quantized here in row chunks so the search's temporaries stay small. Zero points cost 4 bits per block
  (block 32: 5.125 bits per weight instead of 5.0) and no measurable time in MatMulNBits.
  Not offered: onnxruntime's HQQ writes float zero points, which its CPU MatMulNBits runs through a
  dequantizing fallback (~50x slower per pass in a 1536 x 8960 microbenchmark). A Q4_K block's minimum is
  not a whole number of steps, so it is no integer zero point either: ``gguf`` carries it another way.
- ``gguf``: for a model exported from a GGUF file, its weights written from the GGUF's own blocks instead of
  quantized again (``gguf_carry.py``: Q4_K as 4-bit with the default zero point and a per-block correction
  through extra rows fed by the activation's block sums, within 1/30 of a Q4_K step; Q5_0 / Q8_0 exactly and
  Q6_K within 1/8 of its step as 8-bit);
  a weight not found in the GGUF falls back to ``rtn``. The lm_head keeps its GGUF type (Q6_K / Q8_0: 8-bit).
  ``gguf-int4``: the same, but the tensors the GGUF holds in more than 4 bits are put on 4-bit grids (a target's
  by the float-scale k-quant search, a draft's symmetric, block 32: ``QuantRecipe.float_scales``) except
  ``GGUF_INT4_WIDE_ROLES`` (attn_v) and the lm_head with ``--lm-head-bits 8``: fewer bytes per token.
- ``lm_head_bits``: 8 stores the output projection as 8-bit MatMulNBits (llama.cpp's Q4_K_M keeps it at
  6 bits), at the cost of reading more bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

QUANTS = ("none", "int4", "int8", "int4-qdq")
BLOCK_SIZE = 32  # the target's default: the accuracy of onnxruntime-genai's CPU int4 models
# The draft's default. Its accuracy only moves the acceptance rate, never the output; measured on the
# Qwen2.5-Coder pair (12 public prompts, greedy g=2): block 128 makes a draft step 0.29x of a target
# step instead of 0.37x at the same acceptance (0.72), so every draft round is cheaper.
DRAFT_BLOCK_SIZE = 128
BLOCK_SIZES = (16, 32, 64, 128, 256)
QUANT_METHODS = ("rtn", "rtn-asym", "k-quant", "gguf", "gguf-int4")
GGUF_METHODS = ("gguf", "gguf-int4")
# gguf-int4 keeps these GGUF block roles at their width (8-bit) instead of rounding them to 4 bits: a Q4_K_M file
# holds attn_v as Q6_K in half the 1.5B's layers (Q5_0 / Q8_0 in the 0.5B's), 0.4% of the Qwen2.5-Coder 1.5B's
# weights, and keeping them moved its perplexity from +1.67% to +1.29% of llama.cpp's (docs/bundle.md); ffn_down's
# Q6_K half (12% of the weights) moved it only 0.19% further, for about 9-10% more bytes per token (estimated),
# and stays rounded.
GGUF_INT4_WIDE_ROLES = frozenset({"attn_v"})
LM_HEAD_BITS = (4, 8)
LAYER_PRODUCTS = ("nbits", "int8")
K_QUANT_CHUNK = 1 << 22  # weights per k-quant call: its ~10 float temporaries stay ~160 MB


@dataclass(frozen=True)
class QuantRecipe:
    """How int4 weights are chosen (module docstring). The default is the recipe measured best.

    ``float_scales``: a GGUF tensor wider than 4 bits (``gguf-int4``) or, in the streamed exporter, a row that is not
    whole Q4_K super-blocks (``k-quant``) takes the k-quant search with float scales and minimums (correction
    rows), else symmetric 4-bit rounding (the traced exporter's ``k-quant`` is onnxruntime's search on every row,
    whatever this says). True for targets (its perplexity is the output's); False for drafts (``ExportOptions.recipe_for``),
    whose quality only moves acceptance: the search made the real draft's steps 1.12-1.15x dearer for +0.01
    accepted tokens per proposal (``kquant.narrowed``)."""

    method: str = "rtn"
    lm_head_bits: int = 4
    float_scales: bool = True
    # "nbits": every projection a MatMulNBits; "int8": the decoder layers' projections as integer products of 7-bit
    # channel weights and 8-bit rows (int8_rows.py: prefill chunks ~4x faster, 8 bits per weight), the streamed
    # exporter's; the embedding and lm_head keep the method's int4
    layer_products: str = "nbits"

    def __post_init__(self):
        if self.layer_products not in LAYER_PRODUCTS:
            raise ValueError(f"--layer-products {self.layer_products!r} is not one of {', '.join(LAYER_PRODUCTS)}")
        if self.method not in QUANT_METHODS:
            raise ValueError(f"--quant-method {self.method!r} is not one of {', '.join(QUANT_METHODS)}")
        if self.lm_head_bits not in LM_HEAD_BITS:
            raise ValueError(f"--lm-head-bits {self.lm_head_bits!r} is not one of {', '.join(map(str, LM_HEAD_BITS))}")

    def to_dict(self) -> dict:
        return {"method": self.method, "lm_head_bits": self.lm_head_bits, "float_scales": self.float_scales,
                "layer_products": self.layer_products}


def quantize_onnx(src: Path, dst: Path, quant: str, accuracy_level: int | None = None, isolated: bool = True,
                  block_size: int = BLOCK_SIZE, recipe: QuantRecipe = QuantRecipe(),
                  gguf_path: Path | None = None) -> dict:
    """Quantize the model at ``src`` (ONNX + external data) into ``dst``; returns what the recipe reports
    (``gguf``: the carried tensors per GGUF type), else {}.

    ``gguf_path``: the GGUF file the model was loaded from (needed by the ``gguf`` method).

    ``isolated``: run in a fresh Python process. The quantizer holds the whole float model in
    memory; a fresh process does not add that to what the exporting process still holds (its
    allocator keeps freed PyTorch memory), which keeps the 1.5B export's peak lower.
    """
    if isolated:
        import subprocess
        import sys

        release_freed_memory()
        level = "none" if accuracy_level is None else str(accuracy_level)
        proc = subprocess.run([sys.executable, "-m", "specdec.export.quantize", str(src), str(dst), quant, level,
                               str(block_size), recipe.method, str(recipe.lm_head_bits), str(int(recipe.float_scales)),
                               str(gguf_path or "")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"quantization of {src.name} failed: {tail}")
        import json

        return json.loads((proc.stdout.strip().splitlines() or ["{}"])[-1])
    return _quantize(src, dst, quant, accuracy_level, block_size, recipe, gguf_path)


def release_freed_memory() -> None:
    """Give memory freed by Python/PyTorch back to the OS (glibc malloc_trim), where available."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _quantize(src: Path, dst: Path, quant: str, accuracy_level: int | None, block_size: int = BLOCK_SIZE,
              recipe: QuantRecipe = QuantRecipe(), gguf_path: Path | None = None) -> dict:
    import onnx
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if quant not in QUANTS[1:]:
        raise ValueError(f"quant {quant!r} is not one of {', '.join(QUANTS[1:])}")
    bits = 8 if quant == "int8" else 4
    quant_format = QuantFormat.QDQ if quant == "int4-qdq" else QuantFormat.QOperator
    if (recipe.method, recipe.lm_head_bits) != ("rtn", 4) and (bits != 4 or quant_format != QuantFormat.QOperator):
        raise ValueError(f"--quant-method / --lm-head-bits apply to --quant int4, not {quant}")
    if recipe.method in GGUF_METHODS and gguf_path is None:
        raise ValueError(f"--quant-method {recipe.method} needs a model loaded from a .gguf file")
    model = onnx.load(str(src), load_external_data=True)
    fold_weight_transposes(model)
    report = {}
    if recipe.method in GGUF_METHODS:  # first: what is not found in the GGUF is left to rtn below
        from specdec.export.gguf_carry import carry_gguf_weights

        head = _lm_head_node(model)
        wide = {n.input[1] for n in model.graph.node if n.name == head} if recipe.lm_head_bits == 8 else set()
        report = carry_gguf_weights(model, Path(gguf_path), accuracy_level, narrow=recipe.method == "gguf-int4",
                                    float_scales=recipe.float_scales,
                                    wide_weights=frozenset(wide), wide_roles=GGUF_INT4_WIDE_ROLES).to_dict()
    tied = _tied_lm_head_output(model) if bits == 4 and quant_format == QuantFormat.QOperator else None
    lm_head = _lm_head_node(model) if recipe.lm_head_bits != bits else None
    if recipe.method == "k-quant":
        k_quantize_matmuls(model, block_size, accuracy_level, skip={lm_head} - {None})
    else:
        symmetric = recipe.method in ("rtn", *GGUF_METHODS)
        config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                              accuracy_level=accuracy_level, bits=bits, quant_format=quant_format)
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                         accuracy_level=accuracy_level, algo_config=config,
                                         nodes_to_exclude=[lm_head] if lm_head else None)
        quantizer.process()
        model = quantizer.model.model
    if lm_head is not None:  # the one float MatMul left with a constant weight: the lm_head, at its own width
        config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                              bits=recipe.lm_head_bits, quant_format=quant_format)
        quantizer = MatMulNBitsQuantizer(model, bits=recipe.lm_head_bits, block_size=block_size, is_symmetric=True,
                                         accuracy_level=accuracy_level, algo_config=config)
        quantizer.process()
        model = quantizer.model.model
    if bits == 4 and quant_format == QuantFormat.QOperator:
        quantize_embedding(model, block_size, tied)
    dst.parent.mkdir(parents=True, exist_ok=True)
    from onnxruntime.quantization.onnx_model import ONNXModel

    ONNXModel(model).save_model_to_file(str(dst), use_external_data_format=True)
    return report


def _lm_head_node(model) -> str | None:
    """Name of the float MatMul (constant weight) that writes the ``logits`` output, or None."""
    initializers = {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MatMul" and "logits" in node.output and node.input[1] in initializers:
            return node.name
    return None


def k_quantize_matmuls(model, block_size: int, accuracy_level: int | None, skip=frozenset()) -> None:
    """Every MatMul with a constant 2-D float weight (not in ``skip``) becomes a 4-bit MatMulNBits whose scales and
    zero points come from llama.cpp's k-quant search (onnxruntime's ``quant_tensor_k_quant_cpu``), in place.

    The search runs over row chunks of the transposed weight (``K_QUANT_CHUNK`` weights each): it is exact per
    block, so chunking changes nothing but the size of its temporaries. Stored as onnxruntime's own quantizer
    stores asymmetric weights: data [N, blocks, block/2] (low nibble first), scales [N, blocks] float32, zero
    points [N, ceil(blocks/2)] (two per byte, low nibble first)."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    uses = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    for node in list(graph.node):
        tensor = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if tensor is None or node.name in skip or len(tensor.dims) != 2 or tensor.data_type != 1:
            continue
        rows, cols = tensor.dims  # K, N
        blocks = -(-rows // block_size)
        columns = np.zeros((cols, blocks * block_size), np.float32)  # [N, K padded]: blocks run along K
        columns[:, :rows] = numpy_helper.to_array(tensor).T
        q = np.empty((cols, blocks * block_size), np.uint8)
        scales = np.empty((cols, blocks), np.float32)
        zeros = np.zeros((cols, blocks + blocks % 2), np.uint8)
        step = max(1, K_QUANT_CHUNK // columns.shape[1])
        for start in range(0, cols, step):
            end = min(start + step, cols)
            part_q, part_scale, part_zero = quant_tensor_k_quant_cpu(columns[start:end], 4, block_size)
            q[start:end] = part_q.reshape(end - start, -1)
            scales[start:end] = part_scale.reshape(end - start, blocks)
            zeros[start:end, :blocks] = part_zero.reshape(end - start, blocks)
        del columns
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(cols, blocks, block_size // 2)
        packed_zeros = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
        prefix = node.input[1]
        names = (f"{prefix}_Q4", f"{prefix}_scales", f"{prefix}_zero_points")
        graph.initializer.extend([numpy_helper.from_array(packed, names[0]), numpy_helper.from_array(scales, names[1]),
                                  numpy_helper.from_array(packed_zeros, names[2])])
        level = {"accuracy_level": accuracy_level} if accuracy_level is not None else {}
        q_node = helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output), name=f"{node.name}_Q4",
                                  domain="com.microsoft", K=rows, N=cols, bits=4, block_size=block_size, **level)
        position = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(position, q_node)
        uses[prefix] -= 1
        if uses[prefix] == 0:
            graph.initializer.remove(tensor)
            del initializers[prefix]
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def fold_weight_transposes(model) -> None:
    """Replace ``MatMul(x, Transpose(W))`` on an initializer W by ``MatMul(x, W^T)``, in place.

    A tied lm_head exports as a Transpose of the embedding table (the exporter folds constants
    only below a size limit), which leaves it a float MatMul the quantizer cannot see. With the
    transposed copy as an initializer it becomes a MatMulNBits like every other projection, and
    ``quantize_embedding`` then stores the table once, in int4.
    """
    from onnx import numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.input[1] not in producers:
            continue
        transpose = producers[node.input[1]]
        perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
        source = initializers.get(transpose.input[0]) if transpose.op_type == "Transpose" else None
        if source is None or len(source.dims) != 2 or perm not in ([], [[1, 0]]):
            continue
        name = f"{transpose.input[0]}_transposed"
        if name not in initializers:
            initializers[name] = numpy_helper.from_array(numpy_helper.to_array(source).T.copy(), name)
            graph.initializer.append(initializers[name])
        node.input[1] = name
        if not any(transpose.output[0] in other.input for other in graph.node):
            graph.node.remove(transpose)


def _embedding_gather(graph):
    """The token-embedding Gather (reads ``input_ids`` from a 2-D float initializer), or None."""
    initializers = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Gather" and node.input[1] == "input_ids" and node.input[0] in initializers:
            table = initializers[node.input[0]]
            if len(table.dims) == 2:
                return node, table
    return None, None


def _tied_lm_head_output(model) -> str | None:
    """Output name of the float MatMul whose weight is the embedding table transposed (tied weights), or None."""
    from onnx import numpy_helper

    graph = model.graph
    gather, table = _embedding_gather(graph)
    if gather is None:
        return None
    vocab, hidden = table.dims
    rows = None
    initializers = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in initializers:
            weight = initializers[node.input[1]]
            if list(weight.dims) == [hidden, vocab]:  # a projection of the same shape can precede the lm_head
                rows = numpy_helper.to_array(table) if rows is None else rows
                if numpy_helper.to_array(weight).T.tobytes() == rows.tobytes():
                    return node.output[0]
    return None


def quantize_embedding(model, block_size: int, tied_output: str | None) -> None:
    """Replace the float embedding Gather with a 4-bit GatherBlockQuantized, in place.

    Tied (``tied_output``: the output of the lm_head that shares the table): the data and scales
    are that lm_head MatMulNBits's own initializers (its ``[vocab, blocks, block/2]`` uint8 weight
    seen as ``[vocab, hidden/2]`` through a Reshape), so the table is stored once. Untied: the table
    is quantized here the same way (symmetric, zero point 8, ``block_size`` weights per float scale
    along the hidden axis).
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    gather, table = _embedding_gather(graph)
    if gather is None:
        return
    vocab, hidden = table.dims
    padded = -(-hidden // block_size) * block_size
    prefix = gather.input[0]
    data_name, scales_name = None, None
    if tied_output is not None:
        for node in graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if (node.op_type == "MatMulNBits" and node.output[0] == tied_output and attrs.get("N") == vocab
                    and attrs.get("K") == hidden
                    and attrs.get("bits") == 4 and attrs.get("block_size") == block_size and len(node.input) == 3):
                data_name, scales_name = node.input[1], node.input[2]
    if data_name is None:  # untied, or no matching lm_head: quantize the table itself
        weights = np.zeros((vocab, padded), np.float32)
        weights[:, :hidden] = numpy_helper.to_array(table)
        blocks = weights.reshape(vocab, padded // block_size, block_size)
        scales = np.abs(blocks).max(axis=-1) / 7.0
        scales[scales == 0] = 1.0
        q = np.clip(np.rint(blocks / scales[..., None]) + 8, 0, 15).astype(np.uint8).reshape(vocab, padded)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)  # low nibble first
        data_name, scales_name = f"{prefix}_Q4", f"{prefix}_scales"
        graph.initializer.extend([numpy_helper.from_array(packed, data_name),
                                  numpy_helper.from_array(scales.astype(np.float32), scales_name)])
    shape_name = f"{prefix}_Q4_shape"
    graph.initializer.append(numpy_helper.from_array(np.array([vocab, padded // 2], np.int64), shape_name))
    flat = f"{prefix}_Q4_rows"
    out = gather.output[0]
    gathered = out if padded == hidden else f"{out}_padded"
    new_nodes = [
        helper.make_node("Reshape", [data_name, shape_name], [flat], name=f"{gather.name}_rows"),
        helper.make_node("GatherBlockQuantized", [flat, gather.input[1], scales_name], [gathered],
                         name=f"{gather.name}_q4", domain="com.microsoft", bits=4, block_size=block_size,
                         gather_axis=0, quantize_axis=1),
    ]
    if padded != hidden:  # the quantized rows are padded to whole blocks: cut the padding off
        for name, value in (("starts", 0), ("ends", hidden), ("axes", -1)):
            graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), f"{prefix}_slice_{name}"))
        new_nodes.append(helper.make_node("Slice", [gathered, f"{prefix}_slice_starts", f"{prefix}_slice_ends",
                                                    f"{prefix}_slice_axes"], [out], name=f"{gather.name}_unpad"))
    index = list(graph.node).index(gather)
    graph.node.remove(gather)
    for offset, node in enumerate(new_nodes):
        graph.node.insert(index + offset, node)
    if not any(prefix in node.input for node in graph.node):
        graph.initializer.remove(table)  # the float table is gone: stored once, in int4
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


if __name__ == "__main__":  # the isolated worker of quantize_onnx
    import sys

    import json

    _src, _dst, _quant, _level, _block, _method, _head, _float_scales, _gguf = sys.argv[1:10]
    _report = _quantize(Path(_src), Path(_dst), _quant, None if _level == "none" else int(_level), int(_block),
                        QuantRecipe(_method, int(_head), bool(int(_float_scales))), Path(_gguf) if _gguf else None)
    print(json.dumps(_report))
