"""The fused graph form (an in-place KV buffer: folded attention or onnxruntime's GroupQueryAttention) and its
runners.

Each architecture is exported in every form from the same tiny model (fused with folded attention where the
streamed exporter applies, fused with GroupQueryAttention, standard): all match PyTorch, and the fused runners give
the same logits as the standard ModelRunner over a script of chains, trees (also at an empty past), hidden past
slots, commits, truncations and tree compaction.
"""

import collections

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from specdec.export.bundle import ExportOptions, export_bundle  # noqa: E402
from specdec.runners.factory import make_runner  # noqa: E402
from specdec.runners.fused import FusedRunner
from specdec.contract.manifest import BundleError, Manifest  # noqa: E402
from specdec.runners.standard import ModelRunner  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

TOLERANCE = 1e-4


# Fused-form parity for every architecture runs in test_export_architectures (fused is the default) and
# standard-form parity in test_tensorrt_ops; here both forms of the architectures whose attention differs
# most: plain RoPE GQA, sliding window on every layer, mixed sliding/full layers with QK norm, no RoPE (MHA).
FORM_ARCHS = ("llama", "mistral", "gemma3_text", "gpt2")


@pytest.fixture(params=FORM_ARCHS)
def both_forms(request, bundle_per_form):
    """(arch, {"fused": bundle dir, ["gqa": bundle dir,] "standard": bundle dir}) of one tiny target, max 2048
    positions (the session's shared bundles: test_export_architectures and test_tensorrt_ops check the same ones for
    every architecture). "gqa" is there when "fused" has folded attention (the streamed architectures)."""
    bundles = {form: bundle_per_form(request.param, form)[0] for form in ("fused", "standard")}
    if Manifest.read(bundles["fused"]).target.attention == "folded":
        bundles["gqa"] = bundle_per_form(request.param, "gqa")[0]
    return request.param, bundles


def _graph(form: str) -> str:
    return "standard" if form == "standard" else "fused"


def _runner(bundle, max_context=64, steps=32):
    spec = Manifest.read(bundle).target
    return make_runner(str(bundle / spec.onnx_file), spec, "cpu", max_context, steps)


def test_both_forms_match_pytorch_and_record_their_form(both_forms):
    """Parity (prefill, decode, chain verify, tree) within 1e-4 for both forms; the manifest names form and layout."""
    arch, bundles = both_forms
    for form, bundle in bundles.items():
        manifest = Manifest.read(bundle)
        assert (manifest.target.graph, manifest.target.kv_layout) == \
            (_graph(form), {"fused": "shared-bnsh", "standard": "split-bsnh"}[_graph(form)])
        assert (form == "gqa") <= (manifest.target.attention == "gqa")
        report = manifest.extra["parity_max_abs_error"]["target"]["float"]
        assert set(report) == {"prefill", "decode", "chain_verify", "tree", "rows_vs_decode"}
        for scenario, errors in report.items():
            assert errors["logits"] < TOLERANCE and errors["kv"] < TOLERANCE, (arch, form, scenario, errors)


def test_verify_rows_equal_one_token_passes_bit_for_bit(both_forms):
    """A chain's rows and KV equal one-token passes over the same tokens exactly (parity's "rows_vs_decode"), in
    both forms: greedy speculation then equals target-only decoding whatever the pass widths. Without the fused
    graph's scratch row, onnxruntime's one-row attention kernel differs (~1e-7 here, 0.2 on int4 logits)."""
    arch, bundles = both_forms
    for form, bundle in bundles.items():
        report = Manifest.read(bundle).extra["parity_max_abs_error"]["target"]["float"]["rows_vs_decode"]
        assert report == {"logits": 0.0, "kv": 0.0}, (arch, form, report)


def test_a_prefill_chunk_computes_only_its_last_rows_logits(both_forms, monkeypatch):
    """``last_logits_only``: the KV rows bit for bit those of a full pass and the last row's logits the same (to
    float rounding), in both forms; the fused graph binds one logit row, so its lm_head runs on one row, and the
    standard form (no ``logit_rows`` input) slices a full pass. A planted bug (the fused runner asking for the
    first row instead of the last) fails the logits check."""
    from specdec.contract.manifest import LOGIT_ROWS

    arch, bundles = both_forms
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 60, 13)]
    for form, bundle in bundles.items():
        full, last = _runner(bundle), _runner(bundle)
        assert full.spec.has_input(LOGIT_ROWS) == (form != "standard")
        for runner in (full, last):
            runner.forward(ids[:4], range(4))
            runner.commit(4)
        reference = full.forward(ids[4:], range(4, 13))[-1].copy()
        got = last.forward(ids[4:], range(4, 13), last_logits_only=True)
        assert got.shape == (1, full.logits_width)
        np.testing.assert_allclose(got[0], reference, atol=TOLERANCE, err_msg=f"{arch} {form}")
        full.commit(9)
        last.commit(9)
        assert np.array_equal(full._kv_rows(13), last._kv_rows(13)), (arch, form)
    fused = _runner(bundles["fused"])
    monkeypatch.setattr(fused, "_logit_rows", np.zeros_like(fused._logit_rows))  # every row asks for row 0
    np.testing.assert_raises(AssertionError, np.testing.assert_allclose,
                             fused.forward(ids, range(13), last_logits_only=True)[0], _runner(bundles["fused"])
                             .forward(ids, range(13))[-1], atol=TOLERANCE)


def test_fused_graphs_read_the_past_only_through_their_attention(both_forms):
    """GroupQueryAttention: one node per layer, the only consumer of the cache. Folded: no GroupQueryAttention; each
    KV head's cache view is read only by the ScatterND that writes the new rows into it in place, whose output (the
    same view) the attention reads. Nothing concatenates, slices or copies the past; fewer nodes than standard."""
    arch, bundles = both_forms
    graphs = {form: onnx.load(str(b / "target/model.onnx"), load_external_data=False).graph
              for form, b in bundles.items()}
    layers = Manifest.read(bundles["fused"]).target.num_layers
    for form in ("fused", "gqa"):
        if form not in graphs:
            continue
        nodes = graphs[form].node
        folded = Manifest.read(bundles[form]).target.attention == "folded"
        past_names = {i.name for i in graphs[form].input if i.name.startswith("past.")}
        consumers = {n.op_type for n in nodes if past_names & set(n.input)}
        if folded:
            assert consumers == {"ScatterND"} and not any(n.op_type == "GroupQueryAttention" for n in nodes)
            present = {o.name for o in graphs[form].output if o.name.startswith("present.")}
            readers = {n.op_type for n in nodes if present & set(n.input)}
            assert readers <= {"Gemm", "MatMul", "Cast"} and "Gemm" in readers, readers
            continue
        assert sum(n.op_type == "GroupQueryAttention" for n in nodes) == layers
        assert consumers == {"GroupQueryAttention"}
        assert len(nodes) < len(graphs["standard"].node)
        # packed QKV: the projection goes in whole as the query (no Split), unless a per-head q/k norm sits between
        from specdec.export.architectures import ARCHITECTURES

        packed = not ARCHITECTURES[arch].qk_norm
        for node in nodes:
            if node.op_type == "GroupQueryAttention":
                assert (node.input[1] == "" and node.input[2] == "") == packed, (arch, list(node.input[:3]))
    standard_consumers = {n.op_type for n in graphs["standard"].node
                          if {i.name for i in graphs["standard"].input if i.name.startswith("past.")} & set(n.input)}
    assert "GroupQueryAttention" not in standard_consumers


def _script(runner, prompt):
    """A fixed sequence of runner calls; returns every logits row it produced."""
    out = []
    n = len(prompt)
    # a tree at an empty past (non-consecutive positions: the fused runner splits off the root)
    out.append(runner.forward(prompt[:4], [0, 1, 1, 2], parents=[-1, 0, 0, 1]).copy())
    runner.forward(prompt, range(n))  # overwrite: the tree was never committed
    runner.commit(n)
    chain = [5, 6, 7, 8, 9]
    out.append(runner.forward(chain, range(n, n + 5)).copy())
    runner.commit(5)
    runner.truncate(n + 2)  # reject the last three
    out.append(runner.forward([11], [n + 2]).copy())
    runner.commit(1)
    base = runner.length
    tree_parents = [-1, 0, 0, 1, 2, 3]
    depths = [0, 1, 1, 2, 2, 3]
    out.append(runner.forward([20, 21, 22, 23, 24, 25], [base + d for d in depths], parents=tree_parents).copy())
    runner.keep_path(np.array([base + 0, base + 2, base + 4]), base)  # accept root -> 22 -> 24
    out.append(runner.forward([30, 31], [base + 3, base + 4]).copy())
    runner.commit(2)
    visible_past = np.ones((3, runner.length), dtype=bool)
    visible_past[:, 3] = False  # a draft tree that hides one past slot
    visible_past[1, runner.length - 1] = False
    out.append(runner.forward([40, 41, 42], [runner.length] * 3, parents=[-1, -1, -1], visible_past=visible_past).copy())
    return out


def test_fused_runner_equals_standard_runner_over_a_decoding_script(both_forms):
    """Same logits (1e-4) from both forms over chains, trees, truncation, compaction and hidden past slots."""
    arch, bundles = both_forms
    prompt = [(7 * i + 3) % 120 + 3 for i in range(20)]
    standard = _runner(bundles["standard"])
    assert isinstance(standard, ModelRunner)
    reference = _script(standard, prompt)
    for form in set(bundles) - {"standard"}:
        fused = _runner(bundles[form])
        assert isinstance(fused, FusedRunner)
        for step, (a, b) in enumerate(zip(_script(fused, prompt), reference)):
            assert np.abs(a - b).max() < TOLERANCE, (arch, form, step, float(np.abs(a - b).max()))
        assert fused.length == standard.length


def test_rollback_and_compaction_equal_a_fresh_run(both_forms):
    """truncate/keep_path leave a cache whose next pass equals a fresh run on the kept tokens."""
    arch, bundles = both_forms
    prompt = [(5 * i + 1) % 120 + 3 for i in range(12)]
    runner = _runner(bundles["fused"])
    runner.forward(prompt, range(12))
    runner.commit(12)
    runner.forward([40, 41, 42], [12, 13, 13], parents=[-1, 0, 0])  # a tree: 40 -> {41, 42}
    runner.keep_path(np.array([12, 14]), 12)  # accept 40, 42
    kept = runner.forward([50], [14]).copy()
    runner.commit(1)
    runner.forward([60, 61, 62], [15, 16, 17])
    runner.commit(3)
    runner.truncate(15)
    again = runner.forward([50], [15]).copy()
    fresh = _runner(bundles["fused"])
    ref = fresh.forward(prompt + [40, 42, 50], range(15)).copy()
    assert np.abs(kept[0] - ref[-1]).max() < TOLERANCE
    fresh.commit(15)
    ref_again = fresh.forward([50], [15]).copy()
    assert np.abs(again[0] - ref_again[0]).max() < TOLERANCE
    fork = runner.fork()  # same session, own cache: starts empty and does not disturb the parent
    assert fork.session is runner.session and fork.length == 0 and fork.cache is not runner.cache


def test_a_pass_at_long_context_reads_and_writes_the_cache_in_place(both_forms):
    """At context 1,500 the graph's KV outputs are the cache buffer itself (GroupQueryAttention: each layer's block;
    folded: each KV head's rows); only the T new rows change (and GroupQueryAttention's scratch slot after them,
    which no committed length covers)."""
    arch, bundles = both_forms
    if arch != "llama":
        pytest.skip("one architecture is enough for the buffer check")
    for form in ("fused", "gqa"):
        runner = _runner(bundles[form], max_context=1600, steps=64)
        spec = runner.spec
        rng = np.random.default_rng(0)
        for start in range(0, 1500, 64):
            chunk = rng.integers(3, 120, size=min(64, 1500 - start))
            runner.forward(chunk, range(start, start + len(chunk)))
            runner.commit(len(chunk))
        before = runner.cache.copy()
        runner.forward([5, 6, 7, 8, 9], range(1500, 1505))
        pointers = {value.data_ptr() for value in runner._binding.get_outputs()}
        heads = range(spec.num_kv_heads) if spec.attention == "folded" else [slice(None)]
        blocks = {runner.cache[layer, kind, 0, head].ctypes.data
                  for layer in range(spec.num_layers) for kind in (0, 1) for head in heads}
        # every KV output is the cache itself (no past-sized output allocated); the only other one is logits
        assert blocks <= pointers and len(pointers) == len(blocks) + 1, form
        changed = np.any(runner.cache != before, axis=(0, 1, 2, 3, 5))
        scratch = spec.attention_scratch_rows
        assert (form, spec.attention, scratch) in (("fused", "folded", 0), ("gqa", "gqa", 1))
        assert changed[1500:1505 + scratch].all() and not changed[:1500].any() and not changed[1505 + scratch:].any()


def test_a_pass_ending_at_the_last_position_runs(both_forms):
    """The scratch row sits at the last row's position, so a pass ending at max_positions - 1 stays inside the
    rotary tables; its logits equal the standard form's."""
    arch, bundles = both_forms
    if arch != "llama":
        pytest.skip("one architecture is enough for the edge position")
    last = Manifest.read(bundles["fused"]).target.max_positions
    rows = []
    for form in ("fused", "standard"):
        runner = _runner(bundles[form], max_context=last, steps=64)
        for start in range(0, last - 4, 64):
            count = min(64, last - 4 - start)
            runner.forward(np.full(count, 7), range(start, start + count))
            runner.commit(count)
        rows.append(runner.forward([5, 6, 7, 8], range(last - 4, last)).copy())
    assert np.abs(rows[0] - rows[1]).max() < TOLERANCE


def test_greedy_speculative_equals_target_only_on_a_fused_pair(tiny_bundle):
    """Through SpeculativeDecoder (make_runner): greedy chain and tree drafting == target-only, fused runners."""
    from specdec import SpeculativeDecoder

    manifest = Manifest.read(tiny_bundle)
    assert manifest.target.graph == "fused" and manifest.draft.graph == "fused"
    decoder = SpeculativeDecoder.load(tiny_bundle)
    assert isinstance(decoder.target, FusedRunner) and isinstance(decoder.draft, FusedRunner)
    prompt = "def add(a, b):\n    return"
    baseline = decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
    for gamma in (1, 3, 6):
        result = decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=gamma, proposer="draft")
        assert result.token_ids == baseline.token_ids, gamma
    for tree in ("2,2,1", "auto"):
        result = decoder.generate(prompt, max_new_tokens=40, tree=tree, proposer="draft")
        assert result.token_ids == baseline.token_ids, tree


def test_fused_bundles_are_refused_for_tensorrt(tiny_bundle, monkeypatch):
    """TensorRT (engines/ and the tensorrt providers) refuses a fused bundle with one clear line, where its packages
    are installed (faked here: without them the missing package is the line, tests/cli/test_runtime_cli.py)."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    from specdec.runners.tensorrt.records import require_standard_form
    from specdec.runners.tensorrt.build import check_engine_ready

    spec = Manifest.read(tiny_bundle).target
    for check in (require_standard_form, check_engine_ready):
        with pytest.raises(BundleError, match="--graph standard"):
            check(spec)
    for provider in ("tensorrt", "tensorrt-native"):
        with pytest.raises(BundleError, match="--graph standard"):
            FusedRunner(str(tiny_bundle / spec.onnx_file), spec, provider, 64, 8)


def test_graph_option_is_validated(tmp_path):
    with pytest.raises(ValueError, match="--graph"):
        ExportOptions(target="x", draft=None, out=tmp_path, graph="fast")
    with pytest.raises(ValueError, match="--graph fused"):
        ExportOptions(target="x", draft=None, out=tmp_path, graph="fused", quant="int4-qdq")
    assert ExportOptions(target="x", draft=None, out=tmp_path).graph == "fused"
    assert ExportOptions(target="x", draft=None, out=tmp_path, dtype="float16").graph == "standard"
    assert ExportOptions(target="x", draft=None, out=tmp_path, quant="int4-qdq").graph == "standard"
    assert ExportOptions(target="x", draft=None, out=tmp_path, quant="int4").graph == "fused"
    assert ExportOptions(target="x", draft=None, out=tmp_path, quant="int4", graph="fused").graph == "fused"


def test_old_manifests_load_as_standard(tiny_bundle, bundle_per_form):
    """A manifest written before the graph fields existed reads as the standard form; a fused manifest written
    before the scratch row reads with none (its one-token passes round differently, but it still runs), one written
    before the attention field as GroupQueryAttention. Inconsistent attention fields are refused."""
    import json

    folded = json.loads((tiny_bundle / "manifest.json").read_text())
    assert (folded["target"]["attention"], folded["target"]["attention_scratch_rows"]) == ("folded", 0)
    for bad, message in (({"attention": "flash"}, "attention must be one of"),
                         ({"attention_scratch_rows": 1}, "attention 'folded' is a fused form without scratch rows")):
        with pytest.raises(BundleError, match=message):
            Manifest.from_json(json.dumps({**folded, "target": {**folded["target"], **bad}}))
    gqa, _ = bundle_per_form("llama", "gqa")
    data = json.loads((gqa / "manifest.json").read_text())
    assert (data["target"]["attention"], data["target"]["attention_scratch_rows"]) == ("gqa", 1)
    del data["target"]["attention"]
    assert Manifest.from_json(json.dumps(data)).target.attention == "gqa"
    del data["target"]["attention_scratch_rows"]
    assert Manifest.from_json(json.dumps(data)).target.attention_scratch_rows == 0
    for role in [role for role in ("target", "draft") if data.get(role)]:
        del data[role]["graph"], data[role]["kv_layout"]
    manifest = Manifest.from_json(json.dumps(data))
    assert manifest.target.graph == "standard" and manifest.target.kv_layout == "split-bsnh"
    data["target"]["graph"] = "fused"  # a form with the wrong layout is refused
    with pytest.raises(BundleError, match="layout"):
        Manifest.from_json(json.dumps(data))
    data["target"]["graph"], data["target"]["attention_scratch_rows"] = "standard", 1
    with pytest.raises(BundleError, match="attention_scratch_rows applies to the fused form only"):
        Manifest.from_json(json.dumps(data))
    data["target"]["attention_scratch_rows"] = 2
    with pytest.raises(BundleError, match="attention_scratch_rows must be an integer in 0..1"):
        Manifest.from_json(json.dumps(data))


def _tied_model(folder):
    """A tiny qwen2 whose lm_head is its embedding (tie_word_embeddings), like the Qwen2.5 pair."""
    import transformers as tf

    from tiny_models import tiny_config, tiny_tokenizer

    config = tiny_config("qwen2")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model.get_input_embeddings().weight.detach().numpy()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.integration
def test_int4_quantizes_every_projection_and_the_embedding(tied, tmp_path):
    """int4: every MatMul (lm_head too) is MatMulNBits; the embedding is GatherBlockQuantized, sharing the
    lm_head's int4 weights when tied, and dequantizes to the float table within one quantization step."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    if tied:
        folder, table = _tied_model(tmp_path / "hf")
    else:
        folder = build_tiny_model(tmp_path / "hf", "llama", seed=0)
        table = None
    manifest = export_bundle(ExportOptions(target=str(folder), draft=None, out=tmp_path / "b", quant="int4", graph="fused",
                                           quant_method="rtn"),  # rtn's layout (auto is k-quant for floats)
                             progress=lambda msg: None)
    assert manifest.target.graph == "fused" and isinstance(manifest.extra["parity_max_abs_error"]["target"]["int4"], dict)
    model = onnx.load(str(tmp_path / "b/target/model.onnx"))
    graph = model.graph
    ops = collections.Counter(n.op_type for n in graph.node)
    constants = {t.name for t in graph.initializer}
    # no float weights: the MatMul / Gemm nodes left are the folded attention's, over activations and the cache
    assert not [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and constants & set(n.input)]
    assert ops["GatherBlockQuantized"] == 1
    # the one Gather left picks the logit rows of the hidden states before the lm_head (contract: logit_rows)
    assert [n.input[0] in constants for n in graph.node if n.op_type == "Gather"] == [False]
    vocab, hidden = 128, 64
    assert not [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and list(t.dims) == [vocab, hidden]]
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    # the gathered table: an initializer, or (shared with the lm_head) the lm_head's data seen through a Reshape
    reshape = next((n for n in graph.node if n.output[0] == gather.input[0]), None)
    data = reshape.input[0] if reshape is not None else gather.input[0]
    lm_head = next(n for n in graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits")
    shared = data == lm_head.input[1] and gather.input[2] == lm_head.input[2]
    assert shared == tied  # stored once when tied
    # the gathered rows are exactly the int4 weights dequantized as MatMulNBits does: (nibble - 8) * scale
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    packed = inits[data].reshape(vocab, -1)
    scales = inits[gather.input[2]]
    nibbles = np.stack([packed & 15, packed >> 4], axis=-1).reshape(vocab, -1).astype(np.float32)
    block = hidden // scales.shape[1]
    expected = ((nibbles - 8) * np.repeat(scales, block, axis=1))[:, :hidden]
    nodes = [reshape, gather] if reshape is not None else [gather]
    sub = helper.make_model(helper.make_graph(
        nodes, "embed", [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, vocab])],
        [helper.make_tensor_value_info(gather.output[0], onnx.TensorProto.FLOAT, None)],
        [t for t in graph.initializer if t.name in {i for n in nodes for i in n.input}]),
        opset_imports=model.opset_import)
    from specdec.runners.standard import session_options

    rows = ort.InferenceSession(sub.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": np.arange(vocab, dtype=np.int64)[None]})[0][0]
    assert np.abs(rows - expected).max() < 1e-6
    if table is not None:
        assert (np.abs(rows - table) <= np.abs(np.repeat(scales, block, axis=1))[:, :hidden] + 1e-6).all()


@pytest.mark.integration
def test_tie_embeddings_stores_one_int4_table_for_an_untied_model(tmp_path):
    """--tie-embeddings on a model with two tables: the embedding reads the lm_head's int4 weights (stored once),
    the manifest says so, the bundle is smaller, and parity is against the tied model."""
    folder = build_tiny_model(tmp_path / "hf", "llama", seed=0)  # untied: two random tables
    sizes = {}
    for tie in (False, True):
        out = tmp_path / f"tie-{tie}"
        manifest = export_bundle(ExportOptions(target=str(folder), draft=None, out=out, quant="int4",
                                               quant_method="rtn", tie_embeddings=tie), progress=lambda msg: None)
        graph = onnx.load(str(out / "target/model.onnx"), load_external_data=False).graph
        gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
        reshape = next((n for n in graph.node if n.output[0] == gather.input[0]), None)
        data = reshape.input[0] if reshape is not None else gather.input[0]
        lm_head = next(n for n in graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits")
        assert (data == lm_head.input[1] and gather.input[2] == lm_head.input[2]) == tie
        assert manifest.extra.get("tied_embeddings") == ("lm_head" if tie else None)
        # parity against the tied model: the streamed export checks its int4 graph against the reference run
        # with the lm_head's table for both (the traced one checks its float graph)
        report = manifest.extra["parity_max_abs_error"]["target"]
        assert report.get("float", report.get("int4"))["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}
        if "float" in report:
            for scenario, errors in report["float"].items():
                assert errors["logits"] < TOLERANCE, (tie, scenario, errors)
        sizes[tie] = (out / "target/model.onnx.data").stat().st_size
    assert sizes[True] < sizes[False]


def test_tie_embeddings_refuses_tables_of_different_shapes():
    from specdec.export.bundle import tie_model_embeddings
    from specdec.export.worker import ExportError

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 12, bias=False)

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    with pytest.raises(ExportError, match="differ in shape"):
        tie_model_embeddings(Model())
