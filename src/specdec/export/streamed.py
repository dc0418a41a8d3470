"""The streamed exporter: the fused graph of a Llama-family model built layer by layer, without a torch trace.

Peak memory is about one decoder layer in float32 (or the embedding table, the largest single tensor) whatever
the model's size: weights are read one tensor at a time (``tensors.py``: safetensors shards or a GGUF file),
quantized as they arrive (``weight_plan.py``), appended to the external-data file (``graph_writer.py``) and
dropped. The graph is the computation of the traced fused form (``graph_fused.FusedLM``; docs/bundle.md): per
layer a SimplifiedLayerNormalization (the first) or SkipSimplifiedLayerNormalization with the residual add, the
packed QKV projection (and its bias), one GroupQueryAttention over the in-place KV buffer with the scratch row,
the output projection, the packed gate|up projection, SiLU, the down projection; then the final norm, the
``logit_rows`` Gather and the lm_head. The parity reference is streamed too (``stream_reference.py``: the
model's own decoder layers, one at a time), and the finished graph is checked against it as the traced exporter
checks its graphs (``parity.check_parity``).

Architectures: ``STREAMED_ARCHITECTURES`` (Llama, Qwen2, Qwen3, Mistral: gated SiLU MLPs, RMSNorm, rotary);
the others, the standard graph form and float16/bfloat16 exports go through the traced exporter.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.contract.manifest import KV_LAYOUTS, ModelSpec, fused_graph_io, fused_kv_names
from specdec.export.folded_attention import folded_layer, folded_shared
from specdec.export.kv_smoothing import CALIBRATION_TEXT, key_factors
from specdec.export.gguf_blocks import Grid
from specdec.export.graph_fused import SCRATCH_ROWS
from specdec.export.graph_model import SLIDING, layer_types
from specdec.export.graph_writer import ONNX_NAME, GraphWriter
from specdec.export.int8_rows import channel_quantized, row_quantized_matmul, row_zero_points
from specdec.export.nbits import gather_quantized, matmul, write_parts
from specdec.export.weight_plan import WeightPlan, WeightQuantizer

STREAMED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
INT_MAX = 2**62


@dataclass(frozen=True)
class Geometry:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab_rows: int  # rows of the embedding / lm_head tables
    vocab: int  # logits the graph computes: the tokenizer's vocabulary when the tables are padded beyond it
    max_positions: int
    tied: bool
    qk_norm: bool
    layer_types: tuple
    sliding_window: int | None


def usable_vocab(table_rows: int, tokenizer_size: int) -> int:
    """Logit rows a bundle keeps: the table's rows, or the tokenizer's vocabulary when the table is padded beyond
    it (Qwen2.5 7B-32B pad 151,665 tokens to 152,064 rows): rows no token id reaches are never sampled, and a pair
    whose tables are padded differently then scores the same ids."""
    return min(table_rows, tokenizer_size) if tokenizer_size else table_rows


def geometry_of(config, arch, tokenizer_size: int) -> Geometry:
    heads = config.num_attention_heads
    rows = int(config.vocab_size)
    types = tuple(layer_types(config, arch))
    return Geometry(
        layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size, eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        vocab_rows=rows, vocab=usable_vocab(rows, tokenizer_size),
        max_positions=int(getattr(config, "max_position_embeddings", 2048) or 2048),
        tied=bool(getattr(config, "tie_word_embeddings", False)), qk_norm=arch.qk_norm is not None,
        layer_types=types,
        sliding_window=getattr(config, "sliding_window", None) if SLIDING in types else None)


def rope_tables(config, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [rows, rot/2] float32 with the attention scaling folded in, from the model's own rotary class."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    rotary = type(shell.model.rotary_emb)(config=config)
    inv_freq = rotary.inv_freq.detach().float()
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (angles.cos() * scaling).numpy(), (angles.sin() * scaling).numpy()


def layer_names(index: int) -> dict:
    """role -> the Hugging Face name of layer ``index``'s tensor (``role``: llama.cpp's block role)."""
    prefix = f"model.layers.{index}."
    return {role: prefix + path for role, path in (
        ("attn_norm", "input_layernorm.weight"), ("ffn_norm", "post_attention_layernorm.weight"),
        ("attn_q", "self_attn.q_proj.weight"), ("attn_k", "self_attn.k_proj.weight"),
        ("attn_v", "self_attn.v_proj.weight"), ("q_bias", "self_attn.q_proj.bias"),
        ("k_bias", "self_attn.k_proj.bias"), ("v_bias", "self_attn.v_proj.bias"),
        ("attn_output", "self_attn.o_proj.weight"), ("attn_q_norm", "self_attn.q_norm.weight"),
        ("attn_k_norm", "self_attn.k_norm.weight"), ("ffn_gate", "mlp.gate_proj.weight"),
        ("ffn_up", "mlp.up_proj.weight"), ("ffn_down", "mlp.down_proj.weight"))}


class FusedGraphBuilder:
    """Emits the fused graph into a ``GraphWriter``: the shared inputs, the embedding, layer by layer, the head.

    ``attention``: "folded" (``folded_attention.py``: each KV head's cache rows read once per pass) or "gqa"
    (GroupQueryAttention over the layer's buffer with the scratch row); ``kv_dtype``: the cache's element type
    ("float16" halves its memory; folded only)."""

    def __init__(self, writer: GraphWriter, geometry: Geometry, quantizer: WeightQuantizer | None,
                 attention: str = "folded", kv_dtype: str = "float32"):
        if kv_dtype != "float32" and attention != "folded":
            raise ValueError(f"a {kv_dtype} KV cache needs the folded attention, not {attention!r}")
        self.w, self.g, self.quantizer = writer, geometry, quantizer
        self.attention, self.kv_dtype = attention, kv_dtype
        self.level = quantizer.plan.accuracy_level if quantizer is not None else None
        self.block_sums: dict = {}  # activation -> its block-sum augmented form (carried grids' corrections)
        self.key_smoothing: dict = {}  # layer -> [kv_heads, D] factors of an int8 cache's keys (kv_smoothing.py)
        self.row_zero_points: str | None = None  # the int8 rows' activation zero points, made once (int8_rows.py)

    def linear(self, x: str, tensors: list, names: list, role: str, out: str, k: int, layer: int = -1,
               bias: np.ndarray | None = None) -> str:
        """``out`` = x @ W^T (+ bias) for W = the ``tensors`` ([N, K] float32) side by side along N."""
        w = self.w
        base = out.rsplit("/", 1)[0]
        target = out if bias is None else f"{out}/nobias"
        if self.quantizer is None:
            weight = np.concatenate(tensors, axis=0) if len(tensors) > 1 else tensors[0]
            w.node("MatMul", [x, w.initializer(f"{base}.weight", np.ascontiguousarray(weight.T))], [target],
                   name=f"{base}/MatMul")
        elif self.quantizer.plan.layer_products == "int8" and role != "output":
            weight = np.concatenate(tensors, axis=0) if len(tensors) > 1 else tensors[0]
            q, scale = channel_quantized(weight)
            self.quantizer.count_int8_rows(len(names))
            if self.row_zero_points is None:
                self.row_zero_points = row_zero_points(w, "position_ids")
            row_quantized_matmul(w, x, w.initializer(f"{base}.weight_q7", q), w.initializer(f"{base}.scales", scale),
                                 base, target, self.row_zero_points)
        else:
            parts = self.quantizer.parts(tensors, names, role, layer)
            matmul(w, x, write_parts(w, parts, base), base, target, self.level, k, self.block_sums)
        if bias is not None:
            w.node("Add", [target, w.initializer(f"{base}.bias", bias)], [out], name=f"{base}/Add")
        return out

    def shared_inputs(self, cos: np.ndarray, sin: np.ndarray) -> dict:
        if self.attention == "folded":
            return folded_shared(self.w, self.g, cos, sin)
        return self._gqa_shared(cos, sin)

    def _gqa_shared(self, cos: np.ndarray, sin: np.ndarray) -> dict:
        """What every layer's GroupQueryAttention reads beside its own tensors: the T + 1 rows' positions and biases
        (the scratch row repeats the last row's position; its bias row and column are 0), the lengths + 1, the
        rotary tables."""
        w = self.w
        pad = w.constant([0, 0, 0, 0, 0, 0, SCRATCH_ROWS, SCRATCH_ROWS])
        last = w.one("Slice", ["position_ids", w.constant([-1]), w.constant([INT_MAX]), w.constant([1])],
                     name="scratch/last_position")
        shared = {
            "positions": w.one("Concat", ["position_ids", last], name="scratch/positions", axis=1),
            "bias": w.one("Pad", ["attention_bias", pad], name="scratch/bias"),
            "seqlens": w.one("Add", ["seqlens_k", w.constant([SCRATCH_ROWS], np.int32)], name="scratch/seqlens_k"),
            "total": w.one("Add", ["total_sequence_length", w.constant(SCRATCH_ROWS, np.int32)],
                           name="scratch/total"),
            "cos": w.initializer("cos_cache", cos), "sin": w.initializer("sin_cache", sin),
        }
        if self.g.sliding_window is not None:
            shared["sliding_bias"] = w.one("Pad", ["sliding_attention_bias", pad], name="scratch/sliding_bias")
        return shared

    def layer(self, index: int, t: dict, x: str, hidden: str, shared: dict, next_norm: np.ndarray) -> tuple[str, str]:
        """Decoder layer ``index`` (``t``: its tensors by role, float32): (the next norm's output, the residual)."""
        w, g = self.w, self.g
        prefix = f"layers.{index}"
        names = layer_names(index)
        q_size = g.heads * g.head_dim
        bias = np.concatenate([t["q_bias"], t["k_bias"], t["v_bias"]]) if "q_bias" in t else None
        qkv = self.linear(x, [t["attn_q"], t["attn_k"], t["attn_v"]], [names[r] for r in ("attn_q", "attn_k", "attn_v")],
                          "attn_qkv", f"{prefix}/qkv/out", g.hidden, index, bias)
        if self.attention == "folded":
            rows = self._folded(index, qkv, t, shared)
        else:
            rows = self._gqa(index, qkv, t, shared)
        o = self.linear(rows, [t["attn_output"]], [names["attn_output"]], "attn_output", f"{prefix}/o_proj/out",
                        q_size, index)
        x, hidden = self.skip_norm(o, hidden, t["ffn_norm"], f"{prefix}/ffn_norm")
        gate_up = self.linear(x, [t["ffn_gate"], t["ffn_up"]], [names["ffn_gate"], names["ffn_up"]], "ffn_gate_up",
                              f"{prefix}/gate_up/out", g.hidden, index)
        gate, up = w.node("Split", [gate_up, w.constant([g.intermediate, g.intermediate])], 2,
                          name=f"{prefix}/gate_up_split", axis=-1)
        silu = w.one("Mul", [gate, w.one("Sigmoid", [gate], name=f"{prefix}/sigmoid")], name=f"{prefix}/silu")
        act = w.one("Mul", [silu, up], name=f"{prefix}/act")
        down = self.linear(act, [t["ffn_down"]], [names["ffn_down"]], "ffn_down", f"{prefix}/down/out", g.intermediate,
                           index)
        after = f"layers.{index + 1}/attn_norm" if index + 1 < g.layers else "final_norm"
        return self.skip_norm(down, hidden, next_norm, after)

    def _split_qkv(self, index: int, qkv: str, t: dict) -> tuple[str, str, str]:
        """q [B,T,H*D], k [B,T,KVH*D] (per-head normed when the model has q/k norms), v."""
        w, g = self.w, self.g
        prefix = f"layers.{index}"
        q_size, kv_size = g.heads * g.head_dim, g.kv_heads * g.head_dim
        q, k, v = w.node("Split", [qkv, w.constant([q_size, kv_size, kv_size])], 3, name=f"{prefix}/qkv_split", axis=-1)
        if g.qk_norm:
            q = self._head_norm(q, t["attn_q_norm"], g.heads, f"{prefix}/q_norm")
            k = self._head_norm(k, t["attn_k_norm"], g.kv_heads, f"{prefix}/k_norm")
        return q, k, v

    def _folded(self, index: int, qkv: str, t: dict, shared: dict) -> str:
        q, k, v = self._split_qkv(index, qkv, t)
        bias = shared["sliding_bias"] if self.g.layer_types[index] == SLIDING else shared["bias"]
        return folded_layer(self.w, self.g, index, q, k, v, shared, bias, self.kv_dtype,
                            self.key_smoothing.get(index))

    def _gqa(self, index: int, qkv: str, t: dict, shared: dict) -> str:
        """GroupQueryAttention over the layer's buffer, T + the scratch row: the attention rows [B,T,H*D]."""
        w, g = self.w, self.g
        prefix = f"layers.{index}"
        q_size, kv_size = g.heads * g.head_dim, g.kv_heads * g.head_dim
        # the scratch row: a copy of the last row, so GroupQueryAttention always takes its multi-row kernel
        last = w.one("Slice", [qkv, w.constant([-1]), w.constant([INT_MAX]), w.constant([1])], name=f"{prefix}/qkv_last")
        qkv = w.one("Concat", [qkv, last], name=f"{prefix}/qkv_scratch", axis=1)
        if g.qk_norm:
            q, k, v = w.node("Split", [qkv, w.constant([q_size, kv_size, kv_size])], 3, name=f"{prefix}/qkv_split",
                             axis=-1)
            attention_inputs = [self._head_norm(q, t["attn_q_norm"], g.heads, f"{prefix}/q_norm"),
                                self._head_norm(k, t["attn_k_norm"], g.kv_heads, f"{prefix}/k_norm"), v]
        else:
            attention_inputs = [qkv, "", ""]  # packed: GroupQueryAttention splits it
        bias_input = shared["sliding_bias"] if g.layer_types[index] == SLIDING else shared["bias"]
        attention = w.node("GroupQueryAttention", attention_inputs + [
            f"past.{index}.key", f"past.{index}.value", shared["seqlens"], shared["total"], shared["cos"],
            shared["sin"], shared["positions"], bias_input],
            [f"{prefix}/attention/out", f"present.{index}.key", f"present.{index}.value"],
            name=f"{prefix}/attention", domain="com.microsoft", num_heads=g.heads, kv_num_heads=g.kv_heads,
            scale=float(g.head_dim ** -0.5), do_rotary=1, rotary_interleaved=0)[0]
        return w.one("Slice", [attention, w.constant([0]), w.constant([-SCRATCH_ROWS]), w.constant([1])],
                     name=f"{prefix}/attention_rows")

    def skip_norm(self, x: str, residual: str, gamma: np.ndarray, name: str) -> tuple[str, str]:
        """(RMSNorm(x + residual), x + residual): one SkipSimplifiedLayerNormalization."""
        normed, _, _, total = self.w.node(
            "SkipSimplifiedLayerNormalization", [x, residual, self.w.initializer(f"{name}.weight", gamma)],
            [f"{name}/out", "", "", f"{name}/sum"], name=name, domain="com.microsoft", epsilon=self.g.eps)
        return normed, total

    def _head_norm(self, x: str, gamma: np.ndarray, heads: int, name: str) -> str:
        """Per-head RMSNorm of [B, T, heads * D] (Qwen3's q/k norm), before the rotary inside GroupQueryAttention."""
        w, g = self.w, self.g
        per_head = w.one("Reshape", [x, w.constant([0, 0, heads, g.head_dim])], name=f"{name}/heads")
        normed = w.one("SimplifiedLayerNormalization", [per_head, w.initializer(f"{name}.weight", gamma)], name=name,
                       axis=-1, epsilon=g.eps, stash_type=1)
        return w.one("Reshape", [normed, w.constant([0, 0, heads * g.head_dim])], name=f"{name}/flat")


def export_streamed(role: str, source, tokenizer, plan: WeightPlan, out_dir: Path, progress, parity_ids=None,
                    special: dict | None = None, tie_embeddings: bool = False, kv_dtype: str = "float32",
                    attention: str = "folded") -> tuple:
    """Write ``out_dir/model.onnx`` (+ data) for ``source``; returns (ModelSpec, parity report, weight report).

    ``parity_ids``: (prompt ids, extra ids) for the parity check against the streamed reference (None: none).
    ``tie_embeddings``: one table for the embedding and the lm_head, the lm_head's (checkpoints tied in the
    original but shipped with two quantized copies); the reference then uses it for both too. ``attention`` /
    ``kv_dtype``: ``FusedGraphBuilder``'s."""
    import torch

    from specdec.export.architectures import arch_for
    from specdec.export.compat import special_token_ids_from, tokenizer_size
    from specdec.export.graph_model import text_config
    from specdec.export.sources import load_configs
    from specdec.export.tensors import open_weights

    torch.set_grad_enabled(False)
    config, generation = load_configs(source)
    config = text_config(config)
    g = geometry_of(config, arch_for(config.model_type), tokenizer_size(tokenizer))
    if tie_embeddings and not g.tied:
        from dataclasses import replace

        g = replace(g, tied=True)
    special = special or special_token_ids_from(generation, config, tokenizer)
    weights = open_weights(source, g.heads, g.kv_heads)
    quantizer = WeightQuantizer(plan, weights, g.layers) if plan.quant != "none" else None
    writer = GraphWriter(out_dir)
    reference = None
    if parity_ids is not None:
        from specdec.export.parity import parity_sequences
        from specdec.export.stream_reference import StreamedReference

        reference = StreamedReference(config, parity_sequences(*parity_ids))
    calibration = None
    if kv_dtype == "int8":  # the keys' smoothing factors, from the source's own layers (kv_smoothing.py)
        from specdec.export.stream_reference import StreamedReference

        calibration = StreamedReference(config, [tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]])
    started = time.monotonic()
    try:
        _build(FusedGraphBuilder(writer, g, quantizer, attention, kv_dtype), weights, g, config, reference, progress,
               role, "lm_head.weight" if tie_embeddings else "model.embed_tokens.weight", calibration)
        inputs, outputs = fused_graph_io(g.layers, g.kv_heads, g.head_dim, g.vocab, kv_dtype,
                                         g.sliding_window is not None, attention)
        writer.finish(inputs, outputs)
    except BaseException:
        writer.abort()
        raise
    finally:
        weights.close()
    progress(f"{role}: graph written ({writer.bytes_written / 2**30:.2f} GiB of weights in "
             f"{time.monotonic() - started:.0f}s)")
    spec = ModelSpec(role=role, architecture=config.model_type, onnx_file=f"{role}/{ONNX_NAME}", inputs=inputs,
                     outputs=outputs, kv=fused_kv_names(g.layers), num_layers=g.layers, num_kv_heads=g.kv_heads,
                     head_dim=g.head_dim, hidden_size=g.hidden, vocab_size=g.vocab, max_positions=g.max_positions,
                     kv_dtype=kv_dtype, dtype="float32", quant=plan.quant, sliding_window=g.sliding_window,
                     bos_token_id=special["bos_token_id"], eos_token_ids=tuple(special["eos_token_ids"]),
                     pad_token_id=special["pad_token_id"], graph="fused", kv_layout=KV_LAYOUTS["fused"],
                     attention_scratch_rows=SCRATCH_ROWS if attention == "gqa" else 0, attention=attention)
    parity = {}
    if reference is not None:
        from specdec.export.parity import check_parity

        kind = plan.quant if plan.quant != "none" else "float"
        progress(f"{role}: parity of the {kind} graph against the source model's own layers")
        parity[kind] = check_parity(reference.results, out_dir / ONNX_NAME, spec, *parity_ids)
    return spec, parity, (quantizer.report if quantizer is not None else {})


def _build(builder: FusedGraphBuilder, weights, g: Geometry, config, reference, progress, role: str,
           table_name: str, calibration=None) -> None:
    """``table_name``: the embedding table (the lm_head's, when ``tie_embeddings`` ties them); ``calibration``: a
    ``StreamedReference`` over the calibration text whose keys set each layer's key smoothing (an int8 cache)."""
    w, quantizer = builder.w, builder.quantizer
    present = weights.names()
    if table_name not in present:
        table_name = "model.embed_tokens.weight"
    cos, sin = rope_tables(config, g.max_positions + (SCRATCH_ROWS if builder.attention == "gqa" else 0))
    shared = builder.shared_inputs(cos, sin)
    del cos, sin
    table = weights.get(table_name)[: g.vocab]
    for tracked in (reference, calibration):
        if tracked is not None:
            tracked.embed(table)
    head_name = "lm_head.weight" if "lm_head.weight" in present and not g.tied else table_name
    head = None  # the lm_head's written parts, when written early to share its table with the embedding
    if quantizer is None or quantizer.plan.quant != "int4":  # the embedding stays float but with int4 (a Gather reads
        # one row per token: its bytes do not weigh on a pass)
        w.node("Gather", [w.initializer("embed.weight", table), "input_ids"], ["embed/out"], name="embed/Gather",
               axis=0)
    elif head_name == table_name and quantizer.shares_embedding():
        head = write_parts(w, quantizer.parts([table], [head_name], "output"), "lm_head")
        gather_quantized(w, head[0], "input_ids", "embed", "embed/out", g.hidden)
    else:
        stored = quantizer.embedding(table, table_name)
        if not isinstance(stored, Grid):  # a Packed part: written first, then read by the Gather
            stored = write_parts(w, [stored], "embed")[0]
        gather_quantized(w, stored, "input_ids", "embed", "embed/out", g.hidden)
    del table
    gc.collect()
    hidden = "embed/out"
    x = w.one("SimplifiedLayerNormalization", [hidden, w.initializer(
        "layers.0/attn_norm.weight", weights.get("model.layers.0.input_layernorm.weight"))],
        name="layers.0/attn_norm", axis=-1, epsilon=g.eps, stash_type=1)
    for index in range(g.layers):
        begun = time.monotonic()
        tensors = {role: weights.get(name) for role, name in layer_names(index).items() if name in present}
        following = (f"model.layers.{index + 1}.input_layernorm.weight" if index + 1 < g.layers
                     else "model.norm.weight")
        prefix = f"model.layers.{index}."
        window = g.sliding_window if g.layer_types[index] == SLIDING else None
        by_name = {layer_names(index)[r][len(prefix):]: value for r, value in tensors.items()}
        if calibration is not None:  # this layer's keys over the calibration text, before its graph is written
            calibration.layer(index, by_name, window)
            (ids,) = calibration.sequences
            builder.key_smoothing[index] = key_factors(calibration.take_rows(ids, index)[0])
        x, hidden = builder.layer(index, tensors, x, hidden, shared, weights.get(following))
        if reference is not None:
            reference.layer(index, by_name, window)
        del tensors
        gc.collect()
        progress(f"{role}: layer {index + 1}/{g.layers} ({time.monotonic() - begun:.1f}s)")
    rows = w.one("Gather", [x, "logit_rows"], name="head/rows", axis=1)
    head_table = weights.get(head_name)[: g.vocab]
    if reference is not None:
        reference.finish(weights.get("model.norm.weight"), head_table)  # the logits of the kept rows
    if quantizer is None:
        w.node("MatMul", [rows, w.initializer("lm_head.weight", np.ascontiguousarray(head_table.T))], ["logits"],
               name="lm_head/MatMul")
    else:
        head = head or write_parts(w, quantizer.parts([head_table], [head_name], "output"), "lm_head")
        matmul(w, rows, head, "lm_head", "logits", builder.level, g.hidden, builder.block_sums)
    del head_table
    gc.collect()
