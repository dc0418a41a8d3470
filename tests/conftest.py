"""Shared fixtures: tiny random-weight models and bundles, built once per test session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# keep the verified-hash cache and joined model files of test runs out of the user's cache
os.environ.setdefault("SPECDEC_CACHE", tempfile.mkdtemp(prefix="specdec-test-cache-"))

from tiny_models import build_tiny_model, build_noisy_copy  # noqa: E402


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


# ----------------------------------------------------------------------------- the fast loop
# Anything that exports a model, builds tiny torch models, starts a server, a subprocess or Ray is an
# integration test, marked here automatically: by the fixtures it uses (every exporting fixture is one
# of these) and by what its body calls. ``python -m pytest -m "not integration"`` is the fast loop.
INTEGRATION_FIXTURES = {"tiny_pair_dirs", "tiny_bundle", "tiny_standard_bundle", "tiny_decoder", "chat_bundle",
                        "long_decoder_bundle_free_runner", "bundle_per_form", "real_pair"}
INTEGRATION_CALLS = ("export_bundle", "build_tiny_model", "subprocess.", "run_cli(", "specdec-export", "ray.",
                     "uvicorn", "prune_bundle", "export_model")


def _calls_integration(function) -> bool:
    import inspect

    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(call in source for call in INTEGRATION_CALLS)


def _is_integration(item) -> bool:
    """The test's body, or any fixture it uses (transitively), exports, spawns or serves."""
    if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())) or _calls_integration(item.function):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for definitions in (info.name2fixturedefs.values() if info else ()):
        if any(_calls_integration(definition.func) for definition in definitions):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow = item.get_closest_marker("slow") or item.get_closest_marker("gpu")  # so `-m "not integration"` skips them too
        if slow or _is_integration(item):
            item.add_marker(pytest.mark.integration)
