"""--quant-method gguf: a GGUF's blocks carried into MatMulNBits / GatherBlockQuantized.

The GGUFs here are written by the gguf package's own writer from random raw blocks of each carried type; the
reference is the gguf package's ``dequantize`` (what transformers loads a GGUF with). A planted bug (the Q4_K
minimum's remainder dropped) must fail the same check."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from specdec.export import gguf_blocks, gguf_carry, nbits  # noqa: E402

K, VOCAB = 512, 48
BYTES = {"Q4_K": 144, "Q6_K": 210, "Q5_0": 22, "Q8_0": 34}
WEIGHTS = {"Q4_K": 256, "Q6_K": 256, "Q5_0": 32, "Q8_0": 32}


def _fp16_bytes(rng, count, low, high):
    return rng.uniform(low, high, count).astype(np.float16).view(np.uint8).reshape(count, 2)


def raw_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid random blocks (finite scales) of a GGUF type."""
    rng = np.random.default_rng(seed)
    count = rows * k // WEIGHTS[kind]
    blocks = rng.integers(0, 256, (count, BYTES[kind]), dtype=np.uint8)
    if kind == "Q4_K":  # as llama.cpp writes them: sub-block minimums within the sub-block's 16 steps
        d = rng.uniform(1e-3, 4e-3, count)
        blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(count, 2)
        blocks[:, 2:4] = (d * rng.uniform(0.5, 1.8, count)).astype(np.float16).view(np.uint8).reshape(count, 2)
        sc, mn = rng.integers(8, 64, (count, 8)), rng.integers(0, 64, (count, 8))
        blocks[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)  # the 6-bit scales and minimums, packed as Q4_K packs
        blocks[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
        blocks[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    elif kind == "Q6_K":
        blocks[:, 208:210] = _fp16_bytes(rng, count, 1e-4, 5e-4)
        scales = rng.integers(-40, 40, (count, 16)).astype(np.int8)
        scales[: count // 2, 1::2] = scales[: count // 2, 0::2] * 2  # half the blocks: scales with a common factor
        blocks[:, 192:208] = scales.view(np.uint8)
    else:
        blocks[:, 0:2] = _fp16_bytes(rng, count, 1e-3, 4e-3)
    return blocks.reshape(rows, -1)


def dequantized(kind: str, data: np.ndarray) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(data.shape[0], -1)


@pytest.mark.parametrize("kind", gguf_blocks.KINDS)
def test_grid_values_equal_the_gguf_dequantization(kind):
    data = raw_blocks(kind, 8, K, 1)
    grid = gguf_blocks.grid_of(data, kind)
    reference = dequantized(kind, data)
    error = np.abs(grid.values() - reference).max()
    if kind == "Q6_K":  # exact where a common factor exists, else the nearest 8-bit value
        assert 0.4 < grid.exact_blocks < 1.0
        step = np.abs(reference).max() / 32
        assert error <= step / 8
    else:
        assert error <= 1e-6 * np.abs(reference).max(), error
        assert grid.exact_blocks == 1.0
    assert grid.q.max() < 2 ** grid.bits


def _plain_rtn_error(values: np.ndarray) -> np.ndarray:
    """[rows, blocks] squared error of round-to-nearest at max |w| / 7 (what the search must never lose to)."""
    blocks = values.reshape(values.shape[0], -1, gguf_blocks.BLOCK)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 7
    scale[scale == 0] = 1.0  # an all-zero block (Q6_K sub-block scales of 0)
    return ((blocks - np.clip(np.rint(blocks / scale), -8, 7) * scale) ** 2).sum(axis=-1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q8_0", "Q6_K"])
def test_a_drafts_rounding_to_4_bits_is_symmetric_round_to_nearest(kind):
    """Without float scales (a draft's): each block at max |w| / 7 with zero point 8, no correction rows."""
    from specdec.export import kquant

    grid = gguf_blocks.grid_of(raw_blocks(kind, 64, K, 3), kind)
    rounded = kquant.narrowed(grid, float_scales=False)
    assert rounded.bits == 4 and rounded.q.max() <= 15 and rounded.q.min() >= 1 and (rounded.zero == 8).all()
    assert rounded.correction is None
    error = ((rounded.values() - grid.values()).reshape(64, -1, gguf_blocks.BLOCK) ** 2).sum(axis=-1)
    np.testing.assert_allclose(error, np.nan_to_num(_plain_rtn_error(grid.values())), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("kind", ["Q5_0", "Q8_0", "Q6_K"])
def test_wider_types_narrow_to_a_4_bit_grid_closer_than_symmetric_rounding(kind):
    """gguf-int4 puts a wider type's values on a 4-bit grid by the k-quant search with float scales
    (kquant.narrowed): 4-bit values, an RMS error below half a step, and an importance-weighted error below
    symmetric round-to-nearest at max |w| / 7 (what these tensors got before; the planted rule fails)."""
    from specdec.export import kquant

    grid = gguf_blocks.grid_of(raw_blocks(kind, 64, K, 3), kind)
    values = grid.values()
    narrow = kquant.narrowed(grid)
    assert narrow.bits == 4 and narrow.q.max() <= 15 and narrow.exact_blocks == 0.0
    assert np.sqrt(np.mean(np.square(narrow.values() - values))) < 0.5 * narrow.scale.mean()
    blocks = values.reshape(64, -1, gguf_blocks.BLOCK)
    importance = np.sqrt(np.square(blocks).mean(-1, keepdims=True)) + np.abs(blocks)
    weighted = lambda g: float((importance * (g.values().reshape(blocks.shape) - blocks) ** 2).sum())  # noqa: E731
    symmetric = kquant.symmetric_grid(values, 4)
    assert weighted(narrow) < 0.8 * weighted(symmetric), (weighted(narrow), weighted(symmetric))
    four = kquant.q4_k_grid(values)
    assert kquant.narrowed(four) is four and kquant.narrowed(four, float_scales=False) is four  # kept as it is


def _write_gguf(path, tensors: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _model(qkv: np.ndarray, down: np.ndarray, table: np.ndarray):
    """input_ids -> Gather(table) -> MatMul(qkv) -> MatMul(down) ; the graph form the exporter writes."""
    inits = [numpy_helper.from_array(qkv, "qkv.weight"), numpy_helper.from_array(down, "down.weight"),
             numpy_helper.from_array(table, "embed.weight")]
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"], name="embed"),
             helper.make_node("MatMul", ["h", "qkv.weight"], ["qkv"], name="qkv_proj"),
             helper.make_node("MatMul", ["qkv", "down.weight"], ["y"], name="down_proj")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("qkv", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, ids):
    import onnxruntime as ort

    from specdec.runners.standard import session_options

    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(["y", "qkv"], {"input_ids": ids})


@pytest.fixture
def pair(tmp_path):
    """(gguf path, float model, its dequantized weights): q and k Q4_K, v Q6_K side by side, down Q8_0, the
    embedding Q4_K."""
    raw = {"blk.0.attn_q.weight": ("Q4_K", raw_blocks("Q4_K", 256, K, 2)),
           "blk.0.attn_k.weight": ("Q4_K", raw_blocks("Q4_K", 64, K, 3)),
           "blk.0.attn_v.weight": ("Q6_K", raw_blocks("Q6_K", 64, K, 4)),
           "blk.0.ffn_down.weight": ("Q8_0", raw_blocks("Q8_0", 96, 384, 5)),
           "token_embd.weight": ("Q4_K", raw_blocks("Q4_K", VOCAB, K, 6))}
    path = tmp_path / "m.gguf"
    _write_gguf(path, raw)
    deq = {name: dequantized(kind, data) for name, (kind, data) in raw.items()}
    qkv = np.concatenate([deq[f"blk.0.attn_{p}.weight"] for p in "qkv"], axis=0).T.copy()
    return path, _model(qkv, deq["blk.0.ffn_down.weight"].T.copy(), deq["token_embd.weight"])


def _carried_error(pair, accuracy_level=0):
    path, model = pair
    ids = np.array([[3, 17, 40, 5]], np.int64)
    reference = _run(model, ids)
    carried = onnx.ModelProto()
    carried.CopyFrom(model)
    report = gguf_carry.carry_gguf_weights(carried, path, accuracy_level)
    ops = [n.op_type for n in carried.graph.node]
    out = _run(carried, ids)
    errors = [np.abs(o - r).max() / np.abs(r).max() for o, r in zip(out, reference)]
    return report, ops, errors


def test_carried_graph_computes_the_gguf_weights(pair):
    report, ops, errors = _carried_error(pair)
    assert report.carried == {"Q4_K": 3, "Q6_K": 1, "Q8_0": 1} and not report.left
    assert "MatMul" not in ops and "Gather" in ops and "GatherBlockQuantized" in ops
    assert ops.count("MatMulNBits") == 3  # q+k (4-bit), v (8-bit), down (8-bit)
    assert max(errors) < 6e-3, errors  # symmetric int4 round-to-nearest of the same weights: ~3.5e-2


def test_planted_bug_dropping_the_q4k_minimum_fails(pair, monkeypatch):
    def no_corrections(correction):
        rows = 2 * (-(-correction.shape[1] // 32) * 32)
        return np.full((correction.shape[0], rows), 8, np.uint8), np.ones((correction.shape[0], rows // 32), np.float32)

    monkeypatch.setattr(nbits, "correction_rows", no_corrections)  # where pack_grid reads it
    _, _, errors = _carried_error(pair)
    assert max(errors) > 1.5e-2, errors


def test_weights_not_in_the_gguf_are_left_to_the_generic_method(pair, tmp_path):
    _, model = pair
    other = tmp_path / "other.gguf"
    _write_gguf(other, {"token_embd.weight": ("Q8_0", raw_blocks("Q8_0", 7, 64, 9))})
    report = gguf_carry.carry_gguf_weights(model, other, 0)
    assert report.carried == {} and sorted(report.left) == ["down.weight", "embed.weight", "qkv.weight"]
    assert [n.op_type for n in model.graph.node] == ["Gather", "MatMul", "MatMul"]


def test_narrow_rounds_the_wider_types_to_4_bits_but_the_named_weights(pair):
    path, model = pair
    ids = np.array([[3, 17, 40, 5]], np.int64)
    reference = _run(model, ids)
    report = gguf_carry.carry_gguf_weights(model, path, 0, narrow=True, wide_weights=frozenset({"down.weight"}))
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node
            if n.op_type == "MatMulNBits"}
    assert bits == {"qkv_proj_carried0": 4, "down_proj_carried0": 8}  # q, k and the rounded v in one node
    assert report.exact_blocks["Q6_K"] == 0.0 and report.exact_blocks["Q4_K"] == 1.0
    qkv = _run(model, ids)[1]
    q_columns = slice(0, 320)  # q and k: still the GGUF's own Q4_K blocks
    error = np.abs(qkv[..., q_columns] - reference[1][..., q_columns]).max() / np.abs(reference[1]).max()
    assert error < 6e-3


def test_narrow_keeps_the_wide_roles_at_their_width_inside_a_packed_weight(pair):
    """``wide_roles={"attn_v"}``: v (Q6_K) stays 8-bit though it shares the packed QKV with 4-bit q and k: two
    MatMulNBits runs and a Concat, v's columns at the Q6_K values (narrowed to 4 bits, ~13x further off)."""
    path, model = pair
    ids = np.array([[3, 17, 40, 5]], np.int64)
    reference = _run(model, ids)
    rounded = onnx.ModelProto()
    rounded.CopyFrom(model)
    gguf_carry.carry_gguf_weights(rounded, path, 0, narrow=True)
    report = gguf_carry.carry_gguf_weights(model, path, 0, narrow=True, wide_roles=frozenset({"attn_v"}))
    nodes = {n.name: n for n in model.graph.node}
    bits = {name: next(a.i for a in n.attribute if a.name == "bits") for name, n in nodes.items()
            if n.op_type == "MatMulNBits"}
    assert sorted(bits.values()) == [4, 4, 8]  # q+k, v (8-bit), down (Q8_0 rounded: not a wide role)
    assert any(n.op_type == "Concat" for n in model.graph.node)
    assert report.exact_blocks["Q6_K"] > 0.4  # the carried v holds over half its Q6_K blocks exactly (grid test above)
    assert report.to_dict()["rounded_to_4_bits"] == {"Q8_0": 1}  # down; v kept: the manifest tells the two apart
    v_columns = slice(320, 384)
    scale = np.abs(reference[1][..., v_columns]).max()
    kept = np.abs(_run(model, ids)[1][..., v_columns] - reference[1][..., v_columns]).max() / scale
    lost = np.abs(_run(rounded, ids)[1][..., v_columns] - reference[1][..., v_columns]).max() / scale
    assert kept < 6e-3 and lost > 1.2e-2, (kept, lost)  # measured: 2.0e-3 and 2.7e-2 (6.0e-2 rounded symmetric)


@pytest.mark.parametrize("name,role", [("blk.3.attn_v.weight", "attn_v"), ("blk.12.ffn_down.weight", "ffn_down"),
                                       ("output.weight", ""), ("token_embd.weight", ""), ("blk.x.attn_v.weight", ""),
                                       ("blk.3.attn_v.bias", "")])
def test_block_role_of_a_gguf_tensor_name(name, role):
    assert gguf_carry.block_role(name) == role


def test_gguf_int4_passes_its_wide_roles_to_the_carrying(monkeypatch, tmp_path):
    """The method, not only the function: gguf-int4 narrows but keeps GGUF_INT4_WIDE_ROLES; gguf keeps all; the
    recipe's float_scales (False for a draft) reaches the narrowing."""
    from specdec.export import quantize

    calls = []

    def recording(model, path, level, narrow=False, wide_weights=frozenset(), wide_roles=frozenset(),
                  float_scales=True):
        calls.append((narrow, wide_roles, float_scales))
        raise RuntimeError("stop after the call")

    monkeypatch.setattr(gguf_carry, "carry_gguf_weights", recording)
    model = _model(np.zeros((K, 8), np.float32), np.zeros((8, 4), np.float32), np.zeros((VOCAB, K), np.float32))
    source = tmp_path / "m.onnx"
    onnx.save(model, str(source))
    for recipe in (quantize.QuantRecipe("gguf-int4"), quantize.QuantRecipe("gguf"),
                   quantize.QuantRecipe("gguf-int4", float_scales=False)):
        with pytest.raises(RuntimeError, match="stop after the call"):
            quantize._quantize(source, tmp_path / "out.onnx", "int4", 0, recipe=recipe, gguf_path=tmp_path / "m.gguf")
    wide = quantize.GGUF_INT4_WIDE_ROLES
    assert calls == [(True, wide, True), (False, wide, True), (True, wide, False)]
    assert "attn_v" in quantize.GGUF_INT4_WIDE_ROLES


def test_auto_carries_gguf_sources_and_rounds_the_rest(tmp_path):
    from specdec.export.bundle import ExportOptions

    both = ExportOptions(target="t.gguf", draft="d.GGUF", out=tmp_path, quant="int4")
    assert (both.recipe_for("target").method, both.recipe_for("draft").method) == ("gguf-int4", "gguf-int4")
    mixed = ExportOptions(target="t.gguf", draft="draft-folder", out=tmp_path, quant="int4")
    assert (mixed.recipe_for("target").method, mixed.recipe_for("draft").method) == ("gguf-int4", "k-quant")
    floats = ExportOptions(target="target-folder", draft="draft-folder", out=tmp_path, quant="int4")
    assert (floats.recipe_for("target").method, floats.recipe_for("draft").method) == ("k-quant", "k-quant")
    assert ExportOptions(target="t.gguf", draft=None, out=tmp_path, quant="int8").recipe.method == "rtn"
    chosen = ExportOptions(target="t.gguf", draft="d.gguf", out=tmp_path, quant="int4", quant_method="gguf",
                           draft_quant_method="rtn")
    assert (chosen.recipe_for("target").method, chosen.recipe_for("draft").method) == ("gguf", "rtn")
