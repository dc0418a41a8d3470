"""Where tests find things: the repository's root, the tests' folder and its data (tests sit one folder deeper, by
the package they test), and the project's tools as modules."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
TOOLS = ROOT / "tools"


def tool_module(relative: str):
    """tools/RELATIVE (e.g. "measure/kernel_curve.py") as a module: the tools are scripts, not a package."""
    path = TOOLS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
