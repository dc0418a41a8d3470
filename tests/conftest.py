"""Shared fixtures: tiny random-weight models and bundles, built once per test session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# the shared helpers (tiny_models, scripted, paths, ...) and every package's folder of tests, whose modules other
# tests import constants and fixtures from (test files are named uniquely across the folders)
_TESTS = Path(__file__).parent
sys.path[:0] = [str(_TESTS)] + sorted(str(folder) for folder in _TESTS.iterdir()
                                      if folder.is_dir() and any(folder.glob("test_*.py")))
# keep the verified-hash cache and joined model files of test runs out of the user's cache; the run's own folder is
# removed when it ends
if "SPECDEC_CACHE" not in os.environ:
    import atexit
    import shutil

    os.environ["SPECDEC_CACHE"] = tempfile.mkdtemp(prefix="specdec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECDEC_CACHE"], True)

# loads leave their memory on 4 KiB pages here: a background move of the whole test process's memory (GiBs of
# torch and fixtures) would run beside unrelated tests, and what they measure (allocations, resident pages) with it;
# tests/runners/test_huge_pages.py switches it on where it is the subject
os.environ["SPECDEC_HUGE_PAGES"] = "0"

from tiny_models import build_tiny_model, build_noisy_copy  # noqa: E402


def _export_in_process(function, *args):
    """``run_isolated`` without the worker process: the tiny models need no memory isolation, and a fresh
    interpreter importing torch per model cost most of the suite's time. Failures come back exactly as the
    worker sends them (one-line ExportError, role-prefixed unless already specdec's). The worker itself
    (death, one-line errors, signals) is tested directly in test_export_errors and through the CLI."""
    import traceback

    from specdec.export.sources import SourceError
    from specdec.export.worker import ExportError, one_line

    try:
        return function(*args)
    except Exception as exc:
        role = next((a for a in args if isinstance(a, str) and a in ("target", "draft")), "export")
        message = one_line(exc)
        if not isinstance(exc, (SourceError, ExportError)):
            message = f"{role}: export failed: {message}"
        raise ExportError(message, traceback.format_exc()) from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the first integration test's fixtures (session-scoped bundles included): exports run in this process
    (see _export_in_process) for the rest of the session. The fast loop never imports the exporter."""
    if item.get_closest_marker("integration") is not None:
        from specdec.export import bundle as bundle_module

        bundle_module.run_isolated = _export_in_process


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target folder, draft folder): a llama target and a draft that is a noisy copy of it."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target = build_tiny_model(root / "target", "llama", seed=0)
    draft = build_noisy_copy(target, root / "draft", noise=0.005, seed=1)
    return target, draft


@pytest.fixture(scope="session")
def tiny_bundle(tiny_pair_dirs, tmp_path_factory):
    pytest.importorskip("torch")
    from specdec.export.bundle import ExportOptions, export_bundle

    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out), progress=lambda msg: None)
    return out


@pytest.fixture(scope="session")
def tiny_standard_bundle(tiny_pair_dirs, tmp_path_factory):
    """The tiny pair in the standard (portable, TensorRT-input) graph form; tiny_bundle is the default fused form."""
    pytest.importorskip("torch")
    from specdec.export.bundle import ExportOptions, export_bundle

    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("bundles") / "tiny-standard"
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, graph="standard"),
                  progress=lambda msg: None)
    return out


@pytest.fixture(scope="session")
def tiny_decoder(tiny_bundle):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder.load(tiny_bundle)


@pytest.fixture
def long_decoder_bundle_free_runner(tiny_standard_bundle):
    """A target ModelRunner with a 2048-slot cache whose onnxruntime run is a no-op (host work only)."""
    from specdec.contract.manifest import Manifest
    from specdec.runners.standard import ModelRunner

    manifest = Manifest.read(tiny_standard_bundle)
    spec = manifest.target
    runner = ModelRunner(str(tiny_standard_bundle / spec.onnx_file), spec, "cpu", 2048, 64)
    runner.session.run_with_iobinding = lambda binding: None
    return runner


class _BundlesPerForm:
    """(architecture, graph form) -> one tiny target-only bundle (seed 0, max 2048 positions, parity checked),
    exported on first use and shared for the session by test_export_architectures (fused parity of every
    architecture), test_tensorrt_ops (standard form: parity and the TensorRT op table) and test_fused_graph
    (both forms side by side) and test_host_overhead."""

    def __init__(self, root: Path):
        self.root = root
        self._models, self._bundles = {}, {}

    def model(self, arch: str) -> Path:
        if arch not in self._models:
            self._models[arch] = build_tiny_model(self.root / f"hf-{arch}", arch, seed=0, max_positions=2048)
        return self._models[arch]

    def __call__(self, arch: str, form: str):
        """(bundle folder, the Manifest export_bundle returned). ``form``: "fused" (the default attention: folded
        where the streamed exporter applies), "gqa" (fused with GroupQueryAttention) or "standard"."""
        from specdec.export.bundle import ExportOptions, export_bundle

        if (arch, form) not in self._bundles:
            out = self.root / f"{arch}-{form}"
            # float32 KV: these bundles are compared with PyTorch and with each other at float32 tolerances
            options = dict(graph="fused", attention="gqa") if form == "gqa" else dict(graph=form, kv_dtype="float32")
            manifest = export_bundle(ExportOptions(target=str(self.model(arch)), draft=None, out=out, **options),
                                     progress=lambda msg: None)
            self._bundles[(arch, form)] = (out, manifest)
        return self._bundles[(arch, form)]


@pytest.fixture(scope="session")
def bundle_per_form(tmp_path_factory):
    pytest.importorskip("torch")
    return _BundlesPerForm(tmp_path_factory.mktemp("per_form"))


@pytest.fixture(scope="session")
def quantized_pair_bundle(tiny_pair_dirs, tmp_path_factory):
    """(quant, dtype) -> (folder, Manifest) of the tiny pair exported weight-only quantized, once per session
    (test_export_architectures decodes them; test_tensorrt_ops checks the int4 QDQ graph's ops)."""
    pytest.importorskip("torch")
    from specdec.export.bundle import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("quantized")
    built = {}

    def get(quant: str, dtype: str):
        if (quant, dtype) not in built:
            target, draft = tiny_pair_dirs
            out = root / f"{quant}-{dtype}"
            manifest = export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, quant=quant,
                                                   dtype=dtype), progress=lambda msg: None)
            built[(quant, dtype)] = (out, manifest)
        return built[(quant, dtype)]

    return get


# A chat template in the style of ChatML, on two filler ids of the tiny vocabulary made special tokens
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<extra_121>{{ message['role'] }}\n{{ message['content'] }}<extra_120>\n{% endfor %}"
    "{% if add_generation_prompt %}<extra_121>assistant\n{% endif %}"
)
TINY_END_OF_TURN = "<extra_120>"


@pytest.fixture(scope="session")
def chat_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle whose tokenizer got a chat template, written by the exporter's save_tokenizer
    (the step export_bundle runs) and re-hashed into the manifest: a second export would cost minutes."""
    pytest.importorskip("transformers")
    import dataclasses
    import shutil

    from transformers import AutoTokenizer

    from specdec.export.bundle import hash_tree, save_tokenizer
    from specdec.contract.manifest import MANIFEST_NAME, Manifest

    out = tmp_path_factory.mktemp("bundles") / "tiny-chat"
    shutil.copytree(tiny_bundle, out)
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_120>", "<extra_121>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    shutil.rmtree(out / "tokenizer")
    assert save_tokenizer(tokenizer, out / "tokenizer")
    manifest = dataclasses.replace(Manifest.read(out), files=hash_tree(out))
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    return out


TINY_FIM = {"prefix": 5, "suffix": 6, "middle": 7}  # three ids of the tiny vocabulary, declared FIM markers


@pytest.fixture(scope="session")
def fim_bundle(chat_bundle, tmp_path_factory):
    """The tiny chat bundle whose manifest declares FIM tokens (as the exporter records them for a code model)."""
    import dataclasses
    import shutil

    from specdec.contract.manifest import MANIFEST_NAME, Manifest

    out = tmp_path_factory.mktemp("bundles") / "tiny-fim"
    shutil.copytree(chat_bundle, out)
    manifest = dataclasses.replace(Manifest.read(out), fim_tokens=dict(TINY_FIM))
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    return out


# ----------------------------------------------------------------------------- the fast loop
# An integration test exports a model, builds tiny torch models, starts a server, a subprocess or Ray. It says so
# itself (``@pytest.mark.integration``, or ``pytestmark`` for a whole module), or uses one of the fixtures below,
# which carry the mark to every test that needs them (directly or through another fixture).
# ``python -m pytest -m "not integration"`` is the fast loop.
INTEGRATION_FIXTURES = {"tiny_pair_dirs", "tiny_bundle", "tiny_standard_bundle", "tiny_decoder", "chat_bundle",
                        "fim_bundle", "long_decoder_bundle_free_runner", "bundle_per_form", "quantized_pair_bundle", "real_pair"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow = item.get_closest_marker("slow") or item.get_closest_marker("gpu")  # so `-m "not integration"` skips them too
        if slow or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_interpreter(request, monkeypatch):
    """A test not marked integration may not start a Python interpreter or a server (a `specdec` command, a
    llama.cpp binary): the fast loop stays fast, and a test that needs one is told to say so (mark it, or use an
    integration fixture). Quick tools (git) stay allowed."""
    if request.node.get_closest_marker("integration") is not None:
        return
    import subprocess

    popen = subprocess.Popen

    class Guarded(popen):
        def __init__(self, args, *rest, **kwargs):
            program = str(args[0] if isinstance(args, (list, tuple)) else str(args).split()[0])
            if program == sys.executable or "python" in Path(program).name or "specdec" in program or \
                    "llama-" in Path(program).name:
                raise RuntimeError(f"{request.node.nodeid} starts {Path(program).name} but is not marked "
                                   "integration: add @pytest.mark.integration")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Guarded)
