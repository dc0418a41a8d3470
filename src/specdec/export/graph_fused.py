"""The fused exportable forward pass: attention as onnxruntime's ``com.microsoft.GroupQueryAttention``.

Same Hugging Face submodules, norms, MLPs and architecture table as ``graph_model.ExportableLM``
(it subclasses it); only the attention core differs. Each layer's packed QKV projection goes into
one GroupQueryAttention node (as its packed ``query`` input; split only where a per-head q/k norm
comes between) that applies the rotary embedding (cos/sin tables are initializers,
per-token ``position_ids``), reads the past from the KV buffer and writes the new rows into it
in place (past and present are bound to one preallocated ``[1, kv_heads, max_context,
head_dim]`` buffer), and adds ``attention_bias`` (a tree, hidden past slots or a sliding
window as an additive mask). Nothing of the past is concatenated or copied per pass.

Under ``torch.onnx.export`` the node is emitted with ``torch.onnx.ops.symbolic_multi_out``;
run eagerly, ``gqa_reference`` computes the same thing in PyTorch (the op's semantics, for
tests). RMSNorm is written in the form onnxruntime fuses at session load
(SimplifiedLayerNormalization, and SkipSimplifiedLayerNormalization with the residual add).
See ``specdec.contract.manifest`` for the contract.

The scratch row: GroupQueryAttention always runs T + 1 rows, the last a copy of row T - 1
(same position, a scratch KV slot after the new rows, seen by no real row). onnxruntime's CPU
kernel multiplies probabilities by V with MLAS's one-row SGEMM when T = 1 and its tiled kernel
otherwise; the two round differently, and the int8 activations of the int4 projections after
it turn a 1e-6 difference into 0.2 on the logits, so a verify pass disagreed with one-token
decoding (greedy speculation matched target-only on 8/12 prompts). With the scratch row every
pass takes the tiled kernel, whose rows do not depend on T: verify rows equal one-token passes
bit for bit (``check_parity``'s "rows_vs_decode"), for 1-2% of a one-token pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.export.graph_model import SLIDING, ExportableLM


def gqa_reference(query, key, value, past_key, past_value, total_length: int, position_ids, cos, sin, bias,
                  num_heads: int, kv_num_heads: int, scale: float, softcap: float):
    """GroupQueryAttention on a shared buffer, in PyTorch: (output [B,T,H*D], present_key, present_value).

    query [B,T,H*D] (or packed [B,T,(H+2*KVH)*D] with key/value None), key/value [B,T,KVH*D], past_* [B,KVH,C,D]
    (slots [0, total-T) valid), cos/sin [max_positions + SCRATCH_ROWS, rot/2] or None, bias [B,1,T,total].
    Slot-causal like the onnxruntime kernel.
    """
    batch, new = query.shape[0], query.shape[1]
    head_dim = past_key.shape[-1]
    if key is None:  # packed QKV
        query, key, value = query.split([num_heads * head_dim, kv_num_heads * head_dim, kv_num_heads * head_dim], -1)
    q = query.view(batch, new, num_heads, head_dim).transpose(1, 2)
    k = key.view(batch, new, kv_num_heads, head_dim).transpose(1, 2)
    v = value.view(batch, new, kv_num_heads, head_dim).transpose(1, 2)
    if cos is not None:
        c, s = cos[position_ids][:, None], sin[position_ids][:, None]  # [B,1,T,rot/2]
        q, k = _rotate(q, c, s), _rotate(k, c, s)
    past = total_length - new
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[:, :, past:total_length] = k
    present_value[:, :, past:total_length] = v
    keys = present_key[:, :, :total_length].repeat_interleave(num_heads // kv_num_heads, dim=1)
    values = present_value[:, :, :total_length].repeat_interleave(num_heads // kv_num_heads, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    causal = torch.arange(total_length)[None, :] <= (past + torch.arange(new))[:, None]
    scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min) + bias
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    return out.transpose(1, 2).reshape(batch, new, num_heads * head_dim), present_key, present_value


def _rotate(x, cos, sin):
    """Non-interleaved rotary on the first 2 * cos.shape[-1] dims (the rest pass through)."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, rest), dim=-1)


SCRATCH_ROWS = 1  # rows GroupQueryAttention runs beyond the T new tokens (module doc)


class FusedLM(ExportableLM):
    """forward(input_ids, position_ids, attention_bias, [sliding_attention_bias], seqlens_k,
    total_sequence_length, logit_rows, *past) -> (logits of the logit_rows, *present)."""

    def __init__(self, hf_model, max_positions: int):
        super().__init__(hf_model)
        # cos/sin tables [max_positions + SCRATCH_ROWS, rot/2], attention scaling folded in: onnxruntime requires
        # as many rows as GroupQueryAttention's total length, which counts the scratch row (never indexed by it)
        for lt in self.rope_tables:
            inv_freq = getattr(self, f"inv_freq_{lt}")
            angles = torch.arange(max_positions + SCRATCH_ROWS, dtype=torch.float32)[:, None] * inv_freq[None, :]
            scaling = self.rope_tables[lt]
            self.register_buffer(f"cos_{lt}", (angles.cos() * scaling).to(self.dtype), persistent=False)
            self.register_buffer(f"sin_{lt}", (angles.sin() * scaling).to(self.dtype), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, input_ids, position_ids, attention_bias, *rest):
        if self.has_sliding_mask:
            sliding_bias, rest = rest[0], rest[1:]
        else:
            sliding_bias = None
        seqlens_k, total_length, logit_rows, past = rest[0], rest[1], rest[2], rest[3:]
        hidden = self._embed(input_ids, position_ids)
        # what GroupQueryAttention sees: T + 1 rows, the scratch row at the last row's position (never one past
        # it: the rotary tables end at max_positions - 1)
        attn_positions = torch.cat((position_ids, position_ids[:, -1:]), dim=1)
        attn_bias = F.pad(attention_bias, (0, SCRATCH_ROWS, 0, SCRATCH_ROWS))
        attn_sliding = None if sliding_bias is None else F.pad(sliding_bias, (0, SCRATCH_ROWS, 0, SCRATCH_ROWS))
        attn_seqlens, attn_total = seqlens_k + SCRATCH_ROWS, total_length + SCRATCH_ROWS

        def attend(index, layer, x):
            lt = self.layer_types[index]
            bias = attn_sliding if lt == SLIDING else attn_bias
            return self._fused_attention(index, layer, x, lt, attn_positions, bias, attn_seqlens, attn_total,
                                         past[2 * index], past[2 * index + 1])

        if torch.onnx.is_in_onnx_export() and self.arch.rms_norm_offset is not None:
            normed, present = self._skip_norm_stack(hidden, attend)
            logits = self.lm_head(normed.index_select(1, logit_rows)).float()  # only the rows asked for
            if self.final_softcap:
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
            return (logits, *present)
        hidden, present = self._decoder_stack(hidden, attend)
        return (self._head(hidden.index_select(1, logit_rows)), *present)

    def _skip_norm(self, module, x, residual):
        """(RMSNorm(x + residual), x + residual) as one com.microsoft.SkipSimplifiedLayerNormalization node
        (onnxruntime fuses a lone RMSNorm at load, but not the residual add before it)."""
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        gamma = module.weight if self.arch.rms_norm_offset == 0.0 else self.arch.rms_norm_offset + module.weight
        stat_shape = (*x.shape[:-1], 1)
        normed, _, _, total = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::SkipSimplifiedLayerNormalization", [x, residual, gamma.to(x.dtype)], {"epsilon": eps},
            dtypes=(x.dtype, torch.float32, torch.float32, x.dtype), shapes=(x.shape, stat_shape, stat_shape, x.shape),
            version=1,
        )
        return normed, total

    def _skip_norm_stack(self, hidden, attend):
        """``_decoder_stack`` + the final norm with every residual add fused into the norm after it."""
        kv_out = []
        x = self._norm(getattr(self.layers[0], self.arch.input_norm), hidden)
        for index, layer in enumerate(self.layers):
            x, key_out, value_out = attend(index, layer, x)
            if self.arch.post_attn_norm:
                x = self._norm(getattr(layer, self.arch.post_attn_norm), x)
            x, hidden = self._skip_norm(getattr(layer, self.arch.pre_mlp_norm), x, hidden)
            x = self._mlp(index, layer, x)
            if self.arch.post_mlp_norm:
                x = self._norm(getattr(layer, self.arch.post_mlp_norm), x)
            following = self.layers[index + 1] if index + 1 < len(self.layers) else None
            norm = getattr(following, self.arch.input_norm) if following is not None else self.final_norm
            x, hidden = self._skip_norm(norm, x, hidden)
            kv_out += [key_out, value_out]
        return x, kv_out

    def _attention_inputs(self, index: int, attn, x: torch.Tensor) -> tuple:
        """GroupQueryAttention's (query, key, value) for the T rows plus the scratch row (a copy of the last
        row's projections). Packed: the one QKV projection goes in as ``query`` with ``key``/``value`` absent
        (as onnxruntime-genai's graphs do: one Split node less per layer, the same logits; on the int4 Qwen2.5
        1.5B no measurable change in a pass's time). Architectures with a per-head q/k norm split, normalize
        and pass three tensors."""
        qkv = self.fused_qkv[index](x)
        qkv = torch.cat((qkv, qkv[:, -SCRATCH_ROWS:]), dim=1)
        if not self.arch.qk_norm:
            return qkv, None, None
        batch, new = qkv.shape[0], qkv.shape[1]
        q, k, v = self._split_qkv(qkv)
        # per-head RMSNorm before the rotary (onnxruntime's CPU GQA has no q/k norm input)
        q = self._norm(getattr(attn, self.arch.qk_norm[0]), q.view(batch, new, self.num_heads, self.head_dim))
        k = self._norm(getattr(attn, self.arch.qk_norm[1]), k.view(batch, new, self.num_kv_heads, self.head_dim))
        return q.reshape(batch, new, -1), k.reshape(batch, new, -1), v

    def _fused_attention(self, index, layer, x, layer_type, position_ids, bias, seqlens_k, total_length,
                         past_k, past_v):
        """Attention of the T rows of ``x``; position_ids/bias/seqlens_k/total_length describe T + 1 rows."""
        batch, new = x.shape[0], x.shape[1] + SCRATCH_ROWS
        attn = getattr(layer, self.arch.attn)
        q, k, v = self._attention_inputs(index, attn, x)
        rotary = layer_type in self.rope_tables
        cos = getattr(self, f"cos_{layer_type}") if rotary else None
        sin = getattr(self, f"sin_{layer_type}") if rotary else None
        scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        softcap = float(self.attn_softcap or 0.0)
        if torch.onnx.is_in_onnx_export():
            attrs = {"num_heads": self.num_heads, "kv_num_heads": self.num_kv_heads, "scale": scale,
                     "do_rotary": int(rotary), "rotary_interleaved": 0}
            if softcap:
                attrs["softcap"] = softcap
            out, present_k, present_v = torch.onnx.ops.symbolic_multi_out(
                "com.microsoft::GroupQueryAttention",
                [q, k, v, past_k, past_v, seqlens_k, total_length, cos, sin, position_ids if rotary else None,
                 bias.to(q.dtype)],
                attrs,
                dtypes=(q.dtype, past_k.dtype, past_v.dtype),
                shapes=((batch, new, self.num_heads * self.head_dim), past_k.shape, past_v.shape),
                version=1,
            )
        else:
            out, present_k, present_v = gqa_reference(
                q, k, v, past_k, past_v, int(total_length), position_ids, cos, sin, bias.to(q.dtype),
                self.num_heads, self.num_kv_heads, scale, softcap,
            )
        return getattr(attn, self.arch.out_proj)(out[:, :-SCRATCH_ROWS]), present_k, present_v
