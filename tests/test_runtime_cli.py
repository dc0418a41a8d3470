"""The specdec CLI: text plus a one-line stats summary; bad input is one clear line and a non-zero exit."""

import subprocess
import sys

import pytest


def specdec(*args):
    return subprocess.run([sys.executable, "-m", "specdec.runtime.cli", *map(str, args)], capture_output=True, text=True)


def test_generate_prints_text_and_stats(tiny_bundle):
    proc = specdec("generate", tiny_bundle, "def f(x):", "--max-new-tokens", 12, "--draft-tokens", 3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "[specdec] 12 tokens" in proc.stderr and "acceptance" in proc.stderr


def test_stream_prints_the_same_text(tiny_bundle):
    plain = specdec("generate", tiny_bundle, "def f(x):", "--max-new-tokens", 12)
    streamed = specdec("generate", tiny_bundle, "def f(x):", "--max-new-tokens", 12, "--stream")
    assert streamed.returncode == 0 and streamed.stdout == plain.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "{bundle}", "x", "--temperature", "-1"], "temperature must be"),
        (["generate", "{bundle}", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "{bundle}", "x", "--top-k", "-3"], "top_k must be"),
        (["generate", "{bundle}", "x", "--min-p", "1"], "min_p must be in [0, 1)"),
        (["generate", "{bundle}", ""], "prompt is empty"),
        (["generate", "{bundle}", "x", "--max-new-tokens", "100000"], "exceeds max_context"),
        (["generate", "{bundle}", "x" * 600], "exceeds max_context"),
        (["generate", "{bundle}", "x", "--provider", "cuda"], "provider cuda requested but onnxruntime has no CUDAExecutionProvider"),
        (["generate", "/nonexistent/bundle", "x"], "does not exist"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_bundle, args, message):
    proc = specdec(*[a.replace("{bundle}", str(tiny_bundle)) for a in args])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_bench_writes_json_markdown_and_compares_modes(tiny_bundle, tmp_path):
    import json

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"id": "a", "kind": "code", "prompt": "def f(x):"},
                                   {"id": "b", "kind": "prose", "prompt": "Once upon"}]))
    proc = specdec("bench", tiny_bundle, "--prompts", prompts, "--max-new-tokens", 16, "--draft-tokens", "2,auto",
                   "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert {r["mode"] for r in report["runs"]} == {"0", "2", "auto"}
    all_rows = {r["mode"]: r for r in report["summary"] if r["kind"] == "all"}
    assert all_rows["0"]["speedup"] == pytest.approx(1.0)
    assert all_rows["2"]["identical_to_target_only"] == 2  # greedy outputs equal target-only
    assert all_rows["auto"]["identical_to_target_only"] == 2
    assert "| all | draft g=2 |" in (tmp_path / "out" / "bench.md").read_text()
