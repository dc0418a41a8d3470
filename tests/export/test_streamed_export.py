"""The streamed exporter (export/streamed.py): the fused graph built layer by layer from weights read one tensor at
a time. On the tiny models it gives the traced exporter's bundle (the same int4 weights: the same greedy tokens in
every mode, the same parity errors), its own graphs match the source model's layers, padded vocabularies pair,
tokenizers are compared by what they do, and the Q4_K quantizer is llama.cpp's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tiny_models import build_noisy_copy, build_tiny_model
from paths import DATA

pytest.importorskip("torch")
DATA = DATA


def _export(target, draft, out, **options):
    """``layer_products`` nbits unless given: ``auto`` depends on the CPU (the integer products: test_int8_rows.py)."""
    from specdec.export.bundle import ExportOptions, export_bundle

    options.setdefault("layer_products", "nbits")
    return export_bundle(ExportOptions(target=str(target), draft=str(draft) if draft else None, out=out, **options),
                         progress=lambda message: None)


@pytest.mark.integration
def test_streamed_int4_bundle_decodes_as_the_traced_one(tiny_pair_dirs, tmp_path):
    """Streamed (with the traced graph's GroupQueryAttention, --attention gqa) and traced exports of the tiny pair
    (int4, rtn): the same weight bytes (MLAS's projections, the embedding's blocks), so both models' parity errors
    are equal and every mode gives the same greedy tokens; the target's verify rows equal its one-token passes bit
    for bit. The default streamed export (folded attention, float16 KV) decodes each mode as its own target-only."""
    from specdec import SpeculativeDecoder

    target, draft = tiny_pair_dirs
    # one recipe for all three (auto is k-quant for float sources, whose traced path rounds through another writer)
    streamed = _export(target, draft, tmp_path / "streamed", quant="int4", exporter="streamed", attention="gqa",
                       quant_method="rtn")
    traced = _export(target, draft, tmp_path / "traced", quant="int4", exporter="traced", quant_method="rtn")
    folded = _export(target, draft, tmp_path / "folded", quant="int4", quant_method="rtn")
    assert streamed.extra["exporter"] == folded.extra["exporter"] == {"draft": "streamed", "target": "streamed"}
    assert traced.extra["exporter"] == {"draft": "traced", "target": "traced"}
    assert (folded.target.attention, folded.target.kv_dtype) == ("folded", "float16")
    errors = lambda manifest, role: manifest.extra["parity_max_abs_error"][role]["int4"]  # noqa: E731
    for role in ("target", "draft"):
        for scenario in ("prefill", "decode", "chain_verify", "tree", "rows_vs_decode"):
            assert errors(streamed, role)[scenario] == pytest.approx(errors(traced, role)[scenario], rel=1e-4)
    # the target's verify rows are its one-token passes bit for bit (what greedy identity needs; the draft only
    # proposes: its block-128 rows may round apart, the traced draft's alike)
    for manifest in (streamed, folded):
        assert errors(manifest, "target")["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}
    tokens = {}
    for name in ("streamed", "traced", "folded"):
        decoder = SpeculativeDecoder.load(tmp_path / name)
        tokens[name] = [decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=mode).token_ids
                        for prompt in ("def add(a, b):", "hello world") for mode in (0, 3, "auto")]
    assert tokens["streamed"] == tokens["traced"]
    assert tokens["folded"][0::3] == tokens["folded"][1::3] == tokens["folded"][2::3]  # every mode = target-only


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_streamed_float_graph_matches_the_source_models_layers(arch, tmp_path):
    """Each streamed architecture's float graph against its source model (the reference run one Hugging Face layer at a
    time): logits and every layer's KV rows within float rounding, in prefill, decode, chain verify and a tree."""
    model = build_tiny_model(tmp_path / "hf", arch, seed=0)
    manifest = _export(model, None, tmp_path / "bundle", exporter="streamed", kv_dtype="float32")
    report = manifest.extra["parity_max_abs_error"]["target"]["float"]
    assert manifest.extra["exporter"]["target"] == "streamed"
    for scenario, errors in report.items():
        assert errors["logits"] < 1e-4 and errors["kv"] < 1e-4, (scenario, errors)


@pytest.mark.integration
def test_a_planted_layer_bug_fails_the_streamed_parity(tmp_path, monkeypatch):
    """Planted: the streamed graph's residual add dropped in one place (the skip norm reads zeros) must show in the
    parity report the export writes."""
    from specdec.export import streamed

    original = streamed.FusedGraphBuilder.skip_norm

    def broken(self, x, residual, gamma, name):
        if name == "layers.0/ffn_norm":
            residual = self.w.one("Mul", [residual, self.w.constant([0.0], np.float32)], name="planted")
        return original(self, x, residual, gamma, name)

    monkeypatch.setattr(streamed.FusedGraphBuilder, "skip_norm", broken)
    monkeypatch.setattr("specdec.export.bundle.run_isolated", lambda function, *args: function(*args))
    model = build_tiny_model(tmp_path / "hf", "llama", seed=0)
    report = _export(model, None, tmp_path / "bundle", exporter="streamed",
                     kv_dtype="float32").extra["parity_max_abs_error"]
    assert report["target"]["float"]["prefill"]["logits"] > 1e-2


@pytest.mark.integration
def test_padded_vocabulary_pairs_with_an_unpadded_draft(tmp_path):
    """A target whose tables are padded beyond the tokenizer (as Qwen2.5 7B-32B's) pairs with a draft that is not:
    both bundles score the tokenizer's ids, and greedy speculation stays token-identical to target-only."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec import SpeculativeDecoder

    target = build_tiny_model(tmp_path / "target", "llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(target)
    model.resize_token_embeddings(136, mean_resizing=False)  # 8 padding rows no token id reaches
    with torch.no_grad():
        model.get_output_embeddings().weight[128:] = 5.0  # rows that would win every argmax if they were kept
    model.save_pretrained(target)
    draft = build_noisy_copy(build_tiny_model(tmp_path / "draft-base", "llama", seed=0), tmp_path / "draft",
                             noise=0.005, seed=1)
    manifest = _export(target, draft, tmp_path / "bundle", quant="int4")
    assert manifest.target.vocab_size == manifest.draft.vocab_size == 128
    decoder = SpeculativeDecoder.load(tmp_path / "bundle")
    baseline = decoder.generate("def add(a, b):", max_new_tokens=24, num_draft_tokens=0).token_ids
    assert all(t < 128 for t in baseline)
    assert decoder.generate("def add(a, b):", max_new_tokens=24, num_draft_tokens=3).token_ids == baseline


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_tokenizers_are_compared_by_what_they_do(tmp_path):
    """A tokenizer.json without a normalizer and one with a normalizer that changes nothing agree (as a GGUF's and a
    Hugging Face folder's of one model do); a swapped token is refused naming its id."""
    pytest.importorskip("transformers")
    from specdec.export.compat import IncompatiblePair, check_tokenizers
    from tiny_models import tiny_tokenizer

    base = tiny_tokenizer()
    base.save_pretrained(tmp_path / "a")
    data = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    assert data["normalizer"] is None
    data["normalizer"] = {"type": "Sequence", "normalizers": []}
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(data))
    check_tokenizers(_tokenizer(tmp_path / "a"), _tokenizer(tmp_path / "b"))
    vocab = data["model"]["vocab"]
    data["model"]["vocab"] = {("Z" if k == "A" else "A" if k == "Z" else k): v for k, v in vocab.items()}
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(IncompatiblePair, match=f"token id {vocab['A']}: 'A' in the target, 'Z' in the draft"):
        check_tokenizers(_tokenizer(tmp_path / "a"), _tokenizer(tmp_path / "b"))


@pytest.mark.parametrize("name", ["normal", "heavy", "positive"])
def test_q4_k_is_llama_cpps(name):
    """Against llama.cpp's own quantize_row_q4_K_ref (tests/data/q4_k_llama_cpp.npz, through its ggml library): the
    same 4-bit values but for ties, the same squared error to 0.1%."""
    from specdec.export.gguf_blocks import grid_of
    from specdec.export.kquant import q4_k_grid

    data = np.load(DATA / "q4_k_llama_cpp.npz")
    weight, reference = data[f"{name}_weight"], grid_of(data[f"{name}_q4_k"], "Q4_K")
    ours = q4_k_grid(weight)
    assert (ours.q == reference.q).mean() > 0.995
    error = lambda grid: float(np.square(grid.values() - weight).sum())  # noqa: E731
    assert error(ours) == pytest.approx(error(reference), rel=1e-3)


def test_a_planted_search_bug_is_caught_by_the_llama_cpp_reference(monkeypatch):
    """Planted: the search with its moving minimum removed (every candidate rounds against the first minimum, as an
    earlier version did) leaves the llama.cpp reference."""
    from specdec.export import kquant
    from specdec.export.gguf_blocks import grid_of

    monkeypatch.setattr(kquant, "STEPS", 0)
    data = np.load(DATA / "q4_k_llama_cpp.npz")
    ours, reference = kquant.q4_k_grid(data["heavy_weight"]), grid_of(data["heavy_q4_k"], "Q4_K")
    assert (ours.q == reference.q).mean() < 0.995


def _weighted_error(grid, weight):
    """llama.cpp's importance-weighted squared error (rms of the block + |w|), summed."""
    blocks = weight.reshape(-1, 32)
    importance = np.sqrt(np.square(blocks).mean(-1, keepdims=True)) + np.abs(blocks)
    return float((importance * np.square(grid.values().reshape(-1, 32) - blocks)).sum())


def test_rows_that_are_not_whole_super_blocks_keep_the_search_with_float_scales():
    """896-wide rows (the Qwen2.5 0.5B's projections) are no whole Q4_K super-blocks: ``float_k_grid`` gives them the same
    scale/minimum search with the scales kept as floats, which fits them better than symmetric rounding (what they
    got before) and at least as well as Q4_K's 6-bit scales where both apply."""
    from specdec.export.kquant import float_k_grid, q4_k_grid, symmetric_grid

    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((64, 896)) * 0.02 + 0.004).astype(np.float32)
    weight[:, ::131] *= 8  # a few outlier columns, as trained projections have
    grid = float_k_grid(weight)
    assert grid.correction is not None and grid.q.max() <= 15 and grid.scale.shape == (64, 28)
    assert np.sqrt(np.mean(np.square(grid.values() - weight))) < 0.5 * grid.scale.mean()
    fitted, symmetric = _weighted_error(grid, weight), _weighted_error(symmetric_grid(weight, 4), weight)
    assert fitted < 0.6 * symmetric, (fitted, symmetric)
    whole = weight[:, :768]  # three super-blocks: both apply
    assert _weighted_error(float_k_grid(whole), whole) <= _weighted_error(q4_k_grid(whole), whole) * 1.001
    flat = np.full((2, 64), -0.5, np.float32)
    flat[1] = 0.0
    assert np.array_equal(float_k_grid(flat).values(), flat)  # a flat block is its minimum
    with pytest.raises(ValueError, match="whole blocks of 32"):
        float_k_grid(weight[:, :100])


def test_k_quant_exports_rows_not_whole_super_blocks_with_float_scales(tmp_path):
    """The streamed k-quant export of a model whose widths are no multiple of 256 (the tiny test model's 64) stores
    every 4-bit projection and the table through the float-scale search, none by symmetric rounding."""
    from specdec.export.weight_plan import WeightPlan, WeightQuantizer

    rng = np.random.default_rng(0)
    quantizer = WeightQuantizer(WeightPlan("int4", "k-quant"), weights=None, layers=2)
    quantizer.parts([rng.standard_normal((96, 64)).astype(np.float32)], ["model.layers.0.mlp.up_proj.weight"],
                    "ffn_gate_up", 0)
    quantizer.embedding(rng.standard_normal((50, 64)).astype(np.float32))
    stored = quantizer.report["stored"]
    assert stored == {"k-quant with float scales (rows not whole Q4_K super-blocks)": 2}, stored


def test_a_draft_rounds_what_q4_k_does_not_hold_symmetric(tmp_path):
    """A draft's quality only moves acceptance: its int4 recipe has no float scales (the search's correction rows
    made the real draft's steps 1.12-1.15x dearer for +0.01 acceptance), so its 896-wide rows and table are
    rounded symmetric, while the target's recipe keeps the search."""
    from specdec.export.bundle import ExportOptions
    from specdec.export.weight_plan import WeightQuantizer

    options = ExportOptions("t", "d", tmp_path, quant="int4", quant_method="k-quant")
    assert options.recipe_for("target").float_scales and not options.recipe_for("draft").float_scales
    assert options.weight_plan("target").float_scales and not options.weight_plan("draft").float_scales
    int8 = ExportOptions("t", "d", tmp_path, quant="int8", quant_method="rtn")
    assert int8.recipe_for("draft") == int8.recipe_for("target")
    rng = np.random.default_rng(0)
    quantizer = WeightQuantizer(options.weight_plan("draft"), weights=None, layers=2)
    quantizer.parts([rng.standard_normal((96, 64)).astype(np.float32)], ["model.layers.0.mlp.up_proj.weight"],
                    "ffn_gate_up", 0)
    quantizer.embedding(rng.standard_normal((50, 64)).astype(np.float32))
    assert quantizer.report["stored"] == {"symmetric 4-bit, block 32 (rows not whole Q4_K super-blocks)": 1,
                                          f"symmetric 4-bit, block {options.draft_block_size}": 1}


def test_the_graph_writer_keeps_only_references_to_what_it_wrote(tmp_path):
    """An initializer goes to the data file at once (page-aligned when large); the graph holds its offset, and the
    model reads back the same arrays."""
    import onnx
    from onnx import numpy_helper

    from specdec.contract.manifest import TensorSpec
    from specdec.export.graph_writer import GraphWriter

    writer = GraphWriter(tmp_path)
    big = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    small = np.array([1, 2, 3], np.int64)
    writer.initializer("big", big)
    writer.initializer("small", small)
    out = writer.one("MatMul", ["x", "big"], name="mm")
    writer.node("Identity", [out], ["y"], name="id")
    tensor = writer.graph.initializer[0]
    assert not tensor.raw_data and int(dict((e.key, e.value) for e in tensor.external_data)["offset"]) % 4096 == 0
    path = writer.finish((TensorSpec("x", "float32", ("batch", 600)),), (TensorSpec("y", "float32", ("batch", 500)),))
    model = onnx.load(str(path))
    loaded = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert np.array_equal(loaded["big"], big) and np.array_equal(loaded["small"], small)


def test_gguf_weights_undo_llamas_rotary_row_order(tmp_path):
    """A Llama GGUF stores q and k rows permuted for llama.cpp's rotary layout; GGUFWeights gives them back in Hugging
    Face's order (transformers' reverse permute), for floats and for carried grids alike."""
    gguf = pytest.importorskip("gguf")
    from specdec.export.tensors import GGUFWeights

    heads, kv_heads, head_dim, hidden = 4, 2, 8, 32
    rng = np.random.default_rng(0)
    q = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, hidden)).astype(np.float32)

    def permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", permute(q, heads))
    writer.add_tensor("blk.0.attn_k.weight", permute(k, kv_heads))
    writer.add_tensor("blk.0.attn_v.weight", k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = GGUFWeights(tmp_path / "m.gguf", heads, kv_heads)
    assert np.array_equal(weights.get("model.layers.0.self_attn.q_proj.weight"), q)
    assert np.array_equal(weights.get("model.layers.0.self_attn.k_proj.weight"), k)
    assert np.array_equal(weights.get("model.layers.0.self_attn.v_proj.weight"), k)  # v is stored as it is
