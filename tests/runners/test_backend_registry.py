"""A backend is one module: a new file in ``runners/backends`` that defines ``BACKEND`` is a ``--provider`` choice
of the CLI and of ``SpeculativeDecoder.load``, with its own onnxruntime providers, memory and graph forms, with
nothing else edited. Shown with a module written to a temporary folder added to the package's search path."""

from __future__ import annotations

import pytest
from package_extension import package_with

import specdec.runners.backends as backends
from specdec.contract.manifest import BundleError

MODULE = '''
from specdec.runners.backends import Backend

BACKEND = Backend("cpu-copy", "onnxruntime's CPU provider under another name (a test backend)",
                  providers=("CPUExecutionProvider",), fused_form=True, rank=90)
'''
BUNDLE_MODULE = '''
from specdec.runners.backends import Backend

CALLS = []


def copy_runners(root, manifest, max_context):
    """Every model of the bundle on onnxruntime's CPU runners, built here (as TensorRT's engines are)."""
    from specdec.contract.limits import MAX_DRAFT_TOKENS, PREFILL_CHUNK
    from specdec.runners.factory import make_runner

    CALLS.append(max_context)
    step = max(PREFILL_CHUNK, MAX_DRAFT_TOKENS + 2)
    return {role: make_runner(str(root / spec.onnx_file), spec, "cpu", max_context, step)
            for role, spec in manifest.models().items()}


BACKEND = Backend("whole-bundle", "a backend that builds every runner itself (a test backend)",
                  bundle_runners="whole_bundle:copy_runners", rank=91)
'''


@pytest.fixture
def with_new_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # bundle_runners names "whole_bundle:copy_runners"
    with package_with(monkeypatch, backends, backends.backends, tmp_path,
                      {"cpu_copy.py": MODULE, "whole_bundle.py": BUNDLE_MODULE}):
        yield


def test_the_four_backends_are_found_in_rank_order():
    backends.backends.cache_clear()
    assert backends.backend_names() == ("cpu", "cuda", "tensorrt", "tensorrt-native")
    assert [name for name, entry in backends.backends().items() if entry.fused_form] == ["cpu"]
    assert [name for name, entry in backends.backends().items() if entry.device_memory] == [
        "cuda", "tensorrt", "tensorrt-native"]


def test_a_new_module_is_a_provider_choice(with_new_modules):
    from specdec.cli.main import build_parser
    from specdec.runners.standard import providers_for

    assert backends.backend_names()[-2:] == ("cpu-copy", "whole-bundle")
    args = build_parser().parse_args(["generate", "BUNDLE", "x", "--provider", "cpu-copy"])
    assert args.provider == "cpu-copy"
    assert providers_for("cpu-copy") == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="whole-bundle builds its own runners"):
        providers_for("whole-bundle")


def test_without_the_module_the_name_is_a_one_line_error(capsys):
    from specdec.cli.main import build_parser
    from specdec.runners.standard import providers_for

    backends.backends.cache_clear()
    with pytest.raises(ValueError, match=r"provider 'cpu-copy' is not one of cpu, cuda, tensorrt, tensorrt-native$"):
        providers_for("cpu-copy")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "BUNDLE", "x", "--provider", "cpu-copy"])
    assert "--provider: invalid choice: 'cpu-copy'" in capsys.readouterr().err


def test_the_fused_form_runs_only_where_its_backend_says(tiny_bundle, with_new_modules, monkeypatch):
    import onnxruntime
    from specdec.contract.manifest import Manifest
    from specdec.runners.factory import runner_class

    spec = Manifest.read(tiny_bundle).target
    assert spec.graph == "fused"
    runner_class(spec)(str(tiny_bundle / spec.onnx_file), spec, "cpu-copy", 64, 8)
    with pytest.raises(ValueError, match="provider cuda requested but onnxruntime has no CUDAExecutionProvider"):
        runner_class(spec)(str(tiny_bundle / spec.onnx_file), spec, "cuda", 64, 8)  # the missing package first
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(BundleError, match="runs on provider cpu, cpu-copy only: export the bundle with --graph "
                                          "standard for provider cuda"):
        runner_class(spec)(str(tiny_bundle / spec.onnx_file), spec, "cuda", 64, 8)


def test_new_backends_load_and_keep_the_output(tiny_bundle, with_new_modules):
    import whole_bundle

    from specdec import SpeculativeDecoder

    prompt = "def add(a, b):"
    expected = SpeculativeDecoder.load(tiny_bundle, max_context=128).generate(
        prompt, max_new_tokens=16, num_draft_tokens=0).token_ids
    for provider in ("cpu-copy", "whole-bundle"):
        dec = SpeculativeDecoder.load(tiny_bundle, provider=provider, max_context=128)
        for draft_tokens in (0, 3):
            assert dec.generate(prompt, max_new_tokens=16, num_draft_tokens=draft_tokens).token_ids == expected
    assert whole_bundle.CALLS == [128]
