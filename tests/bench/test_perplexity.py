"""``specdec eval`` / ``specdec.bench.perplexity``: llama-perplexity's procedure (chunks, BOS, the scored half,
the log-softmax) against a direct numpy computation, on a numpy stand-in model (fast) and on the tiny bundle's
target and draft (integration); bad input is one line."""

import hashlib
import json
import math

import numpy as np
import pytest

from specdec.bench import perplexity as ppl
from specdec.cli.main import main

VOCAB = 11


def _logits_after(prefix) -> np.ndarray:
    """The stand-in model: the next-token logits depend on the whole prefix (a cache bug shows) and its length."""
    seed = (sum((i + 1) * int(t) for i, t in enumerate(prefix)) * 7919 + len(prefix)) % (2**32)
    return np.random.default_rng(seed).normal(0, 3, VOCAB).astype(np.float32)


class FakeRunner:
    """The Runner protocol's surface perplexity_of uses: reset, forward (a chain after the valid past), commit."""

    def __init__(self, max_context=64, max_step_tokens=64):
        self.max_context, self.max_step_tokens = max_context, max_step_tokens
        self.ids, self.passes = [], []

    def reset(self):
        self.ids = []

    def forward(self, tokens, positions):
        assert list(positions) == list(range(len(self.ids), len(self.ids) + len(tokens)))
        self.passes.append(len(tokens))
        rows = [_logits_after(self.ids + list(tokens[: i + 1])) for i in range(len(tokens))]
        self._pending = list(tokens)
        return np.stack(rows)

    def commit(self, count):
        self.ids += self._pending[:count]


def _reference(tokens, context, chunks, bos=None):
    """Direct: each chunk (first token -> BOS if given), logits at first..context-2, float64 log-softmax."""
    count = min(len(tokens) // context, chunks or 10**9)
    values = []
    for c in range(count):
        ids = list(tokens[c * context:(c + 1) * context])
        seen = [bos] + ids[1:] if bos is not None else ids
        for pos in range(context // 2, context - 1):
            row = _logits_after(seen[: pos + 1]).astype(np.float64)
            log_probs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            values.append(-log_probs[ids[pos + 1]])
    values = np.array(values)
    mean = values.mean()
    return math.exp(mean), len(values), math.exp(mean) * math.sqrt((np.mean(values**2) - mean**2) / (len(values) - 1))


@pytest.mark.parametrize("context,segment,chunks,bos", [(8, 3, None, None), (8, 8, 2, 2), (10, 4, None, 2),
                                                       (6, 1, 3, None)])
def test_perplexity_matches_a_direct_log_softmax(context, segment, chunks, bos):
    tokens = np.random.default_rng(0).integers(3, VOCAB, 37)
    runner = FakeRunner()
    result = ppl.perplexity_of(runner, tokens, "target", bos is not None, bos, context, chunks, segment)
    expected, scored, uncertainty = _reference(tokens, context, chunks, bos)
    assert result.perplexity == pytest.approx(expected, rel=1e-6)
    assert result.uncertainty == pytest.approx(uncertainty, rel=1e-4)
    assert result.scored_tokens == scored == result.chunks * (context - context // 2 - 1)
    assert result.chunks == min(37 // context, chunks or 99) and len(result.running) == result.chunks
    assert result.running[-1] == result.perplexity and result.text_tokens == 37
    assert max(runner.passes) <= segment


def test_log_softmax_is_llamas_float32_differences_with_a_float64_sum():
    logits = np.random.default_rng(1).normal(0, 8, (5, 1000)).astype(np.float32)
    targets = np.array([0, 5, 999, 17, 3])
    exact = -(logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True)))
    got = ppl.negative_log_likelihoods(logits, targets)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, exact[np.arange(5), targets], rtol=1e-6)


def test_a_text_under_two_chunks_and_bad_options_are_one_line():
    with pytest.raises(ValueError, match="needs at least 1024"):
        ppl.chunk_count(1023, 512, None)
    assert ppl.chunk_count(1024, 512, None) == 2 and ppl.chunk_count(5000, 512, 3) == 3
    for args, message in (((512, 0), "chunks must be a positive"), ((2, None), "context must be at least"),
                          ((512, None, 0), "segment must be"), (("512", None), "context must be an integer")):
        with pytest.raises(ValueError, match=message):
            ppl.check_eval_args(*args)


class _Tokenizer:
    def __init__(self, adds_bos):
        self.adds_bos = adds_bos

    def encode(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return type("Encoding", (), {"ids": ([1] if add_special_tokens and self.adds_bos else []) + ids})()


def test_bos_handling_follows_the_tokenizer_as_llama_follows_add_bos_token():
    assert ppl.tokenize_like_llama(_Tokenizer(True), "ab", 1) == ([1, 97, 98], True)
    assert ppl.tokenize_like_llama(_Tokenizer(False), "ab", 1) == ([97, 98], False)
    assert ppl.tokenize_like_llama(_Tokenizer(True), "ab", None)[1] is False


@pytest.mark.parametrize("case", ["no-text", "no-bundle", "bad-chunks", "not-utf8", "nothing", "both-texts",
                                  "write-over"])
def test_eval_cli_bad_input_is_one_line(tmp_path, capsys, case):
    text = tmp_path / "text.txt"
    text.write_bytes(b"\xff\xfe bad" if case == "not-utf8" else b"some text")
    argv = ["eval", str(tmp_path / "no-bundle"), "--text", str(text)]
    if case == "no-text":
        argv[3] = str(tmp_path / "missing.txt")
    if case == "bad-chunks":
        argv += ["--chunks", "0"]
    if case == "nothing":
        argv = ["eval"]
    if case == "both-texts":
        argv += ["--write-text", str(tmp_path / "out.txt")]
    if case == "write-over":
        argv = ["eval", "--write-text", str(text)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: "), err
    assert {"no-text": "is not a file", "no-bundle": "does not exist", "bad-chunks": "chunks must be",
            "not-utf8": "is not UTF-8", "nothing": "needs a bundle", "both-texts": "give one",
            "write-over": "exists"}[case] in err
    assert text.read_bytes() == (b"\xff\xfe bad" if case == "not-utf8" else b"some text")  # never overwritten


def test_eval_cli_writes_the_built_in_text_as_llama_perplexity_reads_it(tmp_path, capsys):
    from specdec.bench.eval_text import MODULES, eval_text

    out = tmp_path / "eval.txt"
    assert main(["eval", "--write-text", str(out)]) == 0
    assert out.read_bytes() == eval_text().encode("utf-8")
    assert "sha256 " + hashlib.sha256(out.read_bytes()).hexdigest() in capsys.readouterr().err
    text = out.read_text()
    assert [line[2:] for line in text.splitlines() if line.startswith("# ")][:3] == list(MODULES[:3])


# ----------------------------------------------------------------------------- the tiny bundle (integration)
TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3


def _direct(bundle, role, context):
    """Each chunk in one pass of the bundle's graph, log-softmax in float64 numpy."""
    from tokenizers import Tokenizer

    from specdec.contract.manifest import Manifest
    from specdec.runners.factory import make_runner

    manifest = Manifest.read(bundle)
    spec = manifest.models()[role]
    tokens = Tokenizer.from_file(str(bundle / manifest.tokenizer_file)).encode(TEXT).ids
    runner = make_runner(str(bundle / spec.onnx_file), spec, "cpu", context, context)
    values = []
    for c in range(len(tokens) // context):
        ids = tokens[c * context:(c + 1) * context]
        runner.reset()
        logits = runner.forward(ids, range(context)).astype(np.float64)
        for pos in range(context // 2, context - 1):
            row = logits[pos]
            values.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[ids[pos + 1]])
    return math.exp(np.mean(values)), len(values)


def test_bundle_perplexity_matches_a_direct_computation(tiny_bundle):
    results = ppl.evaluate_bundle(tiny_bundle, TEXT, context=32, segment=7)
    assert set(results) == {"target", "draft"}
    for role, result in results.items():
        expected, scored = _direct(tiny_bundle, role, 32)
        assert result.scored_tokens == scored and result.chunks == len(TEXT) // 32
        assert result.perplexity == pytest.approx(expected, rel=1e-4), role
    # a random-weight model over its 100-odd ids: near-uniform, far above 1
    assert 10 < results["target"].perplexity < 1000


def test_eval_cli_prints_a_line_per_model_and_json(tiny_bundle, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert main(["eval", str(tiny_bundle), "--text", str(text), "--context", "32", "--chunks", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["target", "draft"] and "2 chunks of 32" in lines[0]
    assert main(["eval", str(tiny_bundle), "--text", str(text), "--context", "32", "--role", "draft", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["results"]) == ["draft"] and report["text_file"] == "text.txt"
    assert report["command"].startswith("specdec eval")
    assert main(["eval", str(tiny_bundle), "--text", str(text), "--context", "4096"]) == 2
    assert "exceeds" in capsys.readouterr().err
    # no --text: the built-in text, named in the JSON by its sha256
    assert main(["eval", str(tiny_bundle), "--context", "32", "--chunks", "1", "--role", "target", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["text_file"].startswith("built-in: ") and "sha256 " in report["text_file"]
