"""The specdec CLI: text plus a one-line stats summary; bad input is one clear line and a non-zero exit."""

import shlex
import subprocess
import sys

import pytest


def specdec(*args):
    return subprocess.run([sys.executable, "-m", "specdec.cli.main", *map(str, args)], capture_output=True, text=True)


def test_generate_prints_text_and_stats(tiny_bundle):
    proc = specdec("generate", tiny_bundle, "def f(x):", "--max-new-tokens", 12, "--draft-tokens", 3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "[specdec] 12 tokens" in proc.stderr and "acceptance" in proc.stderr


def test_stream_prints_the_same_text(tiny_bundle):
    plain = specdec("generate", tiny_bundle, "def f(x):", "--max-new-tokens", 12)
    streamed = specdec("generate", tiny_bundle, "def f(x):", "--max-new-tokens", 12, "--stream")
    assert streamed.returncode == 0 and streamed.stdout == plain.stdout


def test_generate_with_a_grammar_or_a_schema(tiny_bundle, tmp_path):
    pytest.importorskip("llguidance")
    grammar = tmp_path / "digits.gbnf"
    grammar.write_text('root ::= "(" [0-9]+ ")"')
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], '
                      '"additionalProperties": false}')
    digits = specdec("generate", tiny_bundle, "n:", "--max-new-tokens", 12, "--grammar", grammar)
    assert digits.returncode == 0, digits.stderr
    text = digits.stdout.strip()
    assert text.startswith("(") and text[1:].rstrip(")").isdigit()
    obj = specdec("generate", tiny_bundle, "x:", "--max-new-tokens", 30, "--json-schema", schema, "--draft-tokens", 3)
    assert obj.returncode == 0, obj.stderr
    assert obj.stdout.strip() in ('{"a": true}', '{"a": false}')
    bad = specdec("generate", tiny_bundle, "x", "--grammar", grammar, "--json-schema", schema)
    assert bad.returncode == 2 and "give one of --json-schema and --grammar" in bad.stderr


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
    weights = report["weights_per_token"]  # the target's bytes a one-token pass reads, the machine's read rate
    assert weights["target"]["streamed"] > 0 and weights["read_bandwidth"]["gbs"] > 0 and "gguf" not in weights
    assert "Weights a one-token pass reads" in (tmp_path / "out" / "bench.md").read_text()
    # the report's command names the program, not this machine's path to it
    assert report["command"].startswith("specdec bench ") and "--draft-tokens 2,auto" in report["command"]


class _FakeGenai:
    """Just enough of onnxruntime_genai's Python API for the bench peer: emits a fixed token sequence."""

    overlays: list = []

    class Config:
        def __init__(self, folder):
            self.folder = folder

        def overlay(self, text):
            _FakeGenai.overlays.append(text)

    class Model:
        def __init__(self, config):
            self.config = config

    class GeneratorParams:
        def __init__(self, model):
            self.search, self.speculative = {}, {}

        def set_search_options(self, **options):
            self.search.update(options)

        def set_speculative_options(self, **options):
            self.speculative.update(options)

    class Generator:
        def __init__(self, model, params):
            self.params, self.tokens = params, []

        def append_tokens(self, ids):
            self.prompt = list(ids)

        def is_done(self):
            return len(self.prompt) + len(self.tokens) >= self.params.search["max_length"]

        def generate_next_token(self):
            self.tokens.append(7 + len(self.tokens) % 3)

        def get_next_tokens(self):
            return [self.tokens[-1]]


def test_genai_peer_runs_each_prompt_beside_specdec(tiny_decoder, tmp_path, monkeypatch):
    from specdec.bench.bench import run_bench
    from specdec.bench.peers import GenaiPeer

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", _FakeGenai)
    with pytest.raises(ValueError, match="no genai_config.json"):
        GenaiPeer(str(tmp_path), tiny_decoder.codec.encode, 8, lambda m: None)
    (tmp_path / "genai_config.json").write_text("{}")
    peer = GenaiPeer(str(tmp_path), tiny_decoder.codec.encode, 8, lambda m: None, threads=2)
    assert '"intra_op_num_threads": 2' in _FakeGenai.overlays[-1]
    prompts = [{"id": "a", "kind": "code", "prompt": "def f(x):"}, {"id": "b", "kind": "prose", "prompt": "Once"}]
    report = run_bench(tiny_decoder, prompts, {"0": {"num_draft_tokens": 0}}, 8, 0.0, repeat=2,
                       progress=lambda m: None, peers=(peer,))
    order = [(r["prompt"], r["mode"]) for r in report["runs"]]
    # interleaved: each prompt's peer runs follow specdec's run of that prompt (first pass only)
    assert order[:3] == [("a", "0"), ("a", "genai:target"), ("a", "genai:ngram")]
    assert order[3:6] == [("b", "0"), ("b", "genai:target"), ("b", "genai:ngram")]
    genai_runs = [r for r in report["runs"] if r["mode"] == "genai:target"]
    assert genai_runs[0]["tokens"] == [7, 8, 9, 7, 8, 9, 7, 8]
    # the first token is sampled from append_tokens' logits (timed as prefill): 7 decoded, not 8
    assert genai_runs[0]["decode_tokens"] == 7 and genai_runs[0]["new_tokens"] == 8
    rows = {r["mode"]: r for r in report["summary"] if r["kind"] == "all"}
    assert rows["genai:ngram"]["runs"] == 2 and rows["genai:target"]["identical_to_target_only"] == 0


@pytest.mark.parametrize("peers_first", [False, True])
def test_bench_loads_peers_in_the_order_asked_and_records_it(tiny_bundle, tmp_path, monkeypatch, peers_first):
    """--peers-first creates genai's model before specdec's sessions (the creation order moves a pass by 2-3% on
    a 2-core CPU, so a fair comparison runs both); the report and its footer name the order."""
    import json

    from specdec.decoding import decoder as decoder_module
    from specdec.cli.main import main

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", _FakeGenai)
    (tmp_path / "genai").mkdir()
    (tmp_path / "genai" / "genai_config.json").write_text("{}")
    events = []
    real_load = decoder_module.SpeculativeDecoder.load.__func__
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "load",
                        classmethod(lambda cls, *a, **k: events.append("specdec") or real_load(cls, *a, **k)))
    monkeypatch.setattr(_FakeGenai, "Model", lambda config: events.append("genai") or object(), raising=False)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"id": "a", "kind": "code", "prompt": "def f(x):"}]))
    argv = ["bench", str(tiny_bundle), "--prompts", str(prompts), "--max-new-tokens", "8", "--draft-tokens", "0",
            "--peer-genai", str(tmp_path / "genai"), "--out", str(tmp_path / "out")] + (["--peers-first"] * peers_first)
    assert main(argv) == 0
    assert events == (["genai", "specdec"] if peers_first else ["specdec", "genai"])
    order = "peers, then specdec" if peers_first else "specdec, then peers"
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["load_order"] == order and report["command"] == shlex.join(["specdec", *argv])
    assert f"Models loaded: {order}" in (tmp_path / "out" / "bench.md").read_text()
