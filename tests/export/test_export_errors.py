"""Bad export input gets one clear line; a failed export never damages an existing bundle."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from specdec.export import bundle as bundle_module  # noqa: E402
from specdec.export.bundle import ExportOptions, export_bundle  # noqa: E402
from specdec.export.compat import IncompatiblePair  # noqa: E402
from specdec.export.destination import check_destination, remove_dead_staging  # noqa: E402
from specdec.export.sources import SourceError, resolve_source  # noqa: E402
from specdec.export.worker import ExportError, run_isolated  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec.export.cli", *map(str, args)], capture_output=True, text=True)


@pytest.mark.integration
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
    with pytest.raises(IncompatiblePair, match=f"tokenizers differ: token id {vocab['A']}: 'A' in the target, 'Z' in"):
        export_bundle(ExportOptions(target=str(target), draft=str(draft), out=tmp_path / "out"), progress=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_a_draft_with_other_special_tokens_takes_the_targets(tiny_pair_dirs, tmp_path):
    """A Hugging Face folder lists two end tokens where a GGUF of its family records one: the pair is exported, the
    bundle uses the target's special ids for both models (what ends target-only decoding), and says so."""
    target, _ = tiny_pair_dirs
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=1, num_layers=1)
    config = json.loads((draft / "config.json").read_text())
    config["eos_token_id"] = 5
    (draft / "config.json").write_text(json.dumps(config))
    gen = draft / "generation_config.json"
    if gen.exists():
        gen.unlink()
    notes = []
    manifest = export_bundle(ExportOptions(target=str(target), draft=str(draft), out=tmp_path / "out", parity=False),
                             progress=notes.append)
    assert manifest.draft.eos_token_ids == manifest.target.eos_token_ids
    assert any("eos_token_ids" in note and "uses the target's" in note for note in notes)


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
    with pytest.raises(ExportError, match="simulated"):
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
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(tmp_path.glob(".bundle.partial-*/target/model.onnx*")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    SpeculativeDecoder.load(out)  # verifies every sha256
    assert not (tmp_path / "bundle.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".bundle.partial-")) == ["bundle"]
    # the next export to the same place removes what the killed one left (its process is gone)
    _wait_for_group_exit(proc.pid)
    remove_dead_staging(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def _wait_for_group_exit(pgid, seconds=20):
    """Until no process of the export's session (parent and worker) is left."""
    import os
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of group {pgid} still run {seconds} s after the export ended")


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- --out: never delete what the export did not write

def test_user_project_holding_a_manifest_json_is_refused_and_untouched(tiny_pair_dirs, tmp_path):
    webapp = tmp_path / "webapp"
    (webapp / "src").mkdir(parents=True)
    (webapp / "manifest.json").write_text('{"name": "webapp", "short_name": "w"}')
    (webapp / "src" / "app.js").write_text("console.log(1)")
    (webapp / "README.md").write_text("mine")
    before = _files(webapp)
    proc = run_cli("--target", tiny_pair_dirs[0], "--out", webapp)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"--out {webapp} is a non-empty folder that is not a specdec bundle" in proc.stderr
    assert _files(webapp) == before and sorted(p.name for p in tmp_path.iterdir()) == ["webapp"]


def test_bundle_holding_a_user_file_is_refused_and_untouched(tiny_bundle, tiny_pair_dirs, tmp_path):
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    (out / "target" / "notes.txt").write_text("mine")
    before = _files(out)
    with pytest.raises(SourceError, match="holds target/notes.txt, which is not part of the specdec bundle"):
        export_bundle(ExportOptions(target=str(tiny_pair_dirs[0]), draft=None, out=out), progress=lambda m: None)
    assert _files(out) == before


def test_what_may_be_replaced(tiny_bundle, tmp_path):
    """A bundle (plus a killed process's .NAME.partial-PID file) or an empty folder may be replaced; a file,
    a symlink or a bundle with an extra empty folder may not."""
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    (out / ".manifest.json.partial-123").write_text("{")
    check_destination(out)
    check_destination(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_destination(tmp_path / "empty")
    (out / "mine").mkdir()
    with pytest.raises(SourceError, match="holds mine, which is not part"):
        check_destination(out)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SourceError, match="exists and is not a folder"):
        check_destination(tmp_path / "file")
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(SourceError, match="is a symbolic link"):
        check_destination(tmp_path / "link")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])  # a process that has exited: its pid is dead
    proc.wait()
    return proc.pid


def test_staging_of_dead_exports_is_removed_and_of_live_ones_kept(tmp_path):
    import os

    out = tmp_path / "bundle"
    out.mkdir()
    dead, live = tmp_path / f".bundle.partial-{_dead_pid()}", tmp_path / f".bundle.partial-{os.getppid()}"
    other = tmp_path / f".other.partial-{_dead_pid()}"  # another destination's: not ours to judge
    for folder in (dead, live, other):
        (folder / "target").mkdir(parents=True)
        (folder / "target" / "model.onnx.data").write_bytes(b"x" * 1000)
    remove_dead_staging(out)
    assert not dead.exists() and live.exists() and other.exists() and out.exists()


def test_old_bundle_moved_aside_by_a_dead_export_is_restored(tmp_path):
    out = tmp_path / "bundle"
    old = tmp_path / f".bundle.old-{_dead_pid()}"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    remove_dead_staging(out)
    assert (out / "manifest.json").read_text() == "{}" and not old.exists()


def _default_sigint():
    """As from a terminal: a test run started in the background (SIGINT ignored, inherited) must not make the
    exporter ignore Ctrl-C too."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signal_name, code, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_sigint_and_sigterm_are_one_line_and_clean_up(tiny_bundle, tiny_pair_dirs, tmp_path, signal_name, code, word):
    """Ctrl-C (to the whole process group, as a terminal sends it) or SIGTERM (to the exporter only) while the
    worker exports: one line, exit 130/143, staging removed, no process left, the old bundle intact."""
    import os
    import shutil
    import signal
    import time

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    before = _files(out)
    proc = subprocess.Popen([sys.executable, "-m", "specdec.export.cli", "--target", str(tiny_pair_dirs[0]),
                             "--out", str(out), "--no-parity"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(tmp_path.glob(".bundle.partial-*")):
        time.sleep(0.05)
    time.sleep(2)  # the worker process is starting (importing torch)
    number = getattr(signal, signal_name)
    os.killpg(proc.pid, number) if number == signal.SIGINT else proc.send_signal(number)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("specdec-export")]
    assert proc.returncode == code and lines == [f"specdec-export: {word} ({signal_name}): the unfinished export "
                                                 "was removed, --out is as it was"], err
    assert "Traceback" not in err and "leaked" not in err, err
    _wait_for_group_exit(proc.pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"] and _files(out) == before


# ---------------------------------------------------------------- every export failure: one line, exit 2

def _copy_model(source, folder):
    import shutil

    shutil.copytree(source, folder)
    return folder


def test_truncated_safetensors_is_one_line(tiny_pair_dirs, tmp_path):
    import os

    model = _copy_model(tiny_pair_dirs[0], tmp_path / "model")
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    proc = run_cli("--target", model, "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{weights} is" in proc.stderr and "truncated or corrupt" in proc.stderr
    (weights).write_bytes(b"\xff" * 16)
    with pytest.raises(SourceError, match="not a readable safetensors file"):
        resolve_source(model)


def test_worker_failures_come_back_as_one_line():
    """An exception in the worker process, or its death, is one ExportError line (traceback kept in .detail)."""
    import operator
    import os

    with pytest.raises(ExportError, match="^export: export failed: ZeroDivisionError: division by zero$") as caught:
        run_isolated(operator.truediv, 1, 0)
    assert "Traceback" in caught.value.detail
    with pytest.raises(ExportError, match=r"worker process died \(exit code 3\)"):
        run_isolated(os._exit, 3)


def _draw_a_progress_bar() -> int:
    from tqdm.auto import tqdm

    for _ in tqdm(range(3), desc="third-party bar"):  # as transformers' GGUF loader draws one, with no switch
        pass
    return 7


def test_export_workers_draw_no_third_party_progress_bars(capfd, monkeypatch):
    """A planted bug (the worker's TQDM_DISABLE taken out) makes the bar appear."""
    pytest.importorskip("tqdm")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert run_isolated(_draw_a_progress_bar) == 7
    assert "third-party bar" not in capfd.readouterr().err


def test_vocabulary_mismatch_is_found_before_any_export(tiny_pair_dirs, tmp_path):
    draft = _copy_model(tiny_pair_dirs[1], tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] = 100  # fewer rows than the tokenizer has tokens: ids 100..127 have no logits
    (draft / "config.json").write_text(json.dumps(config))
    messages = []
    with pytest.raises(IncompatiblePair, match=r"vocabularies differ: the target scores 128 tokens \(vocab_size 128\), "
                                                r"the draft 100"):
        export_bundle(ExportOptions(target=str(tiny_pair_dirs[0]), draft=str(draft), out=tmp_path / "out"),
                      progress=messages.append)
    assert messages == ["loading tokenizers"]  # no model was loaded or exported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_tokenizer_encoding_the_parity_text_to_nothing_is_one_line(tiny_pair_dirs, tmp_path):
    model = _copy_model(tiny_pair_dirs[0], tmp_path / "model")
    data = json.loads((model / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Replace", "pattern": {"Regex": "[\\s\\S]"}, "content": ""}  # deletes all text
    (model / "tokenizer.json").write_text(json.dumps(data))
    messages = []
    with pytest.raises(ExportError, match="the target tokenizer encodes the parity text .* to no token ids"):
        export_bundle(ExportOptions(target=str(model), draft=None, out=tmp_path / "out"), progress=messages.append)
    assert messages == ["loading tokenizers"]


def test_full_disk_is_one_line_naming_the_path(tiny_pair_dirs, tmp_path):
    """Simulated with a file size limit (RLIMIT_FSIZE: writes fail with EFBIG, as numpy reports a full disk:
    no path in its message); the export's own message names the folder and the free space."""
    import resource
    import signal

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "specdec.export.cli", "--target", str(tiny_pair_dirs[0]),
                           "--out", str(out), "--no-parity"], capture_output=True, text=True,
                          preexec_fn=limit_file_size)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specdec-export")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"writing the export under {tmp_path}/.out.partial-" in lines[0] and "MB free there" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_carrying_gguf_blocks_from_a_folder_source_is_one_line_before_any_export(tiny_pair_dirs, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("--target", tiny_pair_dirs[0], "--out", out, "--quant", "int4", "--quant-method", "gguf")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--quant-method gguf carries a GGUF's blocks over" in proc.stderr and "not a .gguf file" in proc.stderr
    assert not out.exists()
