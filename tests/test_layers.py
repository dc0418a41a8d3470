"""The house: each package imports only the packages below it, and nothing imports the root package.

Every module's source is read with ``ast``: every ``import`` and ``from ... import`` at any depth (inside
functions, methods, ``if`` blocks and ``try`` blocks too), relative imports resolved, and
``importlib.import_module("specdec....")`` calls with a constant name. An upward import fails the test by
module and line.
"""

from __future__ import annotations

import ast
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


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = SRC) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module_name(path, root) if path.name == "__init__.py" else module_name(path, root).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names if name == "specdec"]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def upward_imports(package: str, root: Path = SRC) -> list[str]:
    allowed = LAYERS[package] | {package}
    offenders = []
    for path in sorted((root / package).rglob("*.py")):
        for line, name in imported_names(path, root):
            parts = name.split(".")
            if parts[0] != "specdec":
                continue
            if len(parts) == 1 or parts[1] not in allowed:
                offenders.append(f"{path.relative_to(root)}:{line}: imports {name}")
    return offenders


@pytest.mark.parametrize("package", list(LAYERS))
def test_each_package_imports_only_lower_layers(package):
    assert upward_imports(package) == []


def test_the_check_catches_upward_imports_at_any_depth(tmp_path):
    """Planted: a contract module importing the decoder inside a function, a relative import that climbs to
    serving, a root-package import, and an import_module call must each be reported; a same-layer import not."""
    root = tmp_path / "specdec"
    (root / "contract").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "contract" / "__init__.py").write_text("")
    (root / "contract" / "planted.py").write_text(
        "import numpy\nfrom specdec.contract import limits\n\n"
        "def f():\n    if True:\n        from specdec.decoding.decoder import SpeculativeDecoder\n\n"
        "class C:\n    def m(self):\n        from ..serving import app\n\n"
        "from specdec import SpeculativeDecoder\n"
        "import importlib\nimportlib.import_module('specdec.bench.bench')\n")
    found = upward_imports("contract", root)
    assert sorted(line.split(": imports ")[1] for line in found) == sorted([
        "specdec.decoding.decoder", "specdec.serving", "specdec", "specdec.SpeculativeDecoder", "specdec.bench.bench"])


def test_every_package_has_a_layer_and_nothing_imports_the_root_package():
    packages = {path.parent.name for path in SRC.glob("*/__init__.py")}
    assert packages == set(LAYERS)
    offenders = [f"{path.relative_to(SRC)}:{line}" for path in SRC.rglob("*.py") if path != SRC / "__init__.py"
                 for line, name in imported_names(path) if name == "specdec" or name.startswith("specdec.") and
                 name.split(".")[1] not in LAYERS and not (SRC / name.split(".")[1]).with_suffix(".py").exists()]
    assert not offenders, offenders


def import_graph(root: Path = SRC) -> dict:
    """module -> the specdec modules it imports (at any depth; ``from package import name`` counts as the
    package unless ``package.name`` is a module)."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        found = set()
        for _, name in imported_names(path, root):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
        graph[module] = found
    return graph


def import_cycles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_module_imports_one_that_imports_it_back():
    """No import circle, not even one hidden behind an import inside a function (such a pair is one module split
    in two, or a shared piece that belongs lower)."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_finds_a_hidden_circle(tmp_path):
    """Planted: a module importing its importer inside a function."""
    package = tmp_path / "specdec" / "runners"
    package.mkdir(parents=True)
    (tmp_path / "specdec" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "fused.py").write_text("def make():\n    from specdec.runners.folded import Folded\n")
    (package / "folded.py").write_text("from specdec.runners.fused import make\n")
    (package / "other.py").write_text("from specdec.runners import fused\n")
    cycles = import_cycles(import_graph(tmp_path / "specdec"))
    assert cycles == [["specdec.runners.folded", "specdec.runners.fused"]]
