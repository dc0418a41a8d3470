"""Bundles: manifest round-trip, refusal of corrupted, missing, newer or inconsistent bundles."""

import json
import os
import shutil

import pytest

from specdec import SpeculativeDecoder
from specdec.runtime.manifest import BundleError, Manifest


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
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
    from specdec.runtime.onnx_paths import external_data_locations

    assert external_data_locations((tiny_bundle / "target" / "model.onnx").read_bytes()) == {"model.onnx.data"}
