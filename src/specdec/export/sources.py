"""Load a draft or target from a local Hugging Face folder or a GGUF file, never from a hub.

Validation happens before anything heavy: the path must exist, a folder must hold
config.json and safetensors weights (pickled ``.bin``/``.pt`` weights are refused: loading
them runs arbitrary code) whose headers agree with their sizes (a truncated download is
refused here, not deep inside the loader), the architecture must be in the table.
``trust_remote_code`` is never passed.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from specdec.export.architectures import arch_for

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
DTYPES = ("float32", "float16", "bfloat16")


class SourceError(ValueError):
    """A model source is missing, unsupported or unsafe."""


@dataclass(frozen=True)
class ModelSource:
    path: Path
    gguf_file: str | None  # file name inside ``path`` when loading a GGUF

    @property
    def label(self) -> str:
        return str(self.path / self.gguf_file) if self.gguf_file else str(self.path)


def resolve_source(spec: str | os.PathLike) -> ModelSource:
    """Check a user-given model path and say what it is; raises SourceError with one clear line."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise SourceError(f"model path {spec} does not exist (specdec only loads local folders or .gguf files, never a hub id)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            if path.suffix.lower() in PICKLE_SUFFIXES:
                raise SourceError(f"{spec} is a pickled checkpoint: refused (it can run code on load); convert it to safetensors")
            raise SourceError(f"{spec} is a file but not a .gguf: give a Hugging Face model folder or a .gguf file")
        return ModelSource(path.parent.resolve(), path.name)
    config = path / "config.json"
    if not config.is_file():
        raise SourceError(f"{spec} has no config.json: not a Hugging Face model folder")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise SourceError(f"{config} is not valid JSON: {exc}") from None
    arch_for(str(model_type))  # unknown architectures fail here, before loading weights
    names = [p.name for p in path.iterdir()]
    if not any(n.endswith(".safetensors") for n in names):
        pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise SourceError(
                f"{spec} has only pickled weights ({pickles[0]}): refused (loading them can run code); convert to safetensors"
            )
        raise SourceError(f"{spec} has no .safetensors weights")
    for name in sorted(n for n in names if n.endswith(".safetensors")):
        check_safetensors(path / name)
    return ModelSource(path.resolve(), None)


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header is unreadable or whose size differs from what the header declares.

    Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
    then the tensor bytes; the largest end offset is the data size.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError(f"its header claims {length} bytes")
            header = json.loads(handle.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        expected = 8 + length + max(ends, default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise SourceError(f"{path} is not a readable safetensors file ({exc}): truncated or corrupt") from None
    if expected != size:
        raise SourceError(f"{path} is {size} bytes but its header describes {expected}: truncated or corrupt "
                          "(download it again)")


def _local_only(source: ModelSource) -> dict:
    """from_pretrained keywords: this folder or GGUF file only, never a hub download, never remote code."""
    kwargs = dict(local_files_only=True, trust_remote_code=False)
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    return kwargs


def load_configs(source: ModelSource):
    """(config, generation config) of a source, without its weights: what compatibility checks need."""
    from transformers import AutoConfig, GenerationConfig

    kwargs = _local_only(source)
    try:
        config = AutoConfig.from_pretrained(source.path, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise SourceError(f"cannot read the config of {source.label}: {' '.join(str(exc).split())}") from None
    generation = None
    if not source.gguf_file:
        try:
            generation = GenerationConfig.from_pretrained(source.path, local_files_only=True)
        except (OSError, ValueError):
            generation = None
    if generation is None:
        generation = GenerationConfig.from_model_config(config)
    return config, generation


def load_model(source: ModelSource, dtype: str):
    """The Hugging Face causal LM in eval mode, weights in ``dtype``, eager attention (the parity reference)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise SourceError(f"dtype {dtype!r} is not one of {DTYPES}")
    kwargs = dict(_local_only(source), attn_implementation="eager")
    config = AutoConfig.from_pretrained(source.path, **kwargs)
    arch_for(getattr(config.get_text_config(), "model_type", config.model_type))
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=getattr(torch, dtype), **kwargs)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(source: ModelSource):
    """The fast tokenizer (its ``backend_tokenizer`` is what the runtime loads from tokenizer.json)."""
    from transformers import AutoTokenizer

    kwargs = _local_only(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot load a tokenizer from {source.label}: {exc}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise SourceError(f"{source.label} has no fast tokenizer (tokenizer.json): the runtime needs one")
    return tokenizer
