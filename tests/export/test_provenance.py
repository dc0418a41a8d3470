"""Provenance: the manifest records the GGUF files a bundle was exported from (optional: older manifests load),
and ``specdec bench --peer-llama-server`` takes them from there, checking their sha256; problems are one line."""

import hashlib
import json
from dataclasses import replace

import pytest

from specdec.bench import llama_server as ls
from specdec.cli.main import main
from specdec.contract.manifest import BundleError, Manifest, ModelSpec, SourceFile, graph_io, kv_names


def _spec(role):
    inputs, outputs = graph_io(2, 2, 8, 16, "float32", False)
    return ModelSpec(role=role, architecture="llama", onnx_file=f"{role}/model.onnx", inputs=inputs, outputs=outputs,
                     kv=kv_names(2), num_layers=2, num_kv_heads=2, head_dim=8, hidden_size=16, vocab_size=16,
                     max_positions=64, kv_dtype="float32", dtype="float32", quant="none", sliding_window=None,
                     bos_token_id=None, eos_token_ids=(1,), pad_token_id=None)


def _gguf(path, payload=b"weights"):
    path.write_bytes(b"GGUF" + payload)
    return SourceFile(path=str(path), file_name=path.name, size=path.stat().st_size,
                      sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def _bundle(folder, sources):
    folder.mkdir(exist_ok=True)
    manifest = Manifest(format_version=1, target=_spec("target"), draft=_spec("draft"),
                        tokenizer_file="tokenizer/tokenizer.json", sources=sources)
    (folder / "manifest.json").write_text(manifest.to_json())
    return folder


def test_sources_round_trip_and_older_manifests_without_them_load(tmp_path):
    target = _gguf(tmp_path / "t.gguf")
    manifest = Manifest.read(_bundle(tmp_path / "b", {"target": target}))
    assert manifest.sources == {"target": target}
    data = json.loads(manifest.to_json())
    assert data["sources"]["target"] == {"path": target.path, "file_name": "t.gguf", "size": 11,
                                         "sha256": target.sha256}
    del data["sources"]  # a bundle written before the field
    assert Manifest.from_json(json.dumps(data)).sources == {}


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["target"].update(sha256="abc"), r'sources\["target"\].sha256 must be a sha256'),
    (lambda s: s["target"].update(size=-1), r'sources\["target"\].size must be an integer >= 0'),
    (lambda s: s["target"].update(url="x"), "unknown fields"),
    (lambda s: s["target"].pop("file_name"), "file_name is missing"),
    (lambda s: s.update(vision=dict(s["target"])), "sources key must be one of"),
])
def test_a_malformed_source_record_is_one_line_naming_the_field(tmp_path, edit, message):
    data = json.loads((_bundle(tmp_path / "b", {"target": _gguf(tmp_path / "t.gguf")}) / "manifest.json").read_text())
    edit(data["sources"])
    with pytest.raises(BundleError, match=message) as info:
        Manifest.from_json(json.dumps(data))
    assert "\n" not in str(info.value)


def test_a_source_for_a_model_the_bundle_lacks_is_refused(tmp_path):
    manifest = Manifest.read(_bundle(tmp_path / "b", {}))
    with pytest.raises(BundleError, match="sources names 'draft'"):
        replace(manifest, draft=None, sources={"draft": _gguf(tmp_path / "d.gguf")})


def test_bench_takes_the_manifests_ggufs_and_checks_their_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target, draft = _gguf(tmp_path / "t.gguf"), _gguf(tmp_path / "d.gguf", b"draft")
    bundle = _bundle(tmp_path / "b", {"target": target, "draft": draft})
    assert ls.resolve_ggufs(str(bundle), None) == (target.path, draft.path)
    assert ls.resolve_ggufs(str(bundle), [str(tmp_path / "d.gguf")]) == (draft.path, None)  # --peer-gguf wins
    (tmp_path / "d.gguf").write_bytes(b"GGUF changed")
    with pytest.raises(ValueError, match=r"d.gguf has sha256 \w+\.\.\., not the \w+\.\.\. the draft was exported"):
        ls.resolve_ggufs(str(bundle), None)
    (tmp_path / "d.gguf").unlink()
    with pytest.raises(ValueError, match="the draft GGUF the bundle was exported from, .* is not there"):
        ls.resolve_ggufs(str(bundle), None)
    assert ls.resolve_ggufs(str(_bundle(tmp_path / "t-only", {"target": target})), None) == (target.path, None)
    with pytest.raises(ValueError, match="manifest records none"):
        ls.resolve_ggufs(str(_bundle(tmp_path / "none", {})), None)


@pytest.mark.parametrize("which", ["binary", "gguf", "changed"])
def test_bench_with_the_manifests_ggufs_fails_in_one_line(tmp_path, capsys, monkeypatch, which):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    bundle = _bundle(tmp_path / "b", {"target": _gguf(tmp_path / "t.gguf")})
    if which == "binary":
        binary.unlink()
    elif which == "gguf":
        (tmp_path / "t.gguf").unlink()
    else:
        (tmp_path / "t.gguf").write_bytes(b"GGUF other weights")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"id": "a", "prompt": "def f():"}]))
    code = main(["bench", str(bundle), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                 "--peer-llama-server", str(binary)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert {"binary": "is not an executable file", "gguf": "is not there", "changed": "has sha256"}[which] in err
    assert not (tmp_path / "out").exists()


def test_the_exporter_records_a_gguf_source_and_not_a_folder(tmp_path, monkeypatch):
    from specdec.export.bundle import source_file
    from specdec.export.sources import ModelSource

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    expected = _gguf(tmp_path / "m.gguf", b"x" * 100)
    record = source_file("m.gguf", ModelSource(tmp_path, "m.gguf"))
    assert record == replace(expected, path="m.gguf")  # the path as given, not resolved
    assert source_file(str(tmp_path), ModelSource(tmp_path, None)) is None


def test_a_bundle_exported_from_a_folder_records_no_sources(tiny_bundle):
    assert Manifest.read(tiny_bundle).sources == {}
