"""int4 recipes (export/quantize.py): each writes MatMulNBits that onnxruntime runs to the weights it stored, closer
to the float weights than plain symmetric rounding where the recipe promises it; an 8-bit lm_head; bad recipes
are one line. On a one-MatMul graph (fast) and on the tiny pair through the exporter (integration)."""

import numpy as np
import pytest

from specdec.export.quantize import QuantRecipe
from specdec.runners.standard import session_options

K, N = 96, 40  # 3 blocks of 32 along K: an odd block count (zero points padded per row)


def _graph(path, weight):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMul", ["x", "w"], ["logits"], name="lm_head")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, N])],
                              [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _dequantized(path):
    """The weights the quantized graph stores, [K, N], read back from its initializers."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    data, scales = inits[node.input[1]], inits[node.input[2]].reshape(N, -1)
    blocks, block = scales.shape[1], attrs["block_size"]
    if attrs["bits"] == 8:
        q = data.reshape(N, blocks, block).astype(np.float32)
        zero = 128.0 if len(node.input) < 4 else inits[node.input[3]].reshape(N, blocks)[..., None].astype(np.float32)
    else:
        packed = data.reshape(N, blocks, block // 2)
        q = np.stack([packed & 15, packed >> 4], -1).reshape(N, blocks, block).astype(np.float32)
        if len(node.input) < 4:
            zero = 8.0
        else:
            z = inits[node.input[3]].reshape(N, -1)
            zero = np.stack([z & 15, z >> 4], -1).reshape(N, -1)[:, :blocks, None].astype(np.float32)
    return ((q - zero) * scales[..., None]).reshape(N, -1)[:, :K].T, attrs


@pytest.mark.parametrize("recipe", [QuantRecipe("rtn"), QuantRecipe("rtn-asym"), QuantRecipe("k-quant"),
                                    QuantRecipe("k-quant", lm_head_bits=8)])
def test_each_recipe_runs_to_the_weights_it_stored(tmp_path, recipe):
    import onnxruntime as ort

    from specdec.export.quantize import quantize_onnx

    rng = np.random.default_rng(0)
    weight = (rng.normal(0, 0.05, (K, N)) + rng.uniform(0, 0.05, (1, N))).astype(np.float32)  # skewed blocks
    _graph(tmp_path / "f.onnx", weight)
    quantize_onnx(tmp_path / "f.onnx", tmp_path / "q" / "m.onnx", "int4", None, isolated=False, block_size=32,
                  recipe=recipe)
    stored, attrs = _dequantized(tmp_path / "q" / "m.onnx")
    assert attrs["bits"] == recipe.lm_head_bits and attrs["K"] == K and attrs["N"] == N
    x = rng.normal(0, 1, (3, K)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "q" / "m.onnx"), session_options(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ stored, rtol=1e-4, atol=1e-4)
    error = np.abs(stored - weight).mean()
    assert error < 0.01
    _test_errors[recipe] = error


_test_errors = {}


def test_asymmetric_recipes_fit_skewed_blocks_better_than_symmetric_rounding():
    if len(_test_errors) < 4:
        pytest.skip("needs the recipe runs above")
    rtn = _test_errors[QuantRecipe("rtn")]
    assert _test_errors[QuantRecipe("rtn-asym")] < rtn and _test_errors[QuantRecipe("k-quant")] < rtn
    assert _test_errors[QuantRecipe("k-quant", lm_head_bits=8)] < _test_errors[QuantRecipe("k-quant")] / 4


@pytest.mark.parametrize("kwargs,message", [({"method": "hqq"}, "--quant-method 'hqq' is not one of"),
                                            ({"lm_head_bits": 6}, "--lm-head-bits 6 is not one of")])
def test_a_bad_recipe_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantRecipe(**kwargs)


def test_a_recipe_applies_to_int4_only(tmp_path):
    from specdec.export.bundle import ExportOptions

    with pytest.raises(ValueError, match="apply to --quant int4, not --quant int8"):
        ExportOptions(target="t", draft=None, out=tmp_path, quant="int8", quant_method="k-quant")
    assert ExportOptions(target="t", draft=None, out=tmp_path, quant="int4", quant_method="k-quant",
                         lm_head_bits=8).recipe == QuantRecipe("k-quant", 8)


def test_exported_k_quant_pair_records_its_recipe_and_is_no_further_from_the_float_model_than_rtn(tiny_pair_dirs,
                                                                                                 tmp_path):
    """The tiny random pair's int4 logits are 2-3 away from float32 whatever the method (no absolute bound fits
    every method); k-quant's target stays closer than round-to-nearest's (2.2 against 3.3 on 2026-12-03)."""
    from specdec.contract.manifest import Manifest
    from specdec.export.bundle import ExportOptions, export_bundle

    target, draft = tiny_pair_dirs
    errors = {}
    for method in ("k-quant", "rtn"):
        out = tmp_path / method
        export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, quant="int4", quant_method=method,
                                    layer_products="nbits"), progress=lambda m: None)
        manifest = Manifest.read(out)
        assert manifest.extra["quant_recipe"] == {"method": method, "lm_head_bits": 4, "float_scales": True,
                                                  "layer_products": "nbits"}
        assert manifest.extra["draft_quant_recipe"] == {"method": method, "lm_head_bits": 4, "float_scales": False,
                                                        "layer_products": "nbits"}
        assert manifest.target.quant == "int4"
        errors[method] = manifest.extra["parity_max_abs_error"]["target"]["int4"]["decode"]["logits"]
    assert errors["k-quant"] < errors["rtn"], errors
