"""The exported I/O contract: one frozen dataclass tree, written to ``manifest.json``.

The exporter writes it; the runtime binds only from it (names, dtypes, ranks, sizes).
Nothing here imports torch: the runtime reads manifests on edge devices.

Graph contract of every exported model (one graph per model, T new tokens, P past slots):

| name                              | dir | dtype          | shape                                |
|-----------------------------------|-----|----------------|--------------------------------------|
| input_ids                         | in  | int64          | [batch, new_tokens]                  |
| position_ids                      | in  | int64          | [batch, new_tokens]                  |
| attention_mask                    | in  | bool           | [batch, new_tokens, past + new]      |
| sliding_attention_mask (optional) | in  | bool           | [batch, new_tokens, past + new]      |
| past.{i}.key / past.{i}.value     | in  | kv dtype       | [batch, past, kv_heads, head_dim]    |
| logits                            | out | float32        | [batch, new_tokens, vocab]           |
| new.{i}.key / new.{i}.value       | out | kv dtype       | [batch, new_tokens, kv_heads, head_dim] |

``attention_mask[b, t, j]`` is True where new token t may attend to slot j (the past slots
first, then the T new tokens): it expresses any tree among the new tokens and which past
slots are valid. ``sliding_attention_mask`` is the same with the model's sliding window
applied; only models with sliding-window layers have it. The KV layout is sequence-major
so that ``cache[:, :P]`` and ``cache[:, P:P+T]`` are contiguous views for batch 1: the
runtime binds the past in place and lets the graph write the new rows straight into the
cache.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ROLES = ("target", "draft")


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with or incompatible."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16", "bfloat16", "bool"
    shape: tuple  # ints and symbolic dimension names

    @staticmethod
    def from_dict(data: dict) -> "TensorSpec":
        return TensorSpec(name=data["name"], dtype=data["dtype"], shape=tuple(data["shape"]))


@dataclass(frozen=True)
class KVNames:
    past_key: str
    past_value: str
    new_key: str
    new_value: str


@dataclass(frozen=True)
class ModelSpec:
    role: str  # "target" | "draft"
    architecture: str  # key of the exporter's architecture table
    onnx_file: str  # relative to the bundle root
    inputs: tuple  # of TensorSpec
    outputs: tuple  # of TensorSpec
    kv: tuple  # of KVNames, one per layer
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    kv_dtype: str  # numpy dtype name of the cache
    dtype: str  # "float32" | "float16" | "bfloat16"
    quant: str  # "none" | "int4" | "int8" (MatMulNBits) | "int4-qdq" (DequantizeLinear + MatMul)
    sliding_window: int | None  # window of the sliding layers, None if the model has none
    bos_token_id: int | None
    eos_token_ids: tuple  # of int
    pad_token_id: int | None
    # a draft with a pruned vocabulary (specdec.runtime.vocab_map): bundle-relative .npy of the K token ids its
    # logits score, ascending; None = logits over the whole vocabulary
    vocab_subset: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise BundleError(f"model role {self.role!r} is not one of {ROLES}")
        if len(self.kv) != self.num_layers:
            raise BundleError(f"{self.role}: {len(self.kv)} KV name sets for {self.num_layers} layers")

    @property
    def has_sliding_mask(self) -> bool:
        return any(spec.name == "sliding_attention_mask" for spec in self.inputs)

    @staticmethod
    def from_dict(data: dict) -> "ModelSpec":
        data = dict(data)
        data["inputs"] = tuple(TensorSpec.from_dict(d) for d in data["inputs"])
        data["outputs"] = tuple(TensorSpec.from_dict(d) for d in data["outputs"])
        data["kv"] = tuple(KVNames(**d) for d in data["kv"])
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        known = {f.name for f in dataclasses.fields(ModelSpec)}
        unknown = set(data) - known
        if unknown:
            raise BundleError(f"manifest model entry has unknown fields {sorted(unknown)}")
        return ModelSpec(**data)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    target: ModelSpec
    draft: ModelSpec | None
    tokenizer_file: str  # relative path of tokenizer.json
    files: dict = field(default_factory=dict)  # relative path -> sha256 of every file in the bundle
    tools: dict = field(default_factory=dict)  # tool name -> version that made the bundle
    extra: dict = field(default_factory=dict)  # free notes (parity errors, export time); never read by the runtime
    engines: dict = field(default_factory=dict)  # role -> TensorRT engine record (specdec.engines.records)

    def models(self) -> dict:
        return {"target": self.target} | ({"draft": self.draft} if self.draft is not None else {})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=False) + "\n"

    @staticmethod
    def from_json(text: str) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BundleError(f"manifest.json is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or "format_version" not in data:
            raise BundleError("manifest.json has no format_version: not a specdec bundle")
        version = data["format_version"]
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise BundleError(
                f"bundle format version {version} is newer than this specdec supports ({FORMAT_VERSION}): upgrade specdec"
            )
        try:
            return Manifest(
                format_version=version,
                target=ModelSpec.from_dict(data["target"]),
                draft=ModelSpec.from_dict(data["draft"]) if data.get("draft") else None,
                tokenizer_file=data["tokenizer_file"],
                files=dict(data.get("files", {})),
                tools=dict(data.get("tools", {})),
                extra=dict(data.get("extra", {})),
                engines=dict(data.get("engines", {})),
            )
        except (KeyError, TypeError) as exc:
            raise BundleError(f"manifest.json is malformed: {exc!r}") from None

    @staticmethod
    def read(bundle_dir: str | Path) -> "Manifest":
        path = Path(bundle_dir) / MANIFEST_NAME
        if not Path(bundle_dir).is_dir():
            raise BundleError(f"bundle folder {bundle_dir} does not exist")
        if not path.is_file():
            raise BundleError(f"{path} is missing: not a specdec bundle (export one with specdec-export)")
        return Manifest.from_json(path.read_text())


def kv_names(num_layers: int) -> tuple:
    return tuple(
        KVNames(f"past.{i}.key", f"past.{i}.value", f"new.{i}.key", f"new.{i}.value") for i in range(num_layers)
    )


def graph_io(num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int, kv_dtype: str, sliding: bool):
    """The (inputs, outputs) TensorSpecs of the graph contract in the module docstring."""
    mask_shape = ("batch", "new_tokens", "total_tokens")
    inputs = [
        TensorSpec("input_ids", "int64", ("batch", "new_tokens")),
        TensorSpec("position_ids", "int64", ("batch", "new_tokens")),
        TensorSpec("attention_mask", "bool", mask_shape),
    ]
    if sliding:
        inputs.append(TensorSpec("sliding_attention_mask", "bool", mask_shape))
    outputs = [TensorSpec("logits", "float32", ("batch", "new_tokens", vocab_size))]
    for names in kv_names(num_layers):
        for name in (names.past_key, names.past_value):
            inputs.append(TensorSpec(name, kv_dtype, ("batch", "past_tokens", num_kv_heads, head_dim)))
        for name in (names.new_key, names.new_value):
            outputs.append(TensorSpec(name, kv_dtype, ("batch", "new_tokens", num_kv_heads, head_dim)))
    return tuple(inputs), tuple(outputs)
