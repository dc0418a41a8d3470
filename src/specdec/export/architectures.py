"""Per-architecture differences, as data: one row per Hugging Face ``model_type``.

The exportable graph (``graph_model.py``) reads a row to find each submodule of the
Hugging Face model and to know how the architecture differs (fused projections, norms
around the sublayers, embedding scale, positions). Adding an architecture means adding a
row here, not an if-chain elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    body: str  # path of the decoder stack's parent module
    layers: str  # attribute of ``body`` holding the layers
    embed: str  # token embedding, relative to body
    final_norm: str  # relative to body
    attn: str  # attention submodule of a layer
    mlp: str  # MLP submodule of a layer
    input_norm: str  # norm before attention
    pre_mlp_norm: str  # norm before the MLP
    post_attn_norm: str | None = None  # norm on the attention output before the residual (Gemma-3)
    post_mlp_norm: str | None = None  # norm on the MLP output before the residual (Gemma-3)
    qkv: tuple = ("q_proj", "k_proj", "v_proj")  # one name = a fused q|k|v projection
    out_proj: str = "o_proj"
    qk_norm: tuple | None = None  # (q_norm, k_norm) applied per head before RoPE
    # gated MLP act(gate(x)) * up(x) -> down: (gate, up) or one fused (gate|up); None = call the MLP module whole
    mlp_gate_up: tuple | None = ("gate_proj", "up_proj")
    mlp_down: str = "down_proj"
    mlp_act: str = "act_fn"
    position_embed: str | None = None  # learned absolute positions (GPT-2), relative to body
    rope: bool = True
    sliding_all_layers_from_config: bool = False  # Mistral: config.sliding_window applies to every layer
    # RMSNorm scale = offset + weight (Gemma: 1 + weight); None = the norms are not RMSNorm (call the module)
    rms_norm_offset: float | None = 0.0


_LLAMA = ArchSpec(
    body="model", layers="layers", embed="embed_tokens", final_norm="norm",
    attn="self_attn", mlp="mlp", input_norm="input_layernorm", pre_mlp_norm="post_attention_layernorm",
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": ArchSpec(**{**_LLAMA.__dict__, "qk_norm": ("q_norm", "k_norm")}),
    "mistral": ArchSpec(**{**_LLAMA.__dict__, "sliding_all_layers_from_config": True}),
    "phi3": ArchSpec(**{**_LLAMA.__dict__, "qkv": ("qkv_proj",), "mlp_gate_up": ("gate_up_proj",),
                        "mlp_act": "activation_fn"}),
    # Gemma's sqrt(hidden) embedding scale lives inside its embedding module
    "gemma": ArchSpec(**{**_LLAMA.__dict__, "rms_norm_offset": 1.0}),
    "gemma3_text": ArchSpec(
        **{
            **_LLAMA.__dict__,
            "qk_norm": ("q_norm", "k_norm"),
            "post_attn_norm": "post_attention_layernorm",
            "pre_mlp_norm": "pre_feedforward_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm",
            "rms_norm_offset": 1.0,
        }
    ),
    "gpt2": ArchSpec(
        body="transformer", layers="h", embed="wte", final_norm="ln_f", attn="attn", mlp="mlp",
        input_norm="ln_1", pre_mlp_norm="ln_2", qkv=("c_attn",), out_proj="c_proj",
        position_embed="wpe", rope=False, mlp_gate_up=None, rms_norm_offset=None,
    ),
}


class UnsupportedArchitecture(ValueError):
    pass


def arch_for(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unsupported architecture {model_type!r}: specdec exports {', '.join(sorted(ARCHITECTURES))}"
        ) from None
