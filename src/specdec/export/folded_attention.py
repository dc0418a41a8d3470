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
written in place and the Gemm reads the updated rows. Nothing past-sized is copied; a float16 cache adds a Cast of
the rows read (memory for speed).

Rows stay exact: every query row is at least the second row of its Gemm (a KV head with one query head folds a
copy of its rows beside them), the tiled kernel's rows do not depend on the row count, and a row's sums over the
cache run over the same slots in the same order whatever the pass (blocked columns add exact zeros). One more
condition holds them exact when onnxruntime runs a product on several threads: its SGEMM (MLAS) splits the
columns between threads while a product has fewer rows than columns and the rows otherwise, and a thread's
column count sets how the sum over the cache is blocked (128 columns: blocks of 128 cache rows; 64: blocks of
256), so a wide pass's rows round apart from a one-token pass's. The product with the values (``head_dim``
columns) therefore takes at most ``head_dim - 1`` rows at a time: a wider pass runs it as a Scan over equal
row chunks (``values_product``). The scores' product sums over ``head_dim`` only (one block) and needs nothing.
"""

from __future__ import annotations

import numpy as np

from specdec.contract.manifest import PAST_LENGTH, fused_kv_names
from specdec.export.graph_writer import GraphWriter

_ONNX_FLOAT, _ONNX_FLOAT16 = 1, 10


def fold_copies(g) -> int:
    """How many times the query rows of a KV head are stacked: 2 when a KV head has one query head (the rows must
    not be a Gemm's only row), else 1."""
    return 2 if g.heads // g.kv_heads == 1 else 1


def folded_shared(w: GraphWriter, g, cos: np.ndarray, sin: np.ndarray) -> dict:
    """What every layer reads: the new rows' slot indices [T, 1], the biases tiled to the folded rows
    [copies * G * T, cache_rows], the rotary tables."""
    count = w.one("Shape", ["position_ids"], name="fold/count", start=1, end=2)  # [1]: T
    end = w.one("Add", [PAST_LENGTH, count], name="fold/end")
    scalar = w.constant([0])
    slots = w.one("Range", [w.one("Squeeze", [PAST_LENGTH, scalar], name="fold/start"),
                            w.one("Squeeze", [end, scalar], name="fold/stop"), w.constant(1)], name="fold/slots")
    shared = {"slots": w.one("Unsqueeze", [slots, w.constant([1])], name="fold/slot_index"),
              "cos": w.initializer("cos_cache", cos), "sin": w.initializer("sin_cache", sin)}
    tiles = w.constant([fold_copies(g) * (g.heads // g.kv_heads), 1])
    biases = [("bias", "attention_bias")] + ([("sliding_bias", "sliding_attention_bias")]
                                             if g.sliding_window is not None else [])
    for key, name in biases:
        flat = w.one("Squeeze", [name, w.constant([0, 1])], name=f"fold/{key}_rows")  # [T, cache_rows]
        shared[key] = w.one("Tile", [flat, tiles], name=f"fold/{key}")
    return shared


def folded_layer(w: GraphWriter, g, index: int, q: str, k: str, v: str, shared: dict, bias: str,
                 kv_dtype: str) -> str:
    """Layer ``index``'s attention rows [1, T, H * D] from q [1, T, H * D], k / v [1, T, KVH * D] (before the
    rotary embedding); writes the new rows into each KV head's cache view."""
    prefix = f"layers.{index}/attention"
    group, heads, kv_heads, dim = g.heads // g.kv_heads, g.heads, g.kv_heads, g.head_dim
    copies = fold_copies(g)
    rotated = {}
    for name, x, count in (("q", q, heads), ("k", k, kv_heads)):
        rotated[name] = w.one("RotaryEmbedding", [x, "position_ids", shared["cos"], shared["sin"]],
                              name=f"{prefix}/{name}_rotary", domain="com.microsoft", num_heads=count, interleaved=0)
    per_head = {}
    for name, x in (("k", rotated["k"]), ("v", v)):  # [1, T, KVH*D] -> KVH x [T, D]
        heads_first = w.one("Transpose", [w.one("Reshape", [x, w.constant([-1, kv_heads, dim])],
                                                name=f"{prefix}/{name}_rows")], name=f"{prefix}/{name}_heads",
                            perm=[1, 0, 2])
        if kv_dtype == "float16":
            heads_first = w.one("Cast", [heads_first], name=f"{prefix}/{name}_half", to=_ONNX_FLOAT16)
        per_head[name] = _split_heads(w, heads_first, kv_heads, f"{prefix}/{name}")
    # q [1, T, H*D] -> [KVH, G*T, D]: row g*T + t of KV head h is query head h*G + g at new token t
    grouped = w.one("Reshape", [rotated["q"], w.constant([-1, kv_heads, group, dim])], name=f"{prefix}/q_rows")
    grouped = w.one("Transpose", [grouped], name=f"{prefix}/q_heads", perm=[1, 2, 0, 3])  # [KVH, G, T, D]
    folded = w.one("Reshape", [grouped, w.constant([kv_heads, -1, dim])], name=f"{prefix}/q_folded")
    if copies > 1:
        folded = w.one("Tile", [folded, w.constant([1, copies, 1])], name=f"{prefix}/q_copies")
    queries = _split_heads(w, folded, kv_heads, f"{prefix}/q")
    names = fused_kv_names(g.layers)[index]
    outputs = []
    for head in range(kv_heads):
        cached = {}
        for kind, past, present in (("k", names.past_key, names.new_key), ("v", names.past_value, names.new_value)):
            rows = w.node("ScatterND", [f"{past}.{head}", shared["slots"], per_head[kind][head]], [f"{present}.{head}"],
                          name=f"{prefix}/{kind}{head}_write")[0]
            if kv_dtype == "float16":
                rows = w.one("Cast", [rows], name=f"{prefix}/{kind}{head}_float", to=_ONNX_FLOAT)
            cached[kind] = rows
        scores = w.one("Gemm", [queries[head], cached["k"], bias], name=f"{prefix}/scores{head}",
                       alpha=float(dim ** -0.5), transB=1)
        probs = w.one("Softmax", [scores], name=f"{prefix}/probs{head}", axis=-1)
        outputs.append(values_product(w, probs, cached["v"], dim, f"{prefix}/out{head}"))
    out = w.one("Concat", outputs, name=f"{prefix}/out", axis=0) if kv_heads > 1 else outputs[0]
    out = w.one("Reshape", [out, w.constant([kv_heads, copies * group, -1, dim])], name=f"{prefix}/out_heads")
    if copies > 1:
        out = w.one("Slice", [out, w.constant([0]), w.constant([group]), w.constant([1])], name=f"{prefix}/out_first")
    out = w.one("Transpose", [out], name=f"{prefix}/out_tokens", perm=[2, 0, 1, 3])  # [T, KVH, G, D]
    return w.one("Reshape", [out, w.constant([1, -1, heads * dim])], name=f"{prefix}/rows")


def _split_heads(w: GraphWriter, x: str, count: int, name: str) -> list:
    """[count, R, D] -> count tensors [R, D]."""
    if count == 1:
        return [w.one("Squeeze", [x, w.constant([0])], name=f"{name}_head0")]
    parts = w.node("Split", [x], count, name=f"{name}_split", axis=0, num_outputs=count)
    return [w.one("Squeeze", [part, w.constant([0])], name=f"{name}_head{i}") for i, part in enumerate(parts)]


def values_product(w: GraphWriter, probs: str, values: str, dim: int, name: str) -> str:
    """probs [R, cache_rows] x values [cache_rows, dim] -> [R, dim], each row as a one-token pass computes it.

    R < dim: one MatMul (onnxruntime's threads split the dim columns). Otherwise the rows are padded to
    ``count * size`` (count = ceil(R / (dim - 1)) chunks of size = ceil(R / count) < dim rows) and a Scan runs
    one MatMul per chunk, so every product keeps fewer rows than columns whatever the pass's width. The values
    are read once per chunk (a wide pass only; one-token and verify passes of up to (dim - 1) / G tokens stay
    one MatMul)."""
    helper = w.onnx.helper
    rows = w.one("Shape", [probs], name=f"{name}_rows", start=0, end=1)  # [1]: R
    narrow = w.one("Squeeze", [w.one("Less", [rows, w.constant([dim])], name=f"{name}_narrow_rows")],
                   name=f"{name}_narrow")
    whole = helper.make_graph([helper.make_node("MatMul", [probs, values], [f"{name}_whole"], name=f"{name}_matmul")],
                              f"{name}_one_product", [], [_float_value(helper, f"{name}_whole")])
    cap, cap_less_one, one, zero = w.constant([dim - 1]), w.constant([dim - 2]), w.constant([1]), w.constant([0])

    def step(op, inputs, out, **attributes):
        return helper.make_node(op, inputs, [f"{name}_{out}"], name=f"{name}_{out}", **attributes)

    body = helper.make_graph([helper.make_node("MatMul", [f"{name}_chunk", values], [f"{name}_chunk_out"],
                                               name=f"{name}_chunk_matmul")],
                             f"{name}_chunk_product", [_float_value(helper, f"{name}_chunk")],
                             [_float_value(helper, f"{name}_chunk_out")])

    def n(part: str) -> str:
        return f"{name}_{part}"

    chunked = [
        step("Add", [rows, cap_less_one], "rows_up"),
        step("Div", [n("rows_up"), cap], "count"),  # ceil(R / cap)
        step("Add", [rows, n("count")], "rows_plus"),
        step("Sub", [n("rows_plus"), one], "rows_plus_less_one"),
        step("Div", [n("rows_plus_less_one"), n("count")], "size"),  # ceil(R / count) <= cap
        step("Mul", [n("count"), n("size")], "padded_rows"),
        step("Sub", [n("padded_rows"), rows], "pad"),
        step("Concat", [zero, zero, n("pad"), zero], "pads", axis=0),
        step("Pad", [probs, n("pads")], "padded"),
        step("Concat", [n("count"), n("size"), w.constant([-1])], "chunk_shape", axis=0),
        step("Reshape", [n("padded"), n("chunk_shape")], "chunks"),  # [count, size, cache_rows]
        step("Scan", [n("chunks")], "chunk_outs", num_scan_inputs=1, body=body),  # [count, size, dim]
        step("Reshape", [n("chunk_outs"), w.constant([-1, dim])], "chunk_rows"),
        step("Slice", [n("chunk_rows"), zero, rows], "chunked"),
    ]
    chunks = helper.make_graph(chunked, f"{name}_chunked_products", [], [_float_value(helper, n("chunked"))])
    return w.one("If", [narrow], name=f"{name}", then_branch=whole, else_branch=chunks)


def _float_value(helper, name: str):
    return helper.make_tensor_value_info(name, _ONNX_FLOAT, None)
