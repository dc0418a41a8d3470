"""The house: each package imports only the packages below it, and nothing imports the root package.

For each package, a fresh interpreter imports every module of it behind an import hook that refuses
any ``specdec`` package above that layer (the root ``specdec/__init__.py``, the public API on top of
everything, is replaced by a bare stub). An upward import fails the test by name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import specdec

SRC = Path(specdec.__file__).parent
# lowest first; a package may import itself and the packages its entry names
LAYERS = {
    "contract": set(),
    "sampling": set(),  # pure numpy
    "runners": {"contract"},
    "decoding": {"contract", "sampling", "runners"},
    "export": {"contract", "sampling", "runners"},
    "serving": {"contract", "sampling", "runners", "decoding"},
    "bench": {"contract", "sampling", "runners", "decoding"},
    "cli": {"contract", "sampling", "runners", "decoding", "export", "serving", "bench"},
}
OPTIONAL = ("fastapi", "ray", "tensorrt", "cuda", "torch", "transformers", "jinja2", "matplotlib", "onnxruntime_genai",
            "llguidance")

CHECK = r'''
import importlib, importlib.abc, pkgutil, sys, types
root, package, allowed = sys.argv[1], sys.argv[2], set(sys.argv[3].split(",")) | {sys.argv[2]}
stub = types.ModuleType("specdec"); stub.__path__ = [root]; sys.modules["specdec"] = stub
class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if parts[0] == "specdec" and len(parts) > 1 and parts[1] not in allowed:
            raise ImportError(f"UPWARD {name}")
sys.meta_path.insert(0, Guard())
modules = [f"specdec.{package}"] + [f"specdec.{package}.{m.name}" for m in pkgutil.walk_packages([f"{root}/{package}"])]
for module in modules:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if "UPWARD" in str(exc) or not any(f"No module named '{o}" in str(exc) for o in sys.argv[4].split(",")):
            print(f"{module}: {exc}")
'''


def upward_imports(package: str) -> list[str]:
    allowed = ",".join(sorted(LAYERS[package])) or "-"
    result = subprocess.run([sys.executable, "-c", CHECK, str(SRC), package, allowed, ",".join(OPTIONAL)],
                            capture_output=True, text=True)
    return result.stdout.splitlines() + ([result.stderr.strip()] if result.returncode else [])


@pytest.mark.parametrize("package", list(LAYERS))
def test_each_package_imports_only_lower_layers(package):
    assert upward_imports(package) == []


def test_the_check_catches_an_upward_import():
    """Planted: a contract module that imports the decoder must be reported."""
    planted = SRC / "contract" / "_planted_upward.py"
    planted.write_text("import specdec.decoding.decoder\n")
    try:
        found = upward_imports("contract")
    finally:
        planted.unlink()
    assert any("_planted_upward" in line and "UPWARD specdec.decoding" in line for line in found), found


def test_every_package_has_a_layer_and_nothing_imports_the_root_package():
    packages = {path.parent.name for path in SRC.glob("*/__init__.py")}
    assert packages == set(LAYERS)
    offenders = [str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if path != SRC / "__init__.py"
                 for line in path.read_text().splitlines() if line.strip().startswith(("from specdec import",))
                 or line.strip() == "import specdec"]
    assert not offenders, offenders
