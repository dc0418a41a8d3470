"""Dependencies say what is used: every third-party module the server's code imports is in the extras that install
it, the example's clients are in an extra, the bench's plot is optional, and a GPU provider missing because the
CPU onnxruntime wheel shadows onnxruntime-gpu is reported as that."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from test_layers import SRC, imported_names

ROOT = SRC.parent.parent
# modules whose distribution has another name; pydantic_core is pydantic's own core, installed and pinned by it
DISTRIBUTION = {"pydantic_core": "pydantic", "yaml": "pyyaml"}


def extras() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def distributions(requirements: list) -> set:
    return {re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def third_party(paths) -> set:
    """Distributions of the top-level modules ``paths`` import that are neither the standard library nor specdec."""
    found = set()
    for path in paths:
        for _, name in imported_names(path, SRC if SRC in path.parents else path.parent):
            top = name.split(".")[0]
            if top and top != "specdec" and top not in sys.stdlib_module_names and top != "__future__":
                found.add(DISTRIBUTION.get(top, top).lower())
    return found


def undeclared(paths, requirements: list) -> set:
    return third_party(paths) - distributions(requirements)


SERVING = sorted((SRC / "serving").rglob("*.py"))


def test_the_server_extras_declare_what_the_server_imports():
    declared = extras()
    local = [path for path in SERVING if path.name != "ray_serve.py"]
    assert undeclared(local, declared["serve"]) == set()
    assert undeclared(SERVING, declared["ray"]) == set()
    assert "starlette" in third_party([SRC / "serving" / "app.py"])  # app.py imports it itself


def test_a_missing_declaration_is_found():
    """Planted failure: the serve extra as it was (no starlette) is reported."""
    before = [r for r in extras()["serve"] if not r.startswith("starlette")]
    assert undeclared([path for path in SERVING if path.name != "ray_serve.py"], before) == {"starlette"}


def test_the_examples_extra_covers_the_agent_example():
    declared = extras()
    assert undeclared([ROOT / "examples" / "agent_tools.py"], declared["serve"] + declared["examples"]) == set()
    assert {"openai", "httpx"} <= third_party([ROOT / "examples" / "agent_tools.py"])
    assert "specdec[serve,examples]" in (ROOT / "examples" / "agent_tools.py").read_text().replace('".[', "specdec[")


def test_the_bench_plot_is_optional(monkeypatch, tmp_path):
    """Without matplotlib the plot says how to get it (the CLI prints that as one line and writes the tables)."""
    from specdec.bench.bench import plot

    assert "matplotlib" in distributions(extras()["bench"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"matplotlib is not installed \(pip install 'specdec\[bench\]'\)"):
        plot({"summary": []}, tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("installed, provider, expected", [
    ({"onnxruntime", "onnxruntime-gpu"}, "cuda",
     "both onnxruntime (the CPU wheel) and onnxruntime-gpu are installed and the CPU wheel's files shadow the GPU "
     "one's: pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"),
    ({"onnxruntime", "onnxruntime-gpu"}, "tensorrt", "both onnxruntime (the CPU wheel) and onnxruntime-gpu"),
    ({"onnxruntime"}, "cuda", "install onnxruntime-gpu"),
    ({"onnxruntime"}, "tensorrt", "install onnxruntime-gpu (and TensorRT)"),
])
def test_a_shadowed_gpu_wheel_is_named(monkeypatch, installed, provider, expected):
    import importlib.metadata

    import onnxruntime

    from specdec.runners.standard import providers_for

    def version(name):
        if name in installed:
            return "1.20.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    wanted = "CUDAExecutionProvider" if provider == "cuda" else "TensorrtExecutionProvider"
    with pytest.raises(ValueError) as info:
        providers_for(provider)
    message = str(info.value)
    assert message.startswith(f"provider {provider} requested but onnxruntime has no {wanted}: ")
    assert expected in message and "\n" not in message
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [wanted, "CPUExecutionProvider"])
    assert providers_for(provider)[0][0] == wanted  # present: no complaint, whatever is installed
