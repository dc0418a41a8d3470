"""The exported I/O contract: one frozen dataclass tree, written to ``manifest.json``.

The exporter writes it; the runtime binds only from it (names, dtypes, ranks, sizes). The graphs' inputs and
outputs in both forms (standard: the past in, the new rows out; fused: one KV buffer per layer read and written in
place by GroupQueryAttention) are tabled in docs/bundle.md ("I/O contract"). Nothing here imports torch: the
runtime reads manifests on edge devices.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from specdec.contract.fim import FIM_ROLES
from specdec.contract.field_checks import (FieldError, anything, dimension, fail, int_in, is_int, mapping, one_of, optional, positive_int,
                           record, relative_path, sha256_hex, shown, text, token_id, tuple_of)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ROLES = ("target", "draft")
# how a model's decoder-layer projections hold their weights: MatMulNBits' int4 blocks, or int8 rows
# (export/int8_rows.py); a bundle may carry a model in both (ModelSpec.weight_forms)
WEIGHT_FORMS = ("nbits", "int8")
TENSOR_DTYPES = ("bool", "int8", "int32", "int64", "float32", "float16", "bfloat16")  # numpy names the contract may use
MODEL_DTYPES = ("float32", "float16", "bfloat16")  # weights
KV_DTYPES = MODEL_DTYPES + ("int8",)  # KV cache; int8: the folded form's, a float32 scale per row (kv_scale_tensors)
KV_SCALE_DTYPE = "float32"
QUANTS = ("none", "int4", "int8", "int4-qdq")
LOGITS_DTYPE = "float32"  # the runtime binds a float32 logits buffer
LOGIT_ROWS = "logit_rows"  # fused graphs' optional input: which new rows get logits (module docstring)
# onnxruntime's element type strings (NodeArg.type) for the numpy names above
ORT_TYPES = {"bool": "tensor(bool)", "int8": "tensor(int8)", "int32": "tensor(int32)", "int64": "tensor(int64)", "float32": "tensor(float)",
             "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"}
# graph form -> its KV layout: "split-bsnh" = past in [batch, past, kv_heads, head_dim], new rows out separately;
# "shared-bnsh" = one [batch, kv_heads, max_context, head_dim] buffer per layer read and written in place
KV_LAYOUTS = {"standard": "split-bsnh", "fused": "shared-bnsh"}
# the fused form's attention: "gqa" = GroupQueryAttention reads and writes each layer's [1, kv_heads, slots, D]
# buffer in place (every query head re-reads its KV head: the cost grows 6-7x the cache per pass);
# "folded" = each KV head's rows [0, cache_rows) are their own input (a view of the same buffer), the new rows are
# scattered into it in place and the query heads that share it are folded into the rows of one Gemm, so a pass
# reads every cache row once (docs/bundle.md, "Folded attention")
ATTENTION_FORMS = ("gqa", "folded")


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with or incompatible."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16", "bfloat16", "bool"
    shape: tuple  # ints and symbolic dimension names

    @staticmethod
    def from_dict(data: dict) -> "TensorSpec":
        try:
            return TENSOR_SPEC(data, "tensor")
        except FieldError as exc:
            raise BundleError(str(exc)) from None


TENSOR_SPEC = record(TensorSpec, {"name": text, "dtype": one_of(TENSOR_DTYPES), "shape": tuple_of(dimension)})


@dataclass(frozen=True)
class KVNames:
    past_key: str
    past_value: str
    new_key: str
    new_value: str


KV_NAMES = record(KVNames, {"past_key": text, "past_value": text, "new_key": text, "new_value": text})


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
    # graph form: bundles written before these fields load as "standard"
    graph: str = "standard"  # "standard" (portable ONNX, TensorRT's input) | "fused" (onnxruntime contrib ops)
    kv_layout: str = "split-bsnh"  # see KV_LAYOUTS
    # a draft with a pruned vocabulary (specdec.runners.vocab_map): bundle-relative .npy of the K token ids its
    # logits score, ascending; None = logits over the whole vocabulary
    vocab_subset: str | None = None
    # fused form: GroupQueryAttention runs T + attention_scratch_rows rows (the extra rows repeat the last one), so a
    # one-token pass takes onnxruntime's multi-row kernel like a verify pass and a row's numbers do not depend on T;
    # their KV rows land in scratch slots after the new rows (the buffer has max_context + this many slots).
    # 0 in bundles written before this field (their one-token passes round differently from verify passes).
    attention_scratch_rows: int = 0
    attention: str = "gqa"  # fused form: see ATTENTION_FORMS ("gqa" in bundles written before this field)
    # the same graph written with other weight forms: ((form, onnx file), ...), the first being onnx_file's; the
    # machine that loads the bundle measures them and runs one (decoding/forms.py). Empty: onnx_file alone.
    weight_forms: tuple = ()

    def files(self) -> tuple:
        """Every ONNX file of this model: onnx_file, then its other weight forms'."""
        return tuple(dict.fromkeys([self.onnx_file, *(path for _, path in self.weight_forms)]))

    def __post_init__(self):
        prefix = self.role if self.role in ROLES else "model"
        try:
            for name, check in MODEL_FIELDS.items():  # typed and range-checked, lists become tuples
                if hasattr(self, name):
                    object.__setattr__(self, name, check(getattr(self, name), f"{prefix}.{name}"))
        except FieldError as exc:
            raise BundleError(str(exc)) from None
        if self.graph != "fused" and self.attention_scratch_rows:
            raise BundleError(f"manifest.json: {prefix}.attention_scratch_rows applies to the fused form only, "
                              f"this graph is {self.graph!r}")
        if self.attention != "gqa" and (self.graph != "fused" or self.attention_scratch_rows):
            raise BundleError(f"manifest.json: {prefix}.attention {self.attention!r} is a fused form without scratch rows, "
                              f"this graph is {self.graph!r} with {self.attention_scratch_rows} scratch rows")
        if KV_LAYOUTS.get(self.graph) != self.kv_layout:
            raise BundleError(f"manifest.json: {prefix} graph form {self.graph!r} with KV layout {self.kv_layout!r} "
                              f"is not one of {sorted(KV_LAYOUTS.items())}")
        _check_geometry(self)

    def kv_tensors(self, layer: int) -> tuple:
        """Layer ``layer``'s KV tensor names as (past_key, past_value, new_key, new_value) tuples: one for the layer,
        or one per KV head in the folded form (``<name>.<head>``)."""
        names = self.kv[layer]
        base = (names.past_key, names.past_value, names.new_key, names.new_value)
        if self.attention != "folded":
            return (base,)
        return tuple(tuple(f"{name}.{head}" for name in base) for head in range(self.num_kv_heads))

    def kv_scale_tensors(self, layer: int) -> tuple:
        """An int8 cache's scales beside ``kv_tensors``: per KV head (past_key, past_value, new_key, new_value) names
        of ``[cache_rows, 1]`` float32 views (``<name>_scale.<head>``; row r's values are the int8 row times its
        scale); () for a float cache."""
        if self.kv_dtype != "int8":
            return ()
        names = self.kv[layer]
        base = (names.past_key, names.past_value, names.new_key, names.new_value)
        return tuple(tuple(f"{name}_scale.{head}" for name in base) for head in range(self.num_kv_heads))

    def has_input(self, name: str) -> bool:
        return any(spec.name == name for spec in self.inputs)

    @property
    def has_sliding_mask(self) -> bool:
        return any(spec.name in ("sliding_attention_mask", "sliding_attention_bias") for spec in self.inputs)

    @staticmethod
    def from_dict(data: dict, where: str = "model") -> "ModelSpec":
        try:
            return ModelSpec._from_dict(data, where)
        except FieldError as exc:
            raise BundleError(str(exc)) from None

    @staticmethod
    def _from_dict(data: dict, where: str) -> "ModelSpec":
        if not isinstance(data, dict):
            fail(where, "an object", data)
        known = {f.name for f in dataclasses.fields(ModelSpec)}
        unknown = set(data) - known
        if unknown:
            raise BundleError(f"{where} has unknown fields {sorted(unknown)}")
        required = [f.name for f in dataclasses.fields(ModelSpec)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise BundleError(f"{where}.{missing[0]} is missing")
        checked = {name: MODEL_FIELDS.get(name, anything)(value, f"{where}.{name}") for name, value in data.items()}
        if checked["role"] != where and where in ROLES:
            raise BundleError(f"{where}.role is {shown(checked['role'])}: the {where} section must hold the {where}")
        return ModelSpec(**checked)


# One line per ModelSpec field (a new field needs a line here; tests/contract/test_bundle_integrity.py checks it).
MODEL_FIELDS = {
    "role": one_of(ROLES),
    "architecture": text,
    "onnx_file": relative_path,
    "inputs": tuple_of(TENSOR_SPEC),
    "outputs": tuple_of(TENSOR_SPEC),
    "kv": tuple_of(KV_NAMES),
    "num_layers": positive_int,
    "num_kv_heads": positive_int,
    "head_dim": positive_int,
    "hidden_size": positive_int,
    "vocab_size": positive_int,
    "max_positions": positive_int,
    "kv_dtype": one_of(KV_DTYPES),
    "dtype": one_of(MODEL_DTYPES),
    "quant": one_of(QUANTS),
    "sliding_window": optional(positive_int),
    "bos_token_id": optional(token_id),
    "eos_token_ids": tuple_of(token_id),
    "pad_token_id": optional(token_id),
    "graph": one_of(tuple(KV_LAYOUTS)),
    "kv_layout": one_of(tuple(KV_LAYOUTS.values())),
    "vocab_subset": optional(text),
    "attention_scratch_rows": int_in(0, 1),
    "attention": one_of(ATTENTION_FORMS),
    "weight_forms": lambda value, where: _weight_forms(value, where),
}


def _weight_forms(value, where) -> tuple:
    pairs = tuple_of(tuple_of(text))(value, where)
    if any(len(pair) != 2 or pair[0] not in WEIGHT_FORMS for pair in pairs):
        fail(where, f"a list of [form, onnx file] pairs, forms one of {', '.join(WEIGHT_FORMS)}", value)
    if pairs and len({form for form, _ in pairs}) != len(pairs):
        fail(where, "a list naming each form once", value)
    return pairs


def _kv_dims(shape: tuple) -> tuple:
    """The fixed (integer) dimensions of a KV tensor, in order: (kv_heads, head_dim) in any layout, (head_dim,) for
    one KV head's rows (the folded form)."""
    return tuple(d for d in shape if isinstance(d, int))


def _check_geometry(spec: "ModelSpec") -> None:
    """The manifest agrees with itself: layer count, token ids, and the logits/KV tensors vs the sizes."""
    role = spec.role
    if len(spec.kv) != spec.num_layers:
        raise BundleError(f"{role}.kv has {len(spec.kv)} name sets for num_layers {spec.num_layers}")
    # bos may be fed to the model: it must have an embedding row. eos / pad ids outside the vocabulary are
    # only never produced (tokenizers may define ids the embedding does not cover), so they are allowed.
    if spec.bos_token_id is not None and spec.bos_token_id >= spec.vocab_size:
        raise BundleError(f"{role}.bos_token_id {spec.bos_token_id} is not below vocab_size {spec.vocab_size}")
    inputs = {t.name: t for t in spec.inputs}
    outputs = {t.name: t for t in spec.outputs}
    for names, where in ((inputs, "inputs"), (outputs, "outputs")):
        if len(names) != len(getattr(spec, where)):
            raise BundleError(f"{role}.{where} names a tensor twice")
    logits = outputs.get("logits")
    if logits is None:
        raise BundleError(f"{role}.outputs has no logits tensor")
    if logits.dtype != LOGITS_DTYPE:
        raise BundleError(f"{role}.outputs logits has dtype {logits.dtype}; the runtime reads {LOGITS_DTYPE} logits")
    width = logits.shape[-1] if logits.shape else None
    if spec.vocab_subset is None and width != spec.vocab_size:
        raise BundleError(f"{role}.vocab_size is {spec.vocab_size} but the logits tensor has shape {list(logits.shape)}")
    if spec.vocab_subset is not None and not (isinstance(width, int) and 0 < width <= spec.vocab_size):
        raise BundleError(f"{role}.vocab_subset scores a pruned vocabulary but the logits tensor has shape "
                          f"{list(logits.shape)} (vocab_size {spec.vocab_size})")
    if spec.kv_dtype == "int8" and spec.attention != "folded":
        raise BundleError(f"{role}.kv_dtype int8 is the folded attention's cache, not the {spec.attention!r} form's")
    dims = (spec.head_dim,) if spec.attention == "folded" else (spec.num_kv_heads, spec.head_dim)
    for layer in range(len(spec.kv)):
        for name, table, where in ((name, table, where) for past_key, past_value, new_key, new_value in
                                   spec.kv_tensors(layer) for name, table, where in (
                                       (past_key, inputs, "inputs"), (past_value, inputs, "inputs"),
                                       (new_key, outputs, "outputs"), (new_value, outputs, "outputs"))):
            tensor = table.get(name)
            if tensor is None:
                raise BundleError(f"{role}.kv[{layer}] names {name!r}, which {role}.{where} does not have")
            if tensor.dtype != spec.kv_dtype:
                raise BundleError(f"{role}.kv_dtype is {spec.kv_dtype} but {name} has dtype {tensor.dtype}")
            if _kv_dims(tensor.shape) != dims:
                raise BundleError(f"{role}.num_kv_heads {spec.num_kv_heads} / head_dim {spec.head_dim} do not match "
                                  f"{name} of shape {list(tensor.shape)}")
    for layer in range(len(spec.kv)):
        for past_key, past_value, new_key, new_value in spec.kv_scale_tensors(layer):
            for name, table in ((past_key, inputs), (past_value, inputs), (new_key, outputs), (new_value, outputs)):
                tensor = table.get(name)
                if tensor is None or tensor.dtype != KV_SCALE_DTYPE or _kv_dims(tensor.shape) != (1,):
                    raise BundleError(f"{role}.kv_dtype int8 needs a {KV_SCALE_DTYPE} [cache_rows, 1] tensor {name!r}")


def check_graph(spec: ModelSpec, graph_inputs, graph_outputs) -> None:
    """The ONNX graph declares exactly the manifest's tensors: names, ranks, element types, fixed sizes.

    ``graph_inputs`` / ``graph_outputs``: onnxruntime ``session.get_inputs()`` / ``get_outputs()``
    (objects with ``name``, ``type``, ``shape``). Cheap: reads only the graph's declarations. A
    dimension is compared only where both sides fix it (the graph may leave any one symbolic).
    """
    for kind, declared, actual in (("input", spec.inputs, graph_inputs), ("output", spec.outputs, graph_outputs)):
        want = {t.name: t for t in declared}
        have = {arg.name: arg for arg in actual}
        if set(want) != set(have):
            missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
            raise BundleError(f"{spec.role} ONNX {kind}s disagree with manifest.json (manifest-only: {missing[:3]}, "
                              f"graph-only: {extra[:3]}): the bundle is corrupt")
        for name, tensor in want.items():
            arg = have[name]
            if len(arg.shape) != len(tensor.shape):
                raise BundleError(f"{spec.role} ONNX {kind}s disagree with manifest.json: {name} has rank "
                                  f"{len(arg.shape)} in the graph, {len(tensor.shape)} in manifest.json")
            if arg.type != ORT_TYPES.get(tensor.dtype):
                raise BundleError(f"{spec.role} ONNX {kind} {name} is {arg.type} in the graph but {tensor.dtype} in "
                                  "manifest.json: the bundle is corrupt")
            for axis, (graph_dim, manifest_dim) in enumerate(zip(arg.shape, tensor.shape)):
                if is_int(graph_dim) and is_int(manifest_dim) and graph_dim != manifest_dim:
                    raise BundleError(f"{spec.role} ONNX {kind} {name} has size {graph_dim} on axis {axis} in the "
                                      f"graph but {manifest_dim} in manifest.json: the bundle is corrupt")


def format_version(value, where):
    if not is_int(value) or value < 1:
        fail(where, "a positive integer", value)
    if value > FORMAT_VERSION:
        raise BundleError(f"bundle format version {value} is newer than this specdec supports ({FORMAT_VERSION}): "
                          "upgrade specdec")
    return value


@dataclass(frozen=True)
class SourceFile:
    """A model file a bundle was exported from (provenance: benches and evals compare against it; the runtime
    never reads it). ``path`` is as the exporter was given it (on the exporting machine)."""
    path: str
    file_name: str
    size: int  # bytes
    sha256: str


def _non_negative_int(value, where):
    return value if is_int(value) and value >= 0 else fail(where, "an integer >= 0", value)


SOURCE_FILE = record(SourceFile, {"path": text, "file_name": text, "size": _non_negative_int, "sha256": sha256_hex})


@dataclass(frozen=True)
class Manifest:
    format_version: int
    target: ModelSpec
    draft: ModelSpec | None
    tokenizer_file: str  # relative path of tokenizer.json
    files: dict = field(default_factory=dict)  # relative path -> sha256 of every file in the bundle
    tools: dict = field(default_factory=dict)  # tool name -> version that made the bundle
    extra: dict = field(default_factory=dict)  # free notes (parity errors, export time); never read by the runtime
    engines: dict = field(default_factory=dict)  # role -> TensorRT engine record (specdec.runners.tensorrt.records)
    fim_tokens: dict = field(default_factory=dict)  # fill-in-the-middle role -> token id (contract/fim.py); {} = none
    # role -> SourceFile of the single-file source (a GGUF) each model was exported from; {} in bundles written
    # before this field and for folder sources
    sources: dict = field(default_factory=dict)

    def __post_init__(self):
        stray = sorted(set(self.sources) - set(self.models()))
        if stray:
            raise BundleError(f"sources names {stray[0]!r}, a model this bundle does not have")
        if self.draft is not None:  # acceptance compares the two distributions id by id
            for key in ("vocab_size", "eos_token_ids"):
                if getattr(self.draft, key) != getattr(self.target, key):
                    raise BundleError(f"draft.{key} {shown(getattr(self.draft, key))} differs from target.{key} "
                                      f"{shown(getattr(self.target, key))}: not a draft for this target")

    def models(self) -> dict:
        return {"target": self.target} | ({"draft": self.draft} if self.draft is not None else {})

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for role in ROLES:  # a model in one form writes no weight_forms: its manifest (and identity) as before the field
            if data.get(role) is not None and not data[role]["weight_forms"]:
                del data[role]["weight_forms"]
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    @staticmethod
    def from_json(text: str) -> "Manifest":
        """Parse and check every field; a problem is one BundleError line naming the field."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BundleError(f"{MANIFEST_NAME} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or "format_version" not in data:
            raise BundleError(f"{MANIFEST_NAME} has no format_version: not a specdec bundle")
        try:
            format_version(data["format_version"], "format_version")  # first: a newer bundle may differ in all else
            unknown = sorted(set(data) - set(MANIFEST_FIELDS))
            if unknown:
                raise BundleError(f"unknown top-level fields {unknown}")
            for name in ("target", "tokenizer_file"):
                if name not in data:
                    raise BundleError(f"{name} is missing")
            return Manifest(**{name: MANIFEST_FIELDS[name](value, name) for name, value in data.items()})
        except (BundleError, FieldError) as exc:
            raise BundleError(f"{MANIFEST_NAME}: {exc}") from None

    @staticmethod
    def read(bundle_dir: str | Path) -> "Manifest":
        path = Path(bundle_dir) / MANIFEST_NAME
        if not Path(bundle_dir).is_dir():
            raise BundleError(f"bundle folder {bundle_dir} does not exist")
        if not path.is_file():
            raise BundleError(f"{path} is missing: not a specdec bundle (export one with specdec-export)")
        try:
            return Manifest.from_json(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BundleError(f"{MANIFEST_NAME} is not valid UTF-8 text: {exc}") from None


# One line per Manifest field.
MANIFEST_FIELDS = {
    "format_version": format_version,
    "target": lambda value, where: ModelSpec.from_dict(value, where),
    "draft": optional(lambda value, where: ModelSpec.from_dict(value, where)),
    "tokenizer_file": relative_path,
    "files": mapping(relative_path, sha256_hex),
    "tools": mapping(text, anything),
    "extra": mapping(text, anything),
    "engines": mapping(one_of(ROLES), mapping(text, anything)),
    "fim_tokens": mapping(one_of(FIM_ROLES), token_id),
    "sources": mapping(one_of(ROLES), SOURCE_FILE),
}


def kv_names(num_layers: int) -> tuple:
    return tuple(
        KVNames(f"past.{i}.key", f"past.{i}.value", f"new.{i}.key", f"new.{i}.value") for i in range(num_layers)
    )


def forms_of(spec) -> dict:
    """A model's weight forms, ``{name: onnx file}`` in the bundle's order; ``{None: onnx_file}`` for a model in one
    form (``spec``: a ModelSpec, or anything with its ``weight_forms`` and ``onnx_file``)."""
    return dict(spec.weight_forms) or {None: spec.onnx_file}


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


PAST_LENGTH = "past_length"  # the folded form's input: slots before this pass's rows (int64 [1])


def fused_graph_io(num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int, kv_dtype: str, sliding: bool,
                   attention: str = "gqa"):
    """The (inputs, outputs) TensorSpecs of the fused form's contract (docs/bundle.md, "I/O contract").

    gqa: the bias covers the pass's total tokens; per layer one [batch, kv_heads, max_context, head_dim] buffer in
    and out. folded: the bias covers ``cache_rows`` columns (the rows bound, a multiple of the runtime's chunk; the
    columns past the total are blocked), ``past_length`` says where the new rows go, and per layer and KV head one
    [cache_rows, head_dim] view in and the same view out."""
    columns = "cache_rows" if attention == "folded" else "total_tokens"
    bias_shape = ("batch", 1, "new_tokens", columns)
    inputs = [
        TensorSpec("input_ids", "int64", ("batch", "new_tokens")),
        TensorSpec("position_ids", "int64", ("batch", "new_tokens")),
        TensorSpec("attention_bias", "float32", bias_shape),
    ]
    if sliding:
        inputs.append(TensorSpec("sliding_attention_bias", "float32", bias_shape))
    if attention == "folded":
        inputs.append(TensorSpec(PAST_LENGTH, "int64", (1,)))
    else:
        inputs += [TensorSpec("seqlens_k", "int32", ("batch",)), TensorSpec("total_sequence_length", "int32", ())]
    inputs.append(TensorSpec(LOGIT_ROWS, "int64", (LOGIT_ROWS,)))
    outputs = [TensorSpec("logits", "float32", ("batch", LOGIT_ROWS, vocab_size))]
    for names in fused_kv_names(num_layers):
        if attention == "folded":
            for head in range(num_kv_heads):
                inputs += [TensorSpec(f"{name}.{head}", kv_dtype, ("cache_rows", head_dim))
                           for name in (names.past_key, names.past_value)]
                outputs += [TensorSpec(f"{name}.{head}", kv_dtype, ("cache_rows", head_dim))
                            for name in (names.new_key, names.new_value)]
                if kv_dtype == "int8":
                    inputs += [TensorSpec(f"{name}_scale.{head}", KV_SCALE_DTYPE, ("cache_rows", 1))
                               for name in (names.past_key, names.past_value)]
                    outputs += [TensorSpec(f"{name}_scale.{head}", KV_SCALE_DTYPE, ("cache_rows", 1))
                                for name in (names.new_key, names.new_value)]
        else:
            cache_shape = ("batch", num_kv_heads, "max_context", head_dim)
            inputs += [TensorSpec(names.past_key, kv_dtype, cache_shape), TensorSpec(names.past_value, kv_dtype, cache_shape)]
            outputs += [TensorSpec(names.new_key, kv_dtype, cache_shape), TensorSpec(names.new_value, kv_dtype, cache_shape)]
    return tuple(inputs), tuple(outputs)


def fused_kv_names(num_layers: int) -> tuple:
    """Fused form: ``new_*`` name the present outputs, bound to the same buffer as ``past_*``."""
    return tuple(
        KVNames(f"past.{i}.key", f"past.{i}.value", f"present.{i}.key", f"present.{i}.value") for i in range(num_layers)
    )
