"""Folded attention: the fused graph's attention reading every cache row once per pass.

onnxruntime's CPU GroupQueryAttention loops over query heads, so each of the G query heads that share a KV head
streams that head's keys and values again: a pass at depth reads the cache G times (6-7x for Qwen2.5). Here the G
query heads of a KV head are folded into the rows of one matrix, ``[G * T, D]``, and attention per KV head is one
Gemm against its keys, a softmax and one MatMul with its values: the cache is read once.

Each KV head's rows are their own graph input, ``past.{l}.key.{h}`` ``[cache_rows, D]``: the runtime binds a view
of the layer's ``[kv_heads, slots, D]`` buffer (one head's slots are contiguous), ``cache_rows`` a multiple of its
chunk at or past the pass's total (columns past the total are blocked by the bias, so they add exact zeros). The
new rows (rotated keys, values) go in with a ScatterND whose output ``present.{l}.key.{h}`` the runtime binds to
the same view: onnxruntime's ScatterND copies its input only when the output is another buffer, so the T rows are
written in place and the Gemm reads the updated rows. Nothing past-sized is copied; a float16 or int8 cache adds a
Cast of the rows read (memory for speed). An int8 cache (llama.cpp's ``q8_0`` KV, a scale per row of ``head_dim``
values instead of per 32) keeps a float32 scale per row in ``past.{l}.key_scale.{h}`` ``[cache_rows, 1]``, written
beside the rows and applied to the scores' and probabilities' columns (``attend``).

Rows stay exact: every query row is at least the second row of its Gemm (a KV head with one query head folds a
copy of its rows beside them), the tiled kernel's rows do not depend on the row count, and a row's sums over the
cache run over the same slots in the same order whatever the pass (blocked columns add exact zeros). One more
condition holds them exact when onnxruntime runs a product on several threads: its SGEMM (MLAS) splits the
columns between threads while a product has fewer rows than columns and the rows otherwise, and a thread's
column count sets how the sum over the cache is blocked (128 columns: blocks of 128 cache rows; 64: blocks of
256), so a wide pass's rows round apart from a one-token pass's. The product with the values (``head_dim``
columns) must therefore take at most ``head_dim - 1`` rows at a time: a wider pass (a prefill chunk) runs the
whole attention of a KV head as a Scan over token chunks of fewer folded rows (``attend``). The scores' product
sums over ``head_dim`` only (one block) and would need nothing; running it per chunk too keeps a wide pass's
scores, probabilities and biases one chunk's size (a 64-token chunk at 27k cached tokens: about 10 MB each
instead of 41 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.contract.manifest import PAST_LENGTH, fused_kv_names
from specdec.export.graph_writer import GraphWriter
from specdec.export.kv_smoothing import smoothing_name

_ONNX_FLOAT, _ONNX_FLOAT16, _ONNX_INT8 = 1, 10, 3
_SMALLEST_SCALE = 1e-30  # an all-zero row's scale (its steps are 0 either way)


def fold_copies(g) -> int:
    """How many times the query rows of a KV head are stacked: 2 when a KV head has one query head (the rows must
    not be a Gemm's only row), else 1."""
    return 2 if g.heads // g.kv_heads == 1 else 1


def folded_shared(w: GraphWriter, g, cos: np.ndarray, sin: np.ndarray) -> dict:
    """What every layer reads: the new rows' slot indices [1, T, 1], how the pass's folded rows are cut (``row_plan``),
    the biases laid out for those rows (``folded_bias``), the rotary tables."""
    count = w.one("Shape", ["position_ids"], name="fold/count", start=1, end=2)  # [1]: T
    end = w.one("Add", [PAST_LENGTH, count], name="fold/end")
    scalar = w.constant([0])
    slots = w.one("Range", [w.one("Squeeze", [PAST_LENGTH, scalar], name="fold/start"),
                            w.one("Squeeze", [end, scalar], name="fold/stop"), w.constant(1)], name="fold/slots")
    shared = {"slots": w.one("Unsqueeze", [slots, w.constant([0, 2])], name="fold/slot_index"),  # [1, T, 1]
              "cos": w.initializer("cos_cache", cos), "sin": w.initializer("sin_cache", sin)}
    shared["plan"] = plan = row_plan(w, count, fold_copies(g) * (g.heads // g.kv_heads), g.head_dim)
    biases = [("bias", "attention_bias")] + ([("sliding_bias", "sliding_attention_bias")]
                                             if g.sliding_window is not None else [])
    for key, name in biases:
        flat = w.one("Squeeze", [name, w.constant([0, 1])], name=f"fold/{key}_rows")  # [T, cache_rows]
        shared[key] = folded_bias(w, flat, plan, f"fold/{key}")
    return shared


@dataclass(frozen=True)
class RowPlan:
    """How a pass's folded rows are cut (graph tensor names, computed once per pass). ``group_rows``: folded rows
    per token (copies x query heads per KV head); a pass of ``tokens`` (T) is narrow when T * group_rows <
    head_dim (one product per KV head), else ``count`` chunks of ``size`` tokens (T padded by ``pad``).
    ``narrow_tokens`` / ``narrow_rows``: T / the folded rows of a narrow pass, 0 for a wide one."""

    group_rows: int
    tokens: str  # [1] int64: T
    narrow: str  # bool scalar
    narrow_tokens: str  # [1] int64: T or 0
    narrow_rows: str  # [1] int64: group_rows * T or 0
    count: str  # [1] int64
    size: str  # [1] int64
    pad: str  # [1] int64


def row_plan(w: GraphWriter, tokens: str, group_rows: int, dim: int) -> RowPlan:
    """Chunks of at most (dim - 1) // group_rows tokens, as equal as padding allows: count = ceil(T / cap),
    size = ceil(T / count)."""
    cap = (dim - 1) // group_rows
    if cap < 1:
        raise ValueError(f"{group_rows} folded rows per token leave no chunk under head_dim {dim}")
    is_narrow = w.one("LessOrEqual", [tokens, w.constant([cap])], name="fold/is_narrow")  # [1] bool
    narrow = w.one("Squeeze", [is_narrow], name="fold/narrow")
    narrow_tokens = w.one("Mul", [tokens, w.one("Cast", [is_narrow], name="fold/narrow_one", to=7)],
                          name="fold/narrow_tokens")
    narrow_rows = w.one("Mul", [narrow_tokens, w.constant([group_rows])], name="fold/narrow_rows")
    count = w.one("Div", [w.one("Add", [tokens, w.constant([cap - 1])], name="fold/tokens_up"), w.constant([cap])],
                  name="fold/chunks")
    size = w.one("Div", [w.one("Sub", [w.one("Add", [tokens, count], name="fold/tokens_plus"), w.constant([1])],
                               name="fold/tokens_plus_less_one"), count], name="fold/chunk_tokens")
    pad = w.one("Sub", [w.one("Mul", [count, size], name="fold/padded_tokens"), tokens], name="fold/pad_tokens")
    return RowPlan(group_rows, tokens, narrow, narrow_tokens, narrow_rows, count, size, pad)


def folded_bias(w: GraphWriter, flat: str, plan: RowPlan, name: str) -> tuple[str, str]:
    """The bias rows every KV head adds to its scores, from flat [T, cache_rows]: (narrow, wide).
    narrow: [GR * T, cache_rows] for a narrow pass (row g * T + t is token t's), [0, cache_rows] for a wide one.
    wide: for a wide pass [count, GR * size, cache_rows], chunk c's row g * size + t token c * size + t's (padded
    tokens get zeros); for a narrow pass ``flat`` as [1, T, cache_rows], unread."""
    helper = w.onnx.helper
    steps = _Steps(helper, name)
    first = w.one("Slice", [flat, w.constant([0]), plan.narrow_tokens, w.constant([0])], name=f"{name}_narrow_flat")
    narrow = w.one("Tile", [first, w.constant([plan.group_rows, 1])], name=f"{name}_narrow")
    unread = helper.make_graph([steps.node("Unsqueeze", [flat, w.constant([0])], "unread")],
                               f"{name}_unread", [], [_float_value(helper, steps("unread"))])
    chunked = [
        steps.node("Concat", [w.constant([0]), w.constant([0]), plan.pad, w.constant([0])], "pads", axis=0),
        steps.node("Pad", [flat, steps("pads")], "padded"),  # [count * size, cache_rows]
        steps.node("Concat", [plan.count, w.constant([1]), plan.size, w.constant([-1])], "chunk_shape", axis=0),
        steps.node("Reshape", [steps("padded"), steps("chunk_shape")], "chunks"),  # [count, 1, size, cache_rows]
        steps.node("Tile", [steps("chunks"), w.constant([1, plan.group_rows, 1, 1])], "tiled"),
        steps.node("Mul", [plan.size, w.constant([plan.group_rows])], "chunk_rows"),
        steps.node("Concat", [plan.count, steps("chunk_rows"), w.constant([-1])], "rows_shape", axis=0),
        steps.node("Reshape", [steps("tiled"), steps("rows_shape")], "wide"),  # [count, GR * size, cache_rows]
    ]
    wide = helper.make_graph(chunked, f"{name}_chunked_rows", [], [_float_value(helper, steps("wide"))])
    return narrow, w.one("If", [plan.narrow], name=f"{name}_wide", then_branch=unread, else_branch=wide)


def folded_layer(w: GraphWriter, g, index: int, q: str, k: str, v: str, shared: dict, bias: tuple[str, str],
                 kv_dtype: str, key_smoothing: np.ndarray | None = None) -> str:
    """Layer ``index``'s attention rows [1, T, H * D] from q [1, T, H * D], k / v [1, T, KVH * D] (before the
    rotary embedding); writes the new rows into each KV head's cache view. ``key_smoothing``: [KVH, D] factors
    (an int8 cache's, ``kv_smoothing.py``): each KV head's rotated keys are stored divided by them and its queries
    multiplied by them."""
    prefix = f"layers.{index}/attention"
    group, heads, kv_heads, dim = g.heads // g.kv_heads, g.heads, g.kv_heads, g.head_dim
    copies = fold_copies(g)
    rotated = {}
    for name, x, count in (("q", q, heads), ("k", k, kv_heads)):
        rotated[name] = w.one("RotaryEmbedding", [x, "position_ids", shared["cos"], shared["sin"]],
                              name=f"{prefix}/{name}_rotary", domain="com.microsoft", num_heads=count, interleaved=0)
    per_head = _new_rows(w, rotated["k"], v, kv_heads, kv_dtype, prefix)
    # q [1, T, H*D] -> KVH x [G*T, D]: row g*T + t of KV head h is query head h*G + g at new token t
    grouped = w.one("Reshape", [rotated["q"], w.constant([-1, kv_heads, group, dim])], name=f"{prefix}/q_rows")
    grouped = w.one("Transpose", [grouped], name=f"{prefix}/q_heads", perm=[1, 2, 0, 3])  # [KVH, G, T, D]
    if copies > 1:  # [KVH, G * T, D] stacked `copies` times along its rows
        grouped = w.one("Reshape", [grouped, w.constant([kv_heads, -1, dim])], name=f"{prefix}/q_folded")
        grouped = w.one("Tile", [grouped, w.constant([1, copies, 1])], name=f"{prefix}/q_copies")
    stacked = w.one("Reshape", [grouped, w.constant([-1, dim])], name=f"{prefix}/q_stacked")  # [KVH * GR * T, D]
    queries = _split(w, stacked, kv_heads, 0, f"{prefix}/q")
    names = fused_kv_names(g.layers)[index]
    outputs = []
    if key_smoothing is not None:
        for head in range(kv_heads):
            factors = np.asarray(key_smoothing[head], dtype=np.float32)
            queries[head] = w.one("Mul", [queries[head], w.initializer(smoothing_name(index, head), factors)],
                                  name=f"{prefix}/q{head}_smoothed")
            per_head["k"][head] = w.one("Mul", [per_head["k"][head], w.initializer(
                f"{smoothing_name(index, head)}_inverse", (np.float32(1) / factors).astype(np.float32))],
                name=f"{prefix}/k{head}_smoothed")
    for head in range(kv_heads):
        cached, scales = {}, {}
        for kind, past, present in (("k", names.past_key, names.new_key), ("v", names.past_value, names.new_value)):
            new_rows = per_head[kind][head]
            if kv_dtype == "int8":
                new_rows, scale = _int8_rows(w, new_rows, f"{prefix}/{kind}{head}")
                scales[kind] = _scale_columns(w, w.node("ScatterND", [f"{past}_scale.{head}", shared["slots"], scale],
                                                        [f"{present}_scale.{head}"],
                                                        name=f"{prefix}/{kind}{head}_scale_write")[0],
                                              f"{prefix}/{kind}{head}")
            rows = w.node("ScatterND", [f"{past}.{head}", shared["slots"], new_rows], [f"{present}.{head}"],
                          name=f"{prefix}/{kind}{head}_write")[0]
            if kv_dtype != "float32":
                rows = w.one("Cast", [rows], name=f"{prefix}/{kind}{head}_float", to=_ONNX_FLOAT)
            cached[kind] = rows
        outputs.append(attend(w, queries[head], cached["k"], cached["v"], bias, shared["plan"], dim,
                              f"{prefix}/head{head}", scales.get("k"), scales.get("v")))
    out = w.one("Concat", outputs, name=f"{prefix}/out", axis=0) if kv_heads > 1 else outputs[0]
    out = w.one("Reshape", [out, w.constant([kv_heads, copies * group, -1, dim])], name=f"{prefix}/out_heads")
    if copies > 1:
        out = w.one("Slice", [out, w.constant([0]), w.constant([group]), w.constant([1])], name=f"{prefix}/out_first")
    out = w.one("Transpose", [out], name=f"{prefix}/out_tokens", perm=[2, 0, 1, 3])  # [T, KVH, G, D]
    return w.one("Reshape", [out, w.constant([1, -1, heads * dim])], name=f"{prefix}/rows")


def _int8_rows(w: GraphWriter, rows: str, name: str) -> tuple[str, str]:
    """An int8 cache's form of new rows [1, T, D] float32: (int8 rows [1, T, D], scales [1, T, 1]), each row
    symmetric with scale max|x| / 127 (``runners/kv_int8.quantize_rows`` is the same rule in numpy)."""
    peak = w.one("ReduceMax", [w.one("Abs", [rows], name=f"{name}_abs"), w.constant([-1])], name=f"{name}_peak",
                 keepdims=1)
    scale = w.one("Max", [w.one("Div", [peak, w.constant(127.0, np.float32)], name=f"{name}_scale_raw"),
                          w.constant(_SMALLEST_SCALE, np.float32)], name=f"{name}_scale")
    steps = w.one("Round", [w.one("Div", [rows, scale], name=f"{name}_steps_raw")], name=f"{name}_steps")
    clipped = w.one("Clip", [steps, w.constant(-127.0, np.float32), w.constant(127.0, np.float32)],
                    name=f"{name}_steps_clipped")
    return w.one("Cast", [clipped], name=f"{name}_int8", to=_ONNX_INT8), scale


def _scale_columns(w: GraphWriter, scales: str, name: str) -> str:
    """[cache_rows, 1] scales as one row [1, cache_rows]: a factor per cache column of the scores / probabilities."""
    return w.one("Reshape", [scales, w.constant([1, -1])], name=f"{name}_scale_row")


def _new_rows(w: GraphWriter, keys: str, values: str, kv_heads: int, kv_dtype: str, prefix: str) -> dict:
    """Each KV head's new cache rows [1, T, D] from the rotated keys and the values [1, T, KVH * D]: one Concat, one
    Cast to a float16 cache's type and one Split for all of them (``ScatterND`` takes [1, T, D] updates at the
    [1, T, 1] slots), instead of a reshape, transpose, cast, split and squeezes per tensor: each node costs a
    one-token pass about 2 us here, whatever it computes."""
    rows = w.one("Concat", [keys, values], name=f"{prefix}/kv_new", axis=-1)  # [1, T, 2 * KVH * D]
    if kv_dtype == "float16":
        rows = w.one("Cast", [rows], name=f"{prefix}/kv_half", to=_ONNX_FLOAT16)
    parts = _split(w, rows, 2 * kv_heads, -1, f"{prefix}/kv")
    return {"k": parts[:kv_heads], "v": parts[kv_heads:]}


def _split(w: GraphWriter, x: str, count: int, axis: int, name: str) -> list:
    """x cut into ``count`` equal parts along ``axis`` (x itself when count is 1)."""
    if count == 1:
        return [x]
    return w.node("Split", [x], count, name=f"{name}_split", axis=axis, num_outputs=count)


def attend(w: GraphWriter, queries: str, keys: str, values: str, bias: tuple[str, str], plan: RowPlan, dim: int,
           name: str, key_scales: str | None = None, value_scales: str | None = None) -> str:
    """One KV head's attention rows [GR * T, dim] from queries [GR * T, dim] (row g * T + t), keys / values
    [cache_rows, dim] and ``folded_bias``'s rows, each row as a one-token pass computes it.

    A narrow pass: one Gemm (scores), Softmax and MatMul (values). A wide pass: those run on no rows, and a Scan
    runs the same three products per token chunk (the queries padded and cut like the bias: chunk c's rows
    g * size + t), so every product keeps fewer rows than head_dim and no buffer is wider than one chunk's; keys
    and values are read once per chunk. The narrow pass's Gemm and Softmax stay in the main graph: inside an If
    their [rows, cache_rows] buffers made one-token passes at 27k cached tokens 6-11% slower (2 threads, Xeon).

    An int8 cache's rows come with a scale per cache row (``key_scales`` / ``value_scales``, [1, cache_rows]):
    the keys' multiplies the scores' columns (q . (s k) = s (q . k)) and the values' the probabilities' columns
    ((p s) V = p (s V)), so the products read the rows as cast, and each factor is elementwise: rows stay exact."""
    helper = w.onnx.helper
    steps = _Steps(helper, name)
    alpha, rows = float(dim ** -0.5), plan.group_rows
    narrow_bias, wide_bias = bias
    narrow_q = w.one("Slice", [queries, w.constant([0]), plan.narrow_rows, w.constant([0])], name=f"{name}_narrow_q")
    if key_scales is None:
        scores = w.one("Gemm", [narrow_q, keys, narrow_bias], name=f"{name}_scores", alpha=alpha, transB=1)
    else:
        products = w.one("Gemm", [narrow_q, keys], name=f"{name}_products", alpha=alpha, transB=1)
        scores = w.one("Add", [w.one("Mul", [products, key_scales], name=f"{name}_scaled"), narrow_bias],
                       name=f"{name}_scores")
    probs = w.one("Softmax", [scores], name=f"{name}_probs", axis=-1)
    one = [steps.node("MatMul", [probs, values], "whole")]
    if value_scales is not None:
        one = [steps.node("Mul", [probs, value_scales], "weights"), steps.node("MatMul", [steps("weights"), values], "whole")]
    whole = helper.make_graph(one, f"{name}_one_product", [], [_float_value(helper, steps("whole"))])
    if key_scales is None:
        chunk = [steps.node("Gemm", [steps("chunk_q"), keys, steps("chunk_bias")], "chunk_scores", alpha=alpha, transB=1)]
    else:
        chunk = [steps.node("Gemm", [steps("chunk_q"), keys], "chunk_products", alpha=alpha, transB=1),
                 steps.node("Mul", [steps("chunk_products"), key_scales], "chunk_scaled"),
                 steps.node("Add", [steps("chunk_scaled"), steps("chunk_bias")], "chunk_scores")]
    chunk.append(steps.node("Softmax", [steps("chunk_scores")], "chunk_probs", axis=-1))
    weights = steps("chunk_probs")
    if value_scales is not None:
        chunk.append(steps.node("Mul", [weights, value_scales], "chunk_weights"))
        weights = steps("chunk_weights")
    chunk.append(steps.node("MatMul", [weights, values], "chunk_out"))
    body = helper.make_graph(chunk, f"{name}_chunk_products",
                             [_float_value(helper, steps("chunk_q")), _float_value(helper, steps("chunk_bias"))],
                             [_float_value(helper, steps("chunk_out"))])
    zero = w.constant([0])
    chunked = [
        steps.node("Reshape", [queries, w.constant([rows, -1, dim])], "q_tokens"),  # [GR, T, dim]
        steps.node("Concat", [zero, zero, zero, zero, plan.pad, zero], "pads", axis=0),
        steps.node("Pad", [steps("q_tokens"), steps("pads")], "q_padded"),  # [GR, count * size, dim]
        steps.node("Concat", [w.constant([rows]), plan.count, plan.size, w.constant([dim])], "q_shape", axis=0),
        steps.node("Reshape", [steps("q_padded"), steps("q_shape")], "q_cut"),  # [GR, count, size, dim]
        steps.node("Transpose", [steps("q_cut")], "q_chunked", perm=[1, 0, 2, 3]),
        steps.node("Concat", [plan.count, w.constant([-1, dim])], "chunk_shape", axis=0),
        steps.node("Reshape", [steps("q_chunked"), steps("chunk_shape")], "q_chunks"),  # [count, GR * size, dim]
        steps.node("Scan", [steps("q_chunks"), wide_bias], "outs", num_scan_inputs=2, body=body),
        steps.node("Concat", [plan.count, w.constant([rows]), plan.size, w.constant([dim])], "out_shape", axis=0),
        steps.node("Reshape", [steps("outs"), steps("out_shape")], "outs_cut"),  # [count, GR, size, dim]
        steps.node("Transpose", [steps("outs_cut")], "outs_heads", perm=[1, 0, 2, 3]),  # [GR, count, size, dim]
        steps.node("Reshape", [steps("outs_heads"), w.constant([rows, -1, dim])], "outs_padded"),
        steps.node("Slice", [steps("outs_padded"), zero, plan.tokens, w.constant([1])], "outs_tokens"),
        steps.node("Reshape", [steps("outs_tokens"), w.constant([-1, dim])], "chunked"),  # [GR * T, dim]
    ]
    wide = helper.make_graph(chunked, f"{name}_chunked_products", [], [_float_value(helper, steps("chunked"))])
    return w.one("If", [plan.narrow], name=name, then_branch=whole, else_branch=wide)


class _Steps:
    """Nodes of a subgraph named under one prefix: ``steps("x")`` is the name of output x."""

    def __init__(self, helper, prefix: str):
        self.helper, self.prefix = helper, prefix

    def __call__(self, part: str) -> str:
        return f"{self.prefix}_{part}"

    def node(self, op: str, inputs: list, out: str, **attributes):
        return self.helper.make_node(op, inputs, [self(out)], name=self(out), **attributes)


def _float_value(helper, name: str):
    return helper.make_tensor_value_info(name, _ONNX_FLOAT, None)
