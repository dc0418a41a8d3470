"""Where tests find things: the repository's root, the tests' folder and its data (tests sit one folder deeper, by
the package they test)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
TOOLS = ROOT / "tools"
