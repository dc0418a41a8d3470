"""Bundles: manifest round-trip, refusal of corrupted, missing, newer or inconsistent bundles."""

import json
import os
import re
import shutil

import pytest

from specdec import SpeculativeDecoder
from specdec.contract.manifest import BundleError, Manifest


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    return copy


@pytest.fixture
def standard_bundle_copy(tiny_standard_bundle, tmp_path):
    """A copy of the standard-form bundle (its KV tensors are [batch, past, kv_heads, head_dim])."""
    copy = tmp_path / "standard"
    shutil.copytree(tiny_standard_bundle, copy)
    return copy


def test_manifest_round_trips(tiny_bundle):
    manifest = Manifest.read(tiny_bundle)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert set(manifest.files) >= {"target/model.onnx", "draft/model.onnx", "tokenizer/tokenizer.json"}
    assert manifest.tools["onnxruntime"] and manifest.tools["torch"]


def test_corrupted_file_is_detected_at_load(bundle_copy):
    data = bundle_copy / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="target/model.onnx.data does not match its sha256"):
        SpeculativeDecoder.load(bundle_copy)


def test_missing_file_is_detected_at_load(bundle_copy):
    (bundle_copy / "draft" / "model.onnx.data").unlink()
    with pytest.raises(BundleError, match="draft/model.onnx.data is missing"):
        SpeculativeDecoder.load(bundle_copy)


def test_missing_bundle_and_missing_manifest(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        SpeculativeDecoder.load(tmp_path / "nope")
    with pytest.raises(BundleError, match="manifest.json is missing"):
        SpeculativeDecoder.load(tmp_path)


def _edit_manifest(bundle, edit):
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_newer_format_version_is_refused(bundle_copy):
    _edit_manifest(bundle_copy, lambda d: d.update(format_version=99))
    with pytest.raises(BundleError, match="newer than this specdec supports"):
        SpeculativeDecoder.load(bundle_copy)


def test_onnx_inputs_disagreeing_with_manifest_are_refused(bundle_copy):
    def rename(data):
        data["target"]["inputs"][0]["name"] = "tokens"

    _edit_manifest(bundle_copy, rename)
    with pytest.raises(BundleError, match="disagree with manifest.json"):
        SpeculativeDecoder.load(bundle_copy)


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.onnx", "target/../../x"])
def test_paths_outside_the_bundle_are_refused(bundle_copy, bad):
    def point_outside(data):
        data["target"]["onnx_file"] = bad
        data["files"][bad] = "0" * 64

    _edit_manifest(bundle_copy, point_outside)
    with pytest.raises(BundleError, match="outside the bundle"):
        SpeculativeDecoder.load(bundle_copy)


def test_symlink_leading_out_is_refused(bundle_copy, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    link = bundle_copy / "tokenizer" / "tokenizer.json"
    link.unlink()
    link.symlink_to(outside)
    with pytest.raises(BundleError, match="outside the bundle"):
        SpeculativeDecoder.load(bundle_copy)


def test_cached_hash_is_not_trusted_after_an_in_place_change(bundle_copy):
    SpeculativeDecoder.load(bundle_copy)  # verifies and caches every file
    data = bundle_copy / "draft" / "model.onnx.data"
    stat = data.stat()
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0x01
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # forge the old mtime: ctime still changes
    with pytest.raises(BundleError, match="draft/model.onnx.data does not match"):
        SpeculativeDecoder.load(bundle_copy)


def _point_external_data(bundle, location):
    """Rewrite the target graph's first external-data location (the onnx package is an export-side tool)."""
    onnx = pytest.importorskip("onnx")
    path = bundle / "target" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
                onnx.save(model, str(path))
                return
    raise AssertionError("no external data in the exported graph")


@pytest.mark.parametrize("location", ["/etc/passwd", "../../secret.bin", "elsewhere.bin"])
def test_external_data_outside_the_bundle_or_unhashed_is_refused(bundle_copy, location):
    _point_external_data(bundle_copy, location)

    def rehash(data):
        import hashlib

        data["files"]["target/model.onnx"] = hashlib.sha256((bundle_copy / "target" / "model.onnx").read_bytes()).hexdigest()

    _edit_manifest(bundle_copy, rehash)  # even a consistent manifest cannot make it load
    with pytest.raises(BundleError, match="refers to external data|outside the bundle"):
        SpeculativeDecoder.load(bundle_copy)


def test_external_data_symlink_leading_out_is_refused(bundle_copy, tmp_path):
    data = bundle_copy / "target" / "model.onnx.data"
    outside = tmp_path / "weights.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises(BundleError, match="outside the bundle"):
        SpeculativeDecoder.load(bundle_copy)


def test_external_data_locations_are_read_without_onnx(tiny_bundle):
    from specdec.contract.onnx_paths import external_data_locations

    assert external_data_locations((tiny_bundle / "target" / "model.onnx").read_bytes()) == {"model.onnx.data"}


# ---------------------------------------------------------------- every manifest field typed and checked

def _edited(tiny_bundle, edit) -> str:
    data = json.loads((tiny_bundle / "manifest.json").read_text())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize("version", [0, -7, True, "1", 1.5, None])
def test_format_version_must_be_a_positive_int(tiny_bundle, version):
    text = _edited(tiny_bundle, lambda d: d.update(format_version=version))
    with pytest.raises(BundleError, match=f"^manifest.json: format_version must be a positive integer, got "
                                          f"{re.escape(json.dumps(version))}$"):
        Manifest.from_json(text)


def _set(path: str, value):
    """An edit setting data[a][b]... (path "a.b.0.c" or a tuple of keys) to value, or deleting it (DELETE)."""
    def edit(data):
        keys = path if isinstance(path, tuple) else path.split(".")
        *parents, last = [int(p) if p.isdigit() else p for p in keys]
        for key in parents:
            data = data[key]
        if value is DELETE:
            del data[last]
        else:
            data[last] = value
    return edit


DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    ("target.head_dim", "x", 'target.head_dim must be a positive integer, got "x"'),
    ("target.num_layers", 0, "target.num_layers must be a positive integer, got 0"),
    ("target.vocab_size", True, "target.vocab_size must be a positive integer, got true"),
    ("target.max_positions", -1, "target.max_positions must be a positive integer, got -1"),
    ("draft.num_kv_heads", 2.0, "draft.num_kv_heads must be a positive integer, got 2.0"),
    ("target.kv_dtype", "float64", "target.kv_dtype must be one of float32, float16, bfloat16"),
    ("target.dtype", 32, "target.dtype must be one of"),
    ("target.quant", "int3", "target.quant must be one of none, int4, int8, int4-qdq"),
    ("target.sliding_window", -4, "target.sliding_window must be a positive integer"),
    ("target.bos_token_id", "2", 'target.bos_token_id must be a token id (an integer >= 0), got "2"'),
    ("target.eos_token_ids", "1", 'target.eos_token_ids must be a list, got "1"'),
    ("target.eos_token_ids", [1, -1], "target.eos_token_ids[1] must be a token id"),
    ("target.bos_token_id", 500, "target.bos_token_id 500 is not below vocab_size 128"),
    ("target.architecture", "", "target.architecture must be a non-empty string"),
    ("target.onnx_file", None, "target.onnx_file must be a path relative to the bundle, got null"),
    ("target.inputs.0.dtype", "complex", "target.inputs[0].dtype must be one of"),
    ("target.inputs.0.shape", "abc", 'target.inputs[0].shape must be a list, got "abc"'),
    ("target.inputs.0.shape", [0, "n"], "target.inputs[0].shape[0] must be a positive integer or a dimension"),
    ("target.kv.0", ["past.0.key"], "target.kv[0] must be an object"),
    ("target.kv.0.new_key", DELETE, "target.kv[0].new_key is missing"),
    ("target.vocab_size", DELETE, "target.vocab_size is missing"),
    ("target.role", "draft", 'target.role is "draft": the target section must hold the target'),
    ("draft.eos_token_ids", [2], "draft.eos_token_ids [2] differs from target.eos_token_ids [1]"),
    ("target.colour", "red", "target has unknown fields ['colour']"),
    ("bogus", 1, "unknown top-level fields ['bogus']"),
    ("tokenizer_file", DELETE, "tokenizer_file is missing"),
    (("files", "tokenizer/tokenizer.json"), "zz", 'files["tokenizer/tokenizer.json"] must be a sha256'),
])
def test_every_field_is_typed_and_range_checked(tiny_bundle, path, value, message):
    """One line starting with manifest.json: and naming the field."""
    with pytest.raises(BundleError) as caught:
        Manifest.from_json(_edited(tiny_bundle, _set(path, value)))
    assert str(caught.value).startswith(f"manifest.json: {message}"), caught.value
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("section, value, message", [
    ("target", [], "target must be an object, got []"),
    ("target", "x", 'target must be an object, got "x"'),
    ("draft", 5, "draft must be an object, got 5"),
    ("files", [], "files must be an object, got []"),
    ("tools", 5, "tools must be an object, got 5"),
    ("extra", [1], "extra must be an object, got [1]"),
    ("engines", {"target": 5}, 'engines["target"] must be an object, got 5'),
])
def test_wrong_typed_sections_name_the_section(tiny_bundle, section, value, message):
    with pytest.raises(BundleError) as caught:
        Manifest.from_json(_edited(tiny_bundle, _set(section, value)))
    assert str(caught.value) == f"manifest.json: {message}"


@pytest.mark.parametrize("path, value, message", [
    ("target.vocab_size", 130, r"target.vocab_size is 130 but the logits tensor has shape"),
    ("target.head_dim", 8, r"target.num_kv_heads 2 / head_dim 8 do not match past.0.key.0"),
    ("draft.num_kv_heads", 4, r"draft.kv\[0\] names 'past.0.key.2', which draft.inputs does not have"),
    ("target.kv_dtype", "float32", r"target.kv_dtype is float32 but past.0.key.0 has dtype float16"),
    ("target.num_layers", 3, r"target.kv has 2 name sets for num_layers 3"),
])
def test_geometry_edits_are_refused_at_load_not_at_generate(bundle_copy, path, value, message):
    _edit_manifest(bundle_copy, _set(path, value))
    with pytest.raises(BundleError, match=f"^manifest.json: {message}"):
        SpeculativeDecoder.load(bundle_copy)


def _geometry(field, value):
    """Change a size consistently through the whole manifest: only the ONNX graph can tell."""
    def edit(data):
        for role in ("target", "draft"):  # both: the draft must agree with the target on the vocabulary
            _change(data[role], field, value)
    return edit


def _change(spec, field, value):
    spec[field] = value
    for tensor in spec["inputs"] + spec["outputs"]:
        if field == "vocab_size" and tensor["name"] == "logits":
            tensor["shape"][-1] = value
        if tensor["name"].startswith(("past.", "new.")):
            if field == "kv_dtype":
                tensor["dtype"] = value
            elif field in ("num_kv_heads", "head_dim"):
                tensor["shape"][{"num_kv_heads": 2, "head_dim": 3}[field]] = value


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 130, "ONNX output logits has size 128 on axis 2 in the graph but 130 in manifest.json"),
    ("head_dim", 8, "ONNX input past.0.key has size 16 on axis 3 in the graph but 8 in manifest.json"),
    ("num_kv_heads", 4, "ONNX input past.0.key has size 2 on axis 2 in the graph but 4 in manifest.json"),
    ("kv_dtype", "float16", "ONNX input past.0.key is tensor(float) in the graph but float16 in manifest.json"),
])
def test_consistent_geometry_edits_are_caught_by_the_graph_declarations(standard_bundle_copy, field, value, message):
    """The graph's declared shapes and element types are compared with the manifest when the session opens."""
    _edit_manifest(standard_bundle_copy, _geometry(field, value))
    with pytest.raises(BundleError, match=re.escape(message)):
        SpeculativeDecoder.load(standard_bundle_copy)


def test_every_model_field_has_a_check():
    """A new ModelSpec field needs its line in MODEL_FIELDS (typed and range-checked like the others)."""
    import dataclasses

    from specdec.contract.manifest import MODEL_FIELDS, ModelSpec

    assert set(MODEL_FIELDS) == {f.name for f in dataclasses.fields(ModelSpec)}


def test_runtime_knows_every_quantization_the_exporter_writes():
    pytest.importorskip("onnx")
    from specdec.export.quantize import QUANTS as EXPORTED
    from specdec.contract.manifest import QUANTS

    assert set(EXPORTED) <= set(QUANTS)


# ---------------------------------------------------------------- the verified-hash cache is never an error

@pytest.mark.parametrize("content", [b"null", b"[]", b'"text"', b"5", b'{"k": 5}', b'{"k": [[1, 2], "ab"]}',
                                     b'{"k": [[1, 2, 3, true], "' + b"a" * 64 + b'"]}', b"\xff\xfe{", b"{"])
def test_a_hash_cache_of_any_wrong_shape_is_ignored_and_rewritten(tiny_bundle, tmp_path, monkeypatch, content):
    from specdec.contract.bundle import default_hash_cache

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    cache = default_hash_cache()
    cache.parent.mkdir()
    cache.write_bytes(content)
    SpeculativeDecoder.load(tiny_bundle)
    rewritten = json.loads(cache.read_text())
    assert isinstance(rewritten, dict) and "k" not in rewritten
    assert all(isinstance(v, list) and len(v[1]) == 64 for v in rewritten.values()) and len(rewritten) >= 5
