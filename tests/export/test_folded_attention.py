"""Folded attention (export/folded_attention.py, runners/folded.py): each KV head's cache rows are a graph input
bound as a view of the runner's buffer, written in place by ScatterND and read once per pass.

Exactness is what matters: a row's logits must not depend on how many cache rows are bound (the chunked views),
on the pass's width, or on the KV type; a float16 cache keeps greedy speculation token-identical to target-only
decoding at the same KV type. Each of these checks is shown to fail on a planted bug."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.contract.manifest import Manifest

pytest.importorskip("torch")


def _export(target, draft, out, **options):
    from specdec.export.bundle import ExportOptions, export_bundle

    return export_bundle(ExportOptions(target=str(target), draft=str(draft) if draft else None, out=out, **options),
                         progress=lambda message: None)


@pytest.fixture(scope="module")
def single_pair(tiny_pair_dirs, tmp_path_factory):
    """The tiny pair exported with a float32 KV cache (both models; the default is float16)."""
    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("folded") / "single"
    return out, _export(target, draft, out, kv_dtype="float32")


def _runner(bundle, role="target", max_context=512, steps=64):
    from specdec.runners.factory import make_runner

    spec = getattr(Manifest.read(bundle), role)
    return make_runner(str(bundle / spec.onnx_file), spec, "cpu", max_context, steps)


def _filled(bundle, context: int, **options):
    runner = _runner(bundle, **options)
    ids = np.random.default_rng(1).integers(3, 120, context)
    for start in range(0, context, 64):
        chunk = ids[start:start + 64]
        runner.forward(chunk, range(start, start + len(chunk)))
        runner.commit(len(chunk))
    return runner


@pytest.mark.integration
@pytest.mark.parametrize("planted", [False, True])
def test_a_rows_logits_do_not_depend_on_the_cache_rows_bound(tiny_bundle, monkeypatch, planted):
    """The same pass with views of 256-row chunks and of 16-row chunks: bit-identical logits (the extra columns are
    blocked, so they add exact zeros). Planted: columns past the total left open (bias 0) must change them."""
    from specdec.runners import folded

    assert Manifest.read(tiny_bundle).target.attention == "folded"
    logits = {}
    for chunk in (256, 16):
        monkeypatch.setattr(folded, "CHUNK", chunk)
        runner = _filled(tiny_bundle, 300)
        if planted:
            monkeypatch.setattr(folded, "BLOCKED", np.float32(0.0))  # also opens the columns past the total
        logits[chunk] = runner.forward([5, 6, 7], range(300, 303)).copy()
        assert runner._bound_views == -(-303 // chunk) * chunk
        monkeypatch.setattr(folded, "BLOCKED", np.finfo(np.float32).min)
    assert np.array_equal(logits[256], logits[16]) != planted


@pytest.mark.integration
def test_the_new_rows_are_written_into_the_bound_views(tiny_bundle, monkeypatch):
    """A decode step after a prefill equals the prefill's last row (the step read the rows the prefill wrote in place
    through its views). Planted: present outputs bound to a scratch array (ScatterND then copies into it and the
    cache keeps zeros) must break it."""
    from specdec.runners.folded import FoldedRunner

    ids = [int(i) for i in np.random.default_rng(2).integers(3, 120, 40)]

    def decode_gap() -> float:
        runner = _runner(tiny_bundle, max_context=64)
        reference = _runner(tiny_bundle, max_context=64).forward(ids, range(40))[-1].copy()
        runner.forward(ids[:39], range(39))
        runner.commit(39)
        return float(np.abs(runner.forward(ids[39:], [39])[0] - reference).max())

    assert decode_gap() < 1e-4
    original = FoldedRunner._bind_views

    def elsewhere(self, rows):
        original(self, rows)
        self._scratch = np.zeros_like(self.cache)
        for layer in range(self.spec.num_layers):
            for head, names in enumerate(self.spec.kv_tensors(layer)):
                for kind, present in ((0, names[2]), (1, names[3])):
                    self._binding.bind_output(present, "cpu", 0, self.cache.dtype, [rows, self.spec.head_dim],
                                              self._scratch[layer, kind, 0, head].ctypes.data)

    monkeypatch.setattr(FoldedRunner, "_bind_views", elsewhere)
    assert decode_gap() > 1e-2


def _new_rows_paths(graph) -> dict:
    """For every ScatterND that writes a cache view's rows: the op types from its new rows back to the layer's
    values (the second input of the Concat that starts the path), nearest first."""
    producer = {out: node for node in graph.node for out in node.output}
    paths = {}
    for node in graph.node:
        if node.op_type == "ScatterND" and not node.output[0].endswith(tuple(f"_scale.{h}" for h in range(64))):
            path, name = [], node.input[2]
            while name in producer and producer[name].op_type != "Concat" and len(path) < 12:
                path.append(producer[name].op_type)
                name = producer[name].input[0]
            paths[node.output[0]] = path + ([producer[name].op_type] if name in producer else [])
    return paths


@pytest.mark.integration
def test_a_layers_new_rows_reach_the_cache_through_three_nodes(tiny_bundle):
    """A one-token pass pays about 2 us per node whatever it computes (the real 1.5B target): the new keys and values
    of a layer reach their cache writes through one Concat, one Cast (the float16 cache) and one Split shared by
    every KV head, not a reshape, transpose, cast, split and squeeze per tensor (that layout had 9 more nodes per
    layer). Checked for every view the graph writes."""
    import onnx

    spec = Manifest.read(tiny_bundle).target
    graph = onnx.load(str(tiny_bundle / spec.onnx_file), load_external_data=False).graph
    paths = _new_rows_paths(graph)
    assert len(paths) == 2 * spec.num_layers * spec.num_kv_heads
    assert all(path == ["Split", "Cast", "Concat"] for path in paths.values()), paths


@pytest.mark.integration
def test_one_query_head_per_kv_head_folds_a_copy_and_stays_exact(tmp_path):
    """A model whose KV heads are its query heads (multi-head attention): the folded rows are stacked twice so no
    row is a Gemm's only row; parity within float rounding and verify rows equal one-token passes bit for bit."""
    from tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "mha", "llama", seed=3, kv_heads=4)
    manifest = _export(model, None, tmp_path / "bundle", kv_dtype="float32")
    assert manifest.target.attention == "folded" and manifest.target.num_kv_heads == 4
    report = manifest.extra["parity_max_abs_error"]["target"]["float"]
    assert report["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}
    for scenario, errors in report.items():
        assert errors["logits"] < 1e-4 and errors["kv"] < 1e-4, (scenario, errors)


@pytest.mark.integration
def test_a_float16_cache_halves_the_bytes_and_keeps_greedy_exact(tiny_bundle, single_pair):
    """float16 KV (the default): the manifest and the runner's cache say so, it takes half the bytes of the float32
    one, parity stays within float16 rounding, verify rows equal one-token passes bit for bit, and greedy
    speculation in every mode is target-only decoding at the same KV type."""
    from specdec import SpeculativeDecoder

    bundle, manifest = tiny_bundle, Manifest.read(tiny_bundle)
    assert manifest.target.kv_dtype == manifest.draft.kv_dtype == "float16"
    assert single_pair[1].target.kv_dtype == "float32"
    half, single = _runner(bundle), _runner(single_pair[0])
    assert half.cache.dtype == np.float16 and half.cache.nbytes * 2 == single.cache.nbytes
    report = manifest.extra["parity_max_abs_error"]["target"]["float"]
    assert report["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}
    assert all(errors["logits"] < 2e-2 for errors in report.values()), report
    decoder = SpeculativeDecoder.load(bundle)
    prompt = "def add(a, b):\n    return"
    baseline = decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0).token_ids
    for mode in (dict(num_draft_tokens=3, proposer="draft"), dict(tree="2,2,1", proposer="draft"),
                 dict(num_draft_tokens="auto")):
        assert decoder.generate(prompt, max_new_tokens=40, **mode).token_ids == baseline, mode


def test_kv_dtype_and_attention_options_are_validated(tmp_path):
    from specdec.export.bundle import ExportOptions

    with pytest.raises(ValueError, match="--kv-dtype"):
        ExportOptions(target="x", draft=None, out=tmp_path, kv_dtype="int4")
    with pytest.raises(ValueError, match="--attention"):
        ExportOptions(target="x", draft=None, out=tmp_path, attention="flash")
    with pytest.raises(ValueError, match="needs --attention folded"):
        ExportOptions(target="x", draft=None, out=tmp_path, attention="gqa", kv_dtype="float16")
    with pytest.raises(ValueError, match="streamed exporter"):
        ExportOptions(target="x", draft=None, out=tmp_path, exporter="traced", kv_dtype="float16")
    options = ExportOptions(target="x", draft=None, out=tmp_path)
    assert options.kv_dtype_for(None) == "float16" and options.attention == "folded"
    assert ExportOptions(target="x", draft=None, out=tmp_path, attention="gqa").kv_dtype_for(None) == "float32"
    assert options.kv_dtype_for("gpt2 is the traced exporter's") == "float32"
    with pytest.raises(ValueError, match="needs the streamed exporter: gpt2"):
        ExportOptions(target="x", draft=None, out=tmp_path, kv_dtype="float16").kv_dtype_for("gpt2")


_ATTEND_CHECK = """
import json, sys
import numpy as np
import onnxruntime as ort
from specdec.contract.manifest import TensorSpec
from specdec.export.folded_attention import attend, folded_bias, row_plan
from specdec.export.graph_writer import GraphWriter

folder, chunked, dim, depth, group = sys.argv[1], sys.argv[2] == "1", 128, 1024, 6
w = GraphWriter(folder)
tokens = w.one("Shape", ["bias_rows"], name="tokens", start=0, end=1)
plan = row_plan(w, tokens, group, dim)
if chunked:
    out = attend(w, "queries", "keys", "values", folded_bias(w, "bias_rows", plan, "bias"), plan, dim, "head")
else:  # planted: one Gemm, Softmax and MatMul for every width
    tiled = w.one("Tile", ["bias_rows", w.constant([group, 1])], name="tiled")
    scores = w.one("Gemm", ["queries", "keys", tiled], name="scores", alpha=float(dim ** -0.5), transB=1)
    out = w.one("MatMul", [w.one("Softmax", [scores], name="probs", axis=-1), "values"], name="out")
w.one("Identity", [out], name="result")
path = w.finish((TensorSpec("queries", "float32", ("rows", dim)), TensorSpec("keys", "float32", ("cache_rows", dim)),
                 TensorSpec("values", "float32", ("cache_rows", dim)),
                 TensorSpec("bias_rows", "float32", ("tokens", "cache_rows"))),
                (TensorSpec("result/out0", "float32", ("rows", dim)),))
options = ort.SessionOptions()
options.intra_op_num_threads = 2
session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
keys, values = rng.standard_normal((2, depth, dim), dtype=np.float32)
report = {"close": True, "same": []}
for count in (2, 20, 21, 22, 64, 67):
    queries = rng.standard_normal((group, count, dim), dtype=np.float32)  # row g * T + t once flattened
    bias = np.where(rng.random((count, depth)) < 0.1, -np.inf, 0).astype(np.float32)
    bias[:, -5:] = -np.inf  # columns past the total
    wide = session.run(None, {"queries": queries.reshape(-1, dim), "keys": keys, "values": values,
                              "bias_rows": bias})[0].reshape(group, count, dim)
    scores = np.einsum("gtd,cd->gtc", queries.astype(np.float64), keys) * dim ** -0.5 + bias
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (probs / probs.sum(-1, keepdims=True)) @ values
    report["close"] &= bool(np.allclose(wide, expected, atol=1e-4))
    same = True
    for t in (0, count // 2, count - 1):  # each token as a one-token pass computes it
        one = session.run(None, {"queries": queries[:, t], "keys": keys, "values": values,
                                 "bias_rows": bias[t:t + 1]})[0]
        same &= bool(np.array_equal(wide[:, t], one))
    report["same"].append(same)
print(json.dumps(report))
"""


@pytest.mark.integration
@pytest.mark.parametrize("chunked", [True, False], ids=["attend", "planted: one product per pass"])
def test_a_wide_pass_attends_as_a_one_token_pass_does(tmp_path, chunked):
    """On two threads (a fresh process: this one's pool is shared), 6 query heads per KV head behind 1,024 cache
    rows: every token of a pass of 2, 20, 21, 22, 64 and 67 tokens gets its one-token pass's attention rows bit for
    bit, and close to float64 numpy's. Planted: one Gemm/Softmax/MatMul for every width, whose threads split the
    values product by rows from 128 folded rows on (which blocks the cache sum otherwise), must differ there."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ATTEND_CHECK, str(tmp_path / "graph"), "1" if chunked else "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["close"]
    if chunked:
        assert all(report["same"]), report
    else:
        assert report["same"][:3] == [True, True, True] and not any(report["same"][3:]), report
