"""Bad export input gets one clear line; a failed export never damages an existing bundle."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from specdec.export import bundle as bundle_module  # noqa: E402
from specdec.export.bundle import ExportOptions, export_bundle  # noqa: E402
from specdec.export.compat import IncompatiblePair  # noqa: E402
from specdec.export.sources import SourceError, resolve_source  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec.export.cli", *map(str, args)], capture_output=True, text=True)


def test_missing_folder_is_one_clear_line(tmp_path):
    proc = run_cli("--target", tmp_path / "missing", "--out", tmp_path / "b")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported architecture 'bert'.*llama.*qwen2"):
        resolve_source(tmp_path)


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(SourceError, match="pickled"):
        resolve_source(tmp_path)
    with pytest.raises(SourceError, match="pickled"):
        resolve_source(tmp_path / "pytorch_model.bin")


def test_mismatched_tokenizers_are_refused_naming_the_difference(tiny_pair_dirs, tmp_path):
    from tokenizers import Tokenizer

    target, _ = tiny_pair_dirs
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=1, num_layers=1)
    tok = Tokenizer.from_file(str(draft / "tokenizer.json"))
    vocab = tok.get_vocab()
    data = json.loads(tok.to_str())
    data["model"]["vocab"] = {("Z" if k == "A" else "A" if k == "Z" else k): v for k, v in vocab.items()}
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(IncompatiblePair, match="tokenizers differ at tokenizer.model.vocab"):
        export_bundle(ExportOptions(target=str(target), draft=str(draft), out=tmp_path / "out"), progress=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_mismatched_special_tokens_are_refused(tiny_pair_dirs, tmp_path):
    target, _ = tiny_pair_dirs
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=1, num_layers=1)
    config = json.loads((draft / "config.json").read_text())
    config["eos_token_id"] = 5
    (draft / "config.json").write_text(json.dumps(config))
    gen = draft / "generation_config.json"
    if gen.exists():
        gen.unlink()
    with pytest.raises(IncompatiblePair, match="special tokens differ: eos_token_ids"):
        export_bundle(ExportOptions(target=str(target), draft=str(draft), out=tmp_path / "out"), progress=lambda m: None)


def test_non_bundle_destination_is_not_replaced(tiny_pair_dirs, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SourceError, match="not a specdec bundle"):
        export_bundle(ExportOptions(target=str(tiny_pair_dirs[0]), draft=None, out=out), progress=lambda m: None)
    assert (out / "notes.txt").read_text() == "mine"


def test_failed_export_leaves_existing_bundle_intact(tiny_bundle, tiny_pair_dirs, tmp_path, monkeypatch):
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def fail_midway(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(bundle_module, "hash_tree", fail_midway)
    with pytest.raises(OSError, match="simulated"):
        export_bundle(ExportOptions(target=str(tiny_pair_dirs[0]), draft=None, out=out, parity=False),
                      progress=lambda m: None)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # no staging folder left behind


def test_killed_export_leaves_existing_bundle_intact(tiny_bundle, tiny_pair_dirs, tmp_path):
    """SIGKILL in the middle of writing: the old bundle stays whole and loadable, no half bundle appears."""
    import shutil
    import signal
    import time

    from specdec import SpeculativeDecoder

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    proc = subprocess.Popen([sys.executable, "-m", "specdec.export.cli", "--target", str(tiny_pair_dirs[0]),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(tmp_path.glob(".bundle.partial-*/target/model.onnx*")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    SpeculativeDecoder.load(out)  # verifies every sha256
    assert not (tmp_path / "bundle.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".bundle.partial-")) == ["bundle"]
