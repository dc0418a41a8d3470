"""A random-weight checkpoint at the real shapes of a Qwen2.5 model, with the real Qwen2.5 tokenizer: what a 7B-32B
export, its memory and its pass costs are measured on where no real 7B+ weights install (no hub here).

    python tools/inputs/synth_checkpoint.py SIZE OUT [--tokenizer GGUF] [--seed 0] [--dtype bfloat16] [--shard-gib 4]

SIZE: 0.5b, 1.5b, 3b, 7b, 14b or 32b (Qwen2.5's published configs: layers, widths, heads, the 7B-32B's padded
152,064-row tables). OUT gets config.json, generation_config.json, safetensors shards with an index, and the
tokenizer: the real Qwen2.5 one, read from the pinned pair's GGUF (``--tokenizer``; default: the target GGUF
``specdec-export --pair`` joined in specdec's cache) without llama.cpp's ``[PAD<id>]`` placeholders, so it is
the Hugging Face folder's 151,665 tokens.

Weights are written one tensor at a time (peak memory: one tensor), drawn so activations stay in range through the
layers: projections N(0, 1/sqrt(fan_in)) scaled by 0.5, norms 1, biases small. The values mean nothing: acceptance
and perplexity come from the real pair; sizes, memory and pass costs from this.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

# Qwen2.5's configs (hidden, intermediate, layers, heads, kv heads, vocabulary rows, tied embeddings)
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (2048, 11008, 36, 16, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "14b": (5120, 13824, 48, 40, 8, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}
PAD = "[PAD"


def config_of(size: str) -> dict:
    hidden, intermediate, layers, heads, kv_heads, vocab, tied = SHAPES[size]
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
            "initializer_range": 0.02}


def tensors_of(config: dict):
    """(name, shape, kind) of every tensor, in file order; kind: "matrix", "norm", "bias", "table"."""
    h, i, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]
    d = h // config["num_attention_heads"]
    yield "model.embed_tokens.weight", (config["vocab_size"], h), "table"
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,), "norm"
        for name, rows in (("q", h), ("k", kv * d), ("v", kv * d)):
            yield p + f"self_attn.{name}_proj.weight", (rows, h), "matrix"
            yield p + f"self_attn.{name}_proj.bias", (rows,), "bias"
        yield p + "self_attn.o_proj.weight", (h, h), "matrix"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        yield p + "mlp.gate_proj.weight", (i, h), "matrix"
        yield p + "mlp.up_proj.weight", (i, h), "matrix"
        yield p + "mlp.down_proj.weight", (h, i), "matrix"
    yield "model.norm.weight", (h,), "norm"
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (config["vocab_size"], h), "table"


def draw(rng: np.random.Generator, shape: tuple, kind: str) -> np.ndarray:
    """float32 values of one tensor (module docstring), drawn in row chunks so only the tensor is held."""
    if kind == "norm":
        return np.ones(shape, np.float32)
    scale = {"bias": 0.02, "table": 0.02}.get(kind, 0.5 / np.sqrt(shape[-1]))
    out = np.empty(shape, np.float32)
    flat = out.reshape(shape[0], -1)
    for start in range(0, shape[0], 4096):
        part = rng.standard_normal((min(4096, shape[0] - start), flat.shape[1]), dtype=np.float32)
        part *= scale
        flat[start:start + len(part)] = part
    return out


def bfloat16_bytes(values: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), as bytes."""
    bits = values.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.tobytes()


def write_shards(out: Path, config: dict, seed: int, dtype: str, shard_bytes: int) -> int:
    """The safetensors shards and their index, one tensor at a time; returns the bytes written."""
    rng = np.random.default_rng(seed)
    itemsize = 2 if dtype == "bfloat16" else 4
    tag = "BF16" if dtype == "bfloat16" else "F32"
    shards, current = [], []
    for name, shape, kind in tensors_of(config):  # plan the shards first: a header holds every offset
        size = int(np.prod(shape)) * itemsize
        if current and sum(s for _, s, _, _ in current) + size > shard_bytes:
            shards.append(current)
            current = []
        current.append((name, size, shape, kind))
    shards.append(current)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, size, shape, _ in shard:
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file_name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(out / file_name, "wb") as handle:
            handle.write(struct.pack("<Q", len(encoded)))
            handle.write(encoded)
            for name, _, shape, kind in shard:
                values = draw(rng, shape, kind)
                handle.write(bfloat16_bytes(values) if dtype == "bfloat16" else values.tobytes())
                total += values.size * itemsize
                print(f"  {name} {list(shape)}", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    return total


def write_tokenizer(out: Path, gguf: Path) -> int:
    """The Qwen2.5 tokenizer from a pinned GGUF, without llama.cpp's [PAD<id>] rows; returns its size."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    path = out / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    data["model"]["vocab"] = {token: index for token, index in vocab.items() if not token.startswith(PAD)}
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return len(data["model"]["vocab"]) + len([t for t in data.get("added_tokens", []) if t["content"] not in vocab])


def default_tokenizer_gguf() -> Path:
    from specdec.export.pair import DEFAULT_PAIR, pair_sources

    return Path(pair_sources(DEFAULT_PAIR, lambda message: None)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Qwen2.5 GGUF to take the tokenizer from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shard-gib", type=float, default=4.0)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"{args.out} exists and is not empty", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    config = config_of(args.size)
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    (args.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643, "do_sample": False}))
    tokens = write_tokenizer(args.out, args.tokenizer or default_tokenizer_gguf())
    total = write_shards(args.out, config, args.seed, args.dtype, int(args.shard_gib * 2**30))
    print(f"wrote {args.out}: Qwen2.5-{args.size} shapes, {total / 2**30:.1f} GiB of {args.dtype} weights, "
          f"a {tokens}-token tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
