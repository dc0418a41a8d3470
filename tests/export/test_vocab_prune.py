"""A pruned draft vocabulary (FR-Spec): logits mapping, corpus counts, the ONNX transform, exactness of decoding."""

import hashlib

import numpy as np
import pytest

from specdec.contract.manifest import BundleError, Manifest
from specdec.sampling.processors import SamplingConfig, sampling_distribution
from specdec.runners.vocab_map import check_kept_ids, expand_logits, expand_logits_into, load_kept_ids

KEPT = np.array([1, 4, 5, 9], dtype=np.int64)


def test_expand_logits_places_columns_and_minus_infinity_elsewhere():
    """Column k of the pruned logits lands at kept_ids[k]; every other id is -inf."""
    sub = np.arange(8, dtype=np.float32).reshape(2, 4)
    full = expand_logits(sub, KEPT, 12)
    assert full.shape == (2, 12) and np.array_equal(full[:, KEPT], sub)
    assert np.all(np.isneginf(np.delete(full, KEPT, axis=1)))


def test_expand_into_rewrites_every_cell_of_a_dirty_buffer():
    """The in-place variant must not leave a previous step's (or a sampler's in-place) values behind."""
    buffer = np.full((3, 12), 7.0, dtype=np.float32)
    out = expand_logits_into(np.zeros((2, 4), dtype=np.float32), KEPT, buffer[:2])
    assert out.base is buffer or out is buffer[:2] or np.shares_memory(out, buffer)
    assert np.all(np.isneginf(np.delete(buffer[:2], KEPT, axis=1))) and np.all(buffer[2] == 7.0)


@pytest.mark.parametrize("config", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9),
                                    SamplingConfig(temperature=1.3, top_k=3, repetition_penalty=1.2),
                                    SamplingConfig(temperature=2.0, min_p=0.01)])
def test_the_drafts_distribution_has_zero_mass_outside_the_subset(config):
    """q (what the draft samples from) is exactly 0 off the subset, after every processor; a fill of 0 would not be."""
    rng = np.random.default_rng(0)
    sub = rng.normal(size=(1, 4)).astype(np.float32) * 3
    context = np.array([0, 4, 7], dtype=np.int64)  # the penalty touches a kept and a pruned id
    q = sampling_distribution(expand_logits(sub, KEPT, 12)[0], context, config)
    assert np.all(np.delete(q, KEPT) == 0.0) and q.sum() == pytest.approx(1.0)
    planted = np.zeros((1, 12), dtype=np.float32)  # negative control: pruned ids at logit 0
    planted[:, KEPT] = sub - 20  # every kept logit below the fill: a fill of 0 must show up
    assert np.delete(sampling_distribution(planted[0], context, config), KEPT).sum() > 0


@pytest.mark.parametrize("ids,width,message", [
    ([4, 1, 5], None, "ascending"), ([1, 1, 5], None, "ascending"), ([1, 12], None, "0..11"),
    ([[1, 2]], None, "1-D"), ([1.0, 2.0], None, "integer"), ([1, 2, 3], 4, "4 columns"),
])
def test_bad_subsets_are_refused(ids, width, message):
    """A subset that would map logits to the wrong ids is a bundle error, named."""
    with pytest.raises(BundleError, match=message):
        check_kept_ids(np.array(ids), 12, width)


def test_frequencies_and_kept_ids_from_a_corpus():
    """Counts are per token id; the K most frequent are kept (ties: lower id), EOS always."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specdec.export.vocab_prune import PruneError, choose_kept_ids, stdlib_corpus, token_frequencies

    vocab = {c: i for i, c in enumerate("abcdefgh")}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="h"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    counts = token_frequencies(tokenizer, ["aaab", "bcc", "a"], 8)
    assert counts.tolist() == [4, 2, 2, 0, 0, 0, 0, 0]
    assert choose_kept_ids(counts, 2).tolist() == [0, 1]  # b and c tie: the lower id
    assert choose_kept_ids(counts, 3, always=[7]).tolist() == [0, 1, 7]
    with pytest.raises(PruneError, match="between 2 and 7"):
        choose_kept_ids(counts, 8, always=[7])
    texts = stdlib_corpus(max_chars=50_000)
    assert sum(map(len, texts)) == 50_000 and any("def " in t for t in texts)


# ---------------------------------------------------------------- on a tiny exported bundle

@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.py").write_text("def add(a, b):\n    return a + b\n" * 50)
    (folder / "notes.md").write_text("Once upon a time there was a tiny model.\n" * 20)
    (folder / "blob.bin").write_bytes(bytes(range(256)))  # not a text suffix: ignored
    return folder


def _tree_hashes(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=["tiny_bundle", "tiny_standard_bundle"], ids=["fused", "standard"])
def pruned_bundle(request, corpus_dir, tmp_path_factory):
    """(pruned bundle dir, its manifest), pruned from the tiny pair in each graph form."""
    from specdec.export.vocab_prune import prune_bundle

    source = request.getfixturevalue(request.param)
    before = _tree_hashes(source)
    out = tmp_path_factory.mktemp("pruned") / "tiny-k48"
    manifest = prune_bundle(source, 48, out, corpus_dir)
    assert _tree_hashes(source) == before  # the source bundle is only read
    from specdec.contract.bundle import open_bundle

    assert manifest.target == open_bundle(source).target  # the target is untouched
    form = {"tiny_bundle": "fused", "tiny_standard_bundle": "standard"}[request.param]
    assert manifest.draft.graph == open_bundle(source).draft.graph == form
    return out, manifest, source


@pytest.mark.integration
def test_pruned_bundle_records_and_hashes_the_subset(pruned_bundle):
    """The manifest names the subset file, hashes it, declares logits of width K and refuses nothing at load."""
    from specdec.contract.bundle import open_bundle

    out, manifest, _ = pruned_bundle
    assert manifest.draft.vocab_subset == "draft/vocab_subset.npy" and manifest.draft.vocab_subset in manifest.files
    assert next(s for s in manifest.draft.outputs if s.name == "logits").shape[-1] == 48
    kept = load_kept_ids(out, open_bundle(out).draft)
    assert len(kept) == 48 and 1 in kept  # EOS (id 1) is always kept
    assert manifest.extra["draft_vocab"]["max_abs_error_on_kept_logits"] < 1e-5


@pytest.mark.integration
def test_pruned_logits_equal_the_full_drafts_on_the_kept_ids(pruned_bundle):
    """Same inputs through the runtime's runner for the form, a 5-token pass after a 3-token past: the pruned
    draft's logits == the full draft's on the kept ids (float32 bundle, exact up to rounding), -inf elsewhere."""
    from specdec.runners.factory import make_runner

    out, manifest, source = pruned_bundle
    kept = load_kept_ids(out, manifest.draft)
    rows = []
    for root, kept_ids in ((source, None), (out, kept)):
        spec = Manifest.read(root).draft
        runner = make_runner(str(root / spec.onnx_file), spec, "cpu", 16, 8, kept_ids=kept_ids)
        runner.forward([3, 40, 41], range(3))
        runner.commit(3)
        rows.append(runner.forward([42, 10, 7, 8, 9], range(3, 8)).copy())
    full, pruned = rows
    assert pruned.shape == full.shape == (5, manifest.draft.vocab_size) and runner.logits_width == 48
    np.testing.assert_allclose(pruned[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.delete(pruned, kept, axis=1)))


def _load_with_pruned_draft(bundle):
    """Load ``bundle``: the runner maps the pruned draft's K logits back to the full vocabulary itself."""
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(bundle)
    kept = load_kept_ids(bundle, decoder.draft.spec)
    assert decoder.draft.logits_width == len(kept) < decoder.draft.spec.vocab_size
    return decoder, kept


@pytest.mark.integration
def test_greedy_speculation_with_a_pruned_draft_equals_target_only(pruned_bundle):
    """The draft can propose only kept ids, yet greedy output == target-only for every g (the target decides)."""
    out, _, _ = pruned_bundle
    decoder, kept = _load_with_pruned_draft(out)
    for prompt in ("def add(a, b):\n    return", "Once upon a time"):
        baseline = decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=0)
        for gamma in (1, 3, "auto"):
            result = decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=gamma, proposer="draft")
            assert result.token_ids == baseline.token_ids, (prompt, gamma)


@pytest.mark.integration
def test_sampling_with_a_pruned_draft_runs_and_is_reproducible(pruned_bundle):
    """Sampled speculation with q = 0 off the subset: proposals are made and tested, same seed -> same tokens."""
    out, _, _ = pruned_bundle
    decoder, _ = _load_with_pruned_draft(out)
    config = SamplingConfig(temperature=0.8)
    runs = [decoder.generate("def f(x):", max_new_tokens=24, num_draft_tokens=2, proposer="draft",
                             sampling=config, seed=3) for _ in range(2)]
    assert runs[0].stats.proposed > 0 and len(runs[0].token_ids) == 24
    assert runs[0].token_ids == runs[1].token_ids


def test_prune_refuses_bad_requests(tiny_standard_bundle, pruned_bundle, tmp_path, corpus_dir):
    """Out = source, an already pruned draft, K out of range: one clear error each, nothing written."""
    from specdec.export.vocab_prune import PruneError, prune_bundle

    with pytest.raises(PruneError, match="new folder outside"):
        prune_bundle(tiny_standard_bundle, 48, tiny_standard_bundle)
    with pytest.raises(PruneError, match="already pruned"):
        prune_bundle(pruned_bundle[0], 32, tmp_path / "again", corpus_dir)
    with pytest.raises(PruneError, match="--draft-vocab 128 must be between"):
        prune_bundle(tiny_standard_bundle, 128, tmp_path / "k128", corpus_dir)
    assert not (tmp_path / "k128").exists() and not list(tmp_path.glob(".k128*"))


def test_cli_prunes_into_a_new_folder(tiny_standard_bundle, corpus_dir, tmp_path):
    """specdec-export --prune-draft-vocab BUNDLE K --out NEW: exit 0 and a loadable bundle; bad K: exit 2, one line."""
    from specdec.export.cli import main

    assert main(["--prune-draft-vocab", str(tiny_standard_bundle), "32", "--out", str(tmp_path / "k32"),
                 "--draft-vocab-corpus", str(corpus_dir)]) == 0
    assert (tmp_path / "k32" / "draft" / "vocab_subset.npy").is_file()
    assert main(["--prune-draft-vocab", str(tiny_standard_bundle), "many", "--out", str(tmp_path / "x")]) == 2


# ---------------------------------------------------------------- lm_head forms, on one-node graphs

HIDDEN, VOCAB, K_KEPT = 64, 96, 20


def _head_graph(form: str):
    """x [1, T, H] -> lm_head -> logits [1, T, V] in one of the forms an exporter or quantizer writes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    weight = rng.normal(size=(HIDDEN, VOCAB)).astype(np.float32)
    nodes, inits = [], []
    if form == "tied":  # lm_head = Transpose(embedding [V, H])
        inits.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), "embed"))
        nodes.append(helper.make_node("Transpose", ["embed"], ["w"], perm=[1, 0]))
        nodes.append(helper.make_node("Gather", ["embed", "ids"], ["rows"]))  # the embedding's own reader
        inits.append(numpy_helper.from_array(np.array([0, VOCAB - 1], dtype=np.int64), "ids"))
    elif form == "gemm":
        inits.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), "w"))
        inits.append(numpy_helper.from_array(rng.normal(size=VOCAB).astype(np.float32), "bias"))
    else:
        inits.append(numpy_helper.from_array(weight, "w"))
    if form == "gemm":
        nodes += [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
                  helper.make_node("Gemm", ["x2", "w", "bias"], ["logits"], transB=1)]
        inits.append(numpy_helper.from_array(np.array([-1, HIDDEN], dtype=np.int64), "flat"))
        shape = ["tokens", VOCAB]
    elif form == "softcap":  # Gemma-style: tanh(z / c) * c after the MatMul
        inits.append(numpy_helper.from_array(np.array(30.0, dtype=np.float32), "cap"))
        nodes += [helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Div", ["z", "cap"], ["d"]),
                  helper.make_node("Tanh", ["d"], ["t"]), helper.make_node("Mul", ["t", "cap"], ["logits"])]
        shape = [1, "tokens", VOCAB]
    else:
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["logits"]))
        shape = [1, "tokens", VOCAB]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "tokens", HIDDEN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)]
                              + ([helper.make_tensor_value_info("rows", TensorProto.FLOAT, [2, HIDDEN])]
                                 if form == "tied" else []), initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    if form == "nbits":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4)
        quantizer.process()
        model = quantizer.model.model
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("form", ["matmul", "tied", "gemm", "softcap", "nbits"])
def test_every_lm_head_form_is_sliced_to_the_kept_rows(form):
    """Pruned graph output == full graph output[..., kept] for MatMul, tied Transpose, Gemm, soft-cap, MatMulNBits."""
    import onnxruntime as ort

    from specdec.export.vocab_prune import prune_lm_head
    from specdec.runners.standard import session_options

    model = _head_graph(form)
    kept = np.sort(np.random.default_rng(2).choice(VOCAB, K_KEPT, replace=False)).astype(np.int64)
    x = {"x": np.random.default_rng(3).normal(size=(1, 3, HIDDEN)).astype(np.float32)}
    full = ort.InferenceSession(model.SerializeToString(), session_options()).run(["logits"], x)[0]
    found = prune_lm_head(model, kept, VOCAB)
    assert found == {"tied": "MatMul", "softcap": "MatMul"}.get(form, {"nbits": "MatMulNBits"}.get(form, found))
    pruned = ort.InferenceSession(model.SerializeToString(), session_options()).run(["logits"], x)[0]
    assert pruned.shape[-1] == K_KEPT
    np.testing.assert_allclose(pruned, full[..., kept], rtol=1e-6, atol=1e-6)
    if form == "tied":  # the shared embedding is left as it was, full vocabulary
        embed = next(t for t in model.graph.initializer if t.name == "embed")
        assert list(embed.dims) == [VOCAB, HIDDEN]
        assert not any(n.op_type == "Transpose" for n in model.graph.node)  # the old lm_head path is gone


def test_an_lm_head_it_does_not_understand_is_refused():
    """logits from something other than a constant-weight projection: a clear PruneError, not a wrong graph."""
    from onnx import TensorProto, helper

    from specdec.export.vocab_prune import PruneError, prune_lm_head

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, HIDDEN]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [HIDDEN, VOCAB])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, VOCAB])])
    with pytest.raises(PruneError, match="not a constant"):
        prune_lm_head(helper.make_model(graph), np.arange(4), VOCAB)
