"""tools/kernel_curve.py on tiny products: every kernel's row for every row count, ratios against one row."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")


def _tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "kernel_curve.py"
    spec = importlib.util.spec_from_file_location("kernel_curve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_curve_prints_one_row_per_kernel(tmp_path, monkeypatch, capsys):
    out = tmp_path / "curve.md"
    monkeypatch.setattr(sys, "argv", ["kernel_curve.py", "--k", "64", "--n", "96", "--layers", "2", "--rows", "1,3",
                                      "--levels", "1,4", "--blocks", "32", "--repeats", "2",
                                      "--out", str(out)])
    assert _tool().main() == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| int4 b32 level 1", "| int4 b32 level 4",
                                                      "| float32 MatMul (2 pairs)"]
    assert all(row.count("(1.00x)") >= 1 and row.count(" ms ") == 2 for row in rows)
    assert out.read_text().count("\n") == len(rows) + 4
