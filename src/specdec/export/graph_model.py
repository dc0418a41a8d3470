"""The exportable forward pass: a Hugging Face causal LM rewired to the graph contract.

It reuses the Hugging Face model's own submodules (projections, norms, MLPs, embeddings),
found through the architecture table, and replaces only the attention plumbing: the KV
cache is external (past rows in, new rows out, sequence-major layout) and attention is
masked by an explicit boolean mask, so one graph serves prefill, decode, chain verify and
tree verify. See ``specdec.contract.manifest`` for the contract.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.export.architectures import ArchSpec, arch_for

FULL, SLIDING = "full_attention", "sliding_attention"


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config, arch: ArchSpec) -> list:
    """'full_attention' or 'sliding_attention' per layer, from the Hugging Face config."""
    n = config.num_hidden_layers
    if getattr(config, "sliding_window", None) and arch.sliding_all_layers_from_config:
        return [SLIDING] * n
    types = getattr(config, "layer_types", None)
    if types and getattr(config, "sliding_window", None):
        return [SLIDING if t == SLIDING else FULL for t in types[:n]]
    return [FULL] * n


def geometry(config) -> dict:
    """Heads and sizes of the attention, as the exported contract records them."""
    heads = config.num_attention_heads
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "hidden_size": hidden}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ExportableLM(nn.Module):
    """forward(input_ids, position_ids, attention_mask, [sliding_attention_mask], *past) -> (logits, *new_kv).

    Construction consumes the Hugging Face model: separate q/k/v and gate/up projections are
    fused into one matrix each (one larger MatMul, and later one MatMulNBits, instead of
    three or two), and the originals are dropped to keep peak memory at one copy.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        config = text_config(hf_model.config)
        self.arch = arch_for(config.model_type)
        self.hf = hf_model
        body = _get(hf_model, self.arch.body)
        self.layers = getattr(body, self.arch.layers)
        self.embed = _get(body, self.arch.embed)
        self.final_norm = _get(body, self.arch.final_norm)
        self.position_embed = _get(body, self.arch.position_embed) if self.arch.position_embed else None
        self.lm_head = hf_model.lm_head
        geo = geometry(config)
        self.num_heads, self.num_kv_heads, self.head_dim = geo["num_heads"], geo["num_kv_heads"], geo["head_dim"]
        self.hidden_size = geo["hidden_size"]
        self.layer_types = layer_types(config, self.arch)
        self.sliding_window = getattr(config, "sliding_window", None) if SLIDING in self.layer_types else None
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.rope_tables = {}
        if self.arch.rope:
            rotary = body.rotary_emb
            for lt in set(self.layer_types):
                inv_freq = getattr(rotary, f"{lt}_inv_freq", None)
                if inv_freq is None:
                    inv_freq = rotary.inv_freq
                scaling = getattr(rotary, f"{lt}_attention_scaling", getattr(rotary, "attention_scaling", 1.0))
                self.register_buffer(f"inv_freq_{lt}", inv_freq.detach().float().clone(), persistent=False)
                self.rope_tables[lt] = float(scaling)
        self.fused_qkv = nn.ModuleList(self._fuse(getattr(layer, self.arch.attn), self.arch.qkv) for layer in self.layers)
        self.fused_gate_up = nn.ModuleList(
            self._fuse(getattr(layer, self.arch.mlp), self.arch.mlp_gate_up) if self.arch.mlp_gate_up else nn.Identity()
            for layer in self.layers
        )

    @staticmethod
    def _fuse(parent: nn.Module, names: tuple) -> nn.Module:
        """One module computing the concatenated outputs of ``names`` (a single name is used as is)."""
        if len(names) == 1:
            return getattr(parent, names[0])
        parts = [getattr(parent, name) for name in names]
        with torch.no_grad():
            weight = torch.cat([part.weight for part in parts], dim=0)
            has_bias = any(part.bias is not None for part in parts)
            bias = torch.cat([
                part.bias if part.bias is not None else torch.zeros(part.out_features, dtype=weight.dtype)
                for part in parts
            ]) if has_bias else None
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, dtype=weight.dtype)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        for name in names:
            setattr(parent, name, None)  # drop the originals: the fused copy replaces them
        return fused

    @property
    def has_sliding_mask(self) -> bool:
        return self.sliding_window is not None

    def _rope(self, position_ids: torch.Tensor, layer_type: str, dtype: torch.dtype):
        inv_freq = getattr(self, f"inv_freq_{layer_type}")  # [rot_dim/2]
        freqs = position_ids.float()[..., None] * inv_freq  # [B, T, rot_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.rope_tables[layer_type]
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def _project_qkv(self, index: int, x: torch.Tensor):
        return self._split_qkv(self.fused_qkv[index](x))

    def _split_qkv(self, qkv: torch.Tensor):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        return qkv.split([q_size, kv_size, kv_size], dim=-1)

    def _mlp(self, index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mlp = getattr(layer, self.arch.mlp)
        if not self.arch.mlp_gate_up:
            return mlp(x)
        gate, up = self.fused_gate_up[index](x).chunk(2, dim=-1)
        return getattr(mlp, self.arch.mlp_down)(getattr(mlp, self.arch.mlp_act)(gate) * up)

    def _norm(self, module: nn.Module, x):
        """The architecture's RMSNorm in the form onnxruntime fuses (see ``rms_norm``); other norms as they are."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if self.arch.rms_norm_offset is None or eps is None:
            return module(x)
        return rms_norm(x, module.weight, float(eps), self.arch.rms_norm_offset)

    def _attention(self, index: int, layer: nn.Module, x, rope, mask, past_k, past_v):
        batch, new = x.shape[0], x.shape[1]
        attn = getattr(layer, self.arch.attn)
        q, k, v = self._project_qkv(index, x)
        q = q.view(batch, new, self.num_heads, self.head_dim)
        k = k.view(batch, new, self.num_kv_heads, self.head_dim)
        v = v.view(batch, new, self.num_kv_heads, self.head_dim)
        if self.arch.qk_norm:
            q = self._norm(getattr(attn, self.arch.qk_norm[0]), q)
            k = self._norm(getattr(attn, self.arch.qk_norm[1]), k)
        if rope is not None:
            cos, sin = rope  # [B, T, rot_dim]
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
            rot = cos.shape[-1]
            if rot == self.head_dim:
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
            else:  # partial rotary: only the first rot dims turn
                q = torch.cat((q[..., :rot] * cos + _rotate_half(q[..., :rot]) * sin, q[..., rot:]), dim=-1)
                k = torch.cat((k[..., :rot] * cos + _rotate_half(k[..., :rot]) * sin, k[..., rot:]), dim=-1)
        new_k, new_v = k, v  # [B, T, KVH, D]: the rows the runtime stores
        keys = torch.cat((past_k, new_k), dim=1).transpose(1, 2)  # [B, KVH, P+T, D]
        values = torch.cat((past_v, new_v), dim=1).transpose(1, 2)
        # Grouped-query attention without copying K/V per head: the G query heads that share a
        # KV head are stacked along the row axis (head h uses KV head h // G, as repeat_kv does).
        groups = self.num_heads // self.num_kv_heads
        # Without grouping (MHA) a one-token pass would multiply one row, which onnxruntime's CPU matmul rounds
        # differently from several rows (graph_fused's module doc): a copy of the last query row keeps every
        # pass on the multi-row kernel, so verify rows equal one-token passes bit for bit.
        pad = 1 if groups == 1 else 0
        if pad:
            q = torch.cat((q, q[:, -1:]), dim=1)
            mask = torch.cat((mask, mask[:, -1:]), dim=1)
        rows = new + pad
        queries = q.transpose(1, 2).reshape(batch, self.num_kv_heads, groups * rows, self.head_dim)
        scale = getattr(attn, "scaling", self.head_dim**-0.5)
        scores = torch.matmul(queries, keys.transpose(2, 3)) * scale  # [B, KVH, G*T, P+T]
        scores = scores.view(batch, self.num_kv_heads, groups, rows, scores.shape[-1]).float()
        if self.attn_softcap:
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        scores = scores.masked_fill(~mask[:, None, None, :, :], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        probs = probs.view(batch, self.num_kv_heads, groups * rows, probs.shape[-1])
        out = torch.matmul(probs, values)  # [B, KVH, G*T, D]
        out = out.view(batch, self.num_heads, rows, self.head_dim)[:, :, :new].transpose(1, 2).reshape(batch, new, -1)
        return getattr(attn, self.arch.out_proj)(out), new_k, new_v

    def forward(self, input_ids, position_ids, attention_mask, *rest):
        if self.has_sliding_mask:
            sliding_mask, past = rest[0], rest[1:]
        else:
            sliding_mask, past = None, rest
        hidden = self._embed(input_ids, position_ids)
        ropes = {lt: self._rope(position_ids, lt, hidden.dtype) for lt in self.rope_tables}

        def attend(index, layer, x):
            lt = self.layer_types[index]
            mask = sliding_mask if lt == SLIDING else attention_mask
            return self._attention(index, layer, x, ropes.get(lt), mask, past[2 * index], past[2 * index + 1])

        hidden, new_kv = self._decoder_stack(hidden, attend)
        return (self._head(hidden), *new_kv)

    def _embed(self, input_ids, position_ids):
        hidden = self.embed(input_ids)
        if self.position_embed is not None:
            hidden = hidden + self.position_embed(position_ids)
        return hidden

    def _decoder_stack(self, hidden, attend):
        """The layers around ``attend(index, layer, x) -> (x, key_out, value_out)``: norms, residuals, MLPs."""
        kv_out = []
        for index, layer in enumerate(self.layers):
            residual = hidden
            x = self._norm(getattr(layer, self.arch.input_norm), hidden)
            x, key_out, value_out = attend(index, layer, x)
            if self.arch.post_attn_norm:
                x = self._norm(getattr(layer, self.arch.post_attn_norm), x)
            hidden = residual + x
            residual = hidden
            x = self._mlp(index, layer, self._norm(getattr(layer, self.arch.pre_mlp_norm), hidden))
            if self.arch.post_mlp_norm:
                x = self._norm(getattr(layer, self.arch.post_mlp_norm), x)
            hidden = residual + x
            kv_out += [key_out, value_out]
        return hidden, kv_out

    def _head(self, hidden):
        logits = self.lm_head(self._norm(self.final_norm, hidden)).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def rms_norm(x, weight, eps: float, offset: float):
    """x / sqrt(mean(x^2) + eps) * (offset + weight), normalized in float32 like Hugging Face's RMSNorms.

    Hugging Face writes ``x * rsqrt(...)``, which exports as Sqrt + Reciprocal + Mul and stays 7
    separate nodes in onnxruntime. The Div form is the pattern onnxruntime's optimizer fuses into
    one SimplifiedLayerNormalization (57 norms in the 1.5B target: ~340 fewer kernel launches per pass).
    """
    x32 = x.float()
    normed = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:  # Llama/Qwen/Mistral/Phi-3: the weight scales the normalized value cast back
        return weight * normed.to(x.dtype)
    return (normed * (offset + weight.float())).to(x.dtype)  # Gemma: (1 + weight), in float32
