"""Tiny random-weight Hugging Face models, built by the tests themselves (no downloads)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 128
SPECIALS = ["<unk>", "<eos>", "<bos>"]


def tiny_tokenizer():
    """A character-level fast tokenizer with VOCAB ids (printable ASCII + specials + fillers)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    while len(vocab) < VOCAB:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", bos_token="<bos>")


def _common(num_layers, max_positions=512, **extra):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                eos_token_id=1, bos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
    base.update(extra, num_hidden_layers=num_layers)
    return base


def tiny_config(arch: str, num_layers: int = 2, max_positions: int = 512, kv_heads: int | None = None):
    """``kv_heads``: KV heads (default 2 of the 4 query heads)."""
    import transformers as tf

    if kv_heads is not None:
        return type(tiny_config(arch, num_layers, max_positions))(**{
            **tiny_config(arch, num_layers, max_positions).to_dict(), "num_key_value_heads": kv_heads})

    builders = {
        "llama": lambda: tf.LlamaConfig(**_common(num_layers, max_positions)),
        "qwen2": lambda: tf.Qwen2Config(**_common(num_layers, )),
        "qwen3": lambda: tf.Qwen3Config(**_common(num_layers, head_dim=16)),
        "mistral": lambda: tf.MistralConfig(**_common(num_layers, sliding_window=6)),
        "phi3": lambda: tf.Phi3Config(**_common(num_layers, pad_token_id=None)),
        "gemma": lambda: tf.GemmaConfig(**_common(num_layers, head_dim=16)),
        "gemma3_text": lambda: tf.Gemma3TextConfig(
            **_common(num_layers, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                      layer_types=(["sliding_attention", "full_attention"] * num_layers)[:num_layers])
        ),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=num_layers, n_head=4, n_positions=512,
                                       eos_token_id=1, bos_token_id=2),
    }
    return builders[arch]()


ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma3_text", "gpt2")


def build_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                     max_positions: int = 512, kv_heads: int | None = None) -> Path:
    """Save a random tiny model + tokenizer into ``folder`` (safetensors) and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers, max_positions, kv_heads))
    with torch.no_grad():  # larger weights than the default init: peaked, seed-dependent distributions
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def build_noisy_copy(source: Path, folder: Path, noise: float, seed: int) -> Path:
    """A draft that agrees with ``source`` often but not always: its weights plus Gaussian noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder
