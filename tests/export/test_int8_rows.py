"""Integer layer products (``--layer-products int8``: export/int8_rows.py): 7-bit channel weights, 8-bit rows.

What must hold, each shown to fail on a planted bug: the graph's product is the numpy rule's bit for bit; a row's
output does not depend on the other rows of its pass (so verify rows equal one-token passes and prefill chunks
write the rows decoding would), and greedy speculation in every mode is target-only decoding with seeded sampling
target-only's seeded sample; the weights stay inside the range AVX2's ``vpmaddubsw`` sums without saturating."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from every_mode import assert_every_mode_is_target_only
from onnx import TensorProto, helper

from specdec.export import int8_rows
from specdec.export.graph_writer import NodeList


def _session(weight):
    """One projection of ``weight`` [N, K] as the exporter writes it: x [1, T, K] -> y [1, T, N]."""
    sink = NodeList()
    q, scale = int8_rows.channel_quantized(weight)
    int8_rows.row_quantized_matmul(sink, "x", sink.initializer("q", q), sink.initializer("s", scale), "p", "y",
                                   int8_rows.row_zero_points(sink, "x"))
    n, k = weight.shape
    graph = helper.make_graph(sink.nodes, "p", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])], sink.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    from specdec.runners.standard import session_options  # the process's shared thread pool

    return (ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]),
            q, scale)


def _inputs(k=1536, rows=64, seed=0):
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    x[3, 17] = 40.0  # an outlier channel in one row: only that row's scale may see it
    x[9] = 0.0  # a row of zeros
    return x


def test_channel_weights_are_7_bit_within_half_a_step_and_cannot_saturate_avx2():
    weight = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)
    weight[5] = 0.0
    q, scale = int8_rows.channel_quantized(weight)
    assert q.shape == (64, 96) and q.dtype == np.int8 and scale.shape == (96,)
    assert np.abs(q).max() == int8_rows.WEIGHT_LEVELS and not q[:, 5].any()
    error = np.abs((q.astype(np.float32) * scale[None, :]).T - weight)  # the weight the product uses
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()
    # vpmaddubsw adds two u8 x s8 products into int16: the largest activation code (255) times the largest weight
    assert 2 * 255 * int8_rows.WEIGHT_LEVELS <= np.iinfo(np.int16).max


@pytest.mark.parametrize("planted", [None, "tensor scale"], ids=["per row", "planted: one scale per pass"])
def test_rows_do_not_depend_on_the_pass_width_and_match_the_numpy_rule(monkeypatch, planted):
    """Widths 1, 5 and 64 over the same rows: each row's output is the same bits, and the numpy rule's. Planted: the
    activation scale taken over the whole pass (ReduceMax over every axis, as DynamicQuantizeLinear does)."""
    if planted:
        real = int8_rows.row_quantized_matmul

        def per_pass(sink, x, q, scale, name, out, zero_points):
            original = sink.one

            def one(op, inputs, name=None, domain="", **attributes):
                peak = original(op, inputs, name=name, domain=domain, **attributes)
                if op != "ReduceMax":
                    return peak
                whole = original("ReduceMax", [peak, sink.constant([1])], name=f"{name}/planted", keepdims=1)
                return original("Expand", [whole, original("Shape", [peak], name=f"{name}/planted_shape")],
                                name=f"{name}/planted_rows")  # every row takes the pass's largest peak

            sink.one = one
            return real(sink, x, q, scale, name, out, zero_points)

        monkeypatch.setattr(int8_rows, "row_quantized_matmul", per_pass)
    weight = np.random.default_rng(2).standard_normal((256, 1536)).astype(np.float32) * 0.05
    session, q, scale = _session(weight)
    x = _inputs()
    wide = session.run(None, {"x": x[None]})[0][0]
    narrow = [session.run(None, {"x": x[None, start:start + width]})[0][0]
              for width in (1, 5) for start in (0, 3, 9)]
    expected = [wide[start:start + width] for width in (1, 5) for start in (0, 3, 9)]
    same_width = all(np.array_equal(a, b) for a, b in zip(narrow, expected))
    rule = int8_rows.reference_rows(x, q, scale)
    assert same_width == (planted is None)
    assert np.array_equal(wide, rule) == (planted is None)
    assert not wide[9].any()
    # and the product is close to the float one (7-bit weights, 8-bit rows) but in the outlier's row, whose other
    # values round to steps of 40 / 127
    exact = x @ weight.T
    error = np.abs(wide - exact).max(axis=1) / np.abs(exact).max()
    assert (np.delete(error, 3).max() < 0.02 < error[3]) == (planted is None)


pytest.importorskip("torch")


@pytest.fixture(scope="module")
def int8_rows_bundle(tiny_pair_dirs, tmp_path_factory):
    from specdec.export.bundle import ExportOptions, export_bundle

    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("int8_rows") / "bundle"
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, quant="int4", quant_method="rtn",
                                layer_products="int8"), progress=lambda message: None)
    return out


@pytest.mark.integration
def test_the_manifest_records_the_products_and_parity_rows_equal_decoding(int8_rows_bundle):
    import onnx

    from specdec.contract.manifest import Manifest

    manifest = Manifest.read(int8_rows_bundle)
    assert manifest.extra["quant_recipe"]["layer_products"] == "int8"
    assert manifest.extra["draft_quant_recipe"]["layer_products"] == "nbits"
    ops = {role: {node.op_type for node in onnx.load(int8_rows_bundle / getattr(manifest, role).onnx_file,
                                                     load_external_data=False).graph.node}
           for role in ("target", "draft")}
    assert "MatMulIntegerToFloat" in ops["target"] and "MatMulNBits" in ops["target"]  # the lm_head keeps int4
    assert "MatMulIntegerToFloat" not in ops["draft"]
    # the target's rows by construction (the draft's MatMulNBits rows may round per width on some CPUs: --exact-rows)
    report = manifest.extra["parity_max_abs_error"]["target"]["int4"]
    assert report["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}, report


@pytest.mark.integration
def test_greedy_and_seeded_sampling_in_every_mode_are_target_only_with_integer_products(int8_rows_bundle):
    assert_every_mode_is_target_only(int8_rows_bundle)


def test_the_products_are_the_streamed_int4_exports_only():
    from specdec.export.bundle import ExportOptions

    with pytest.raises(ValueError, match="--layer-products int8 is the streamed exporter's, with --quant int4"):
        ExportOptions(target="t", draft=None, out="o", quant="none", layer_products="int8")
    with pytest.raises(ValueError, match="--layer-products int8 is the streamed exporter's"):
        ExportOptions(target="t", draft=None, out="o", quant="int4", exporter="traced", layer_products="int8")
    with pytest.raises(ValueError, match="--layer-products 'int16' is not one of auto, nbits, int8"):
        ExportOptions(target="t", draft=None, out="o", quant="int4", layer_products="int16")


def test_auto_writes_both_forms_of_a_streamed_int4_target_whatever_the_cpu():
    """The export reads no CPU flag: the loading machine measures the forms (decoding/forms.py)."""
    from specdec.export import bundle
    from specdec.export.bundle import ExportOptions, auto_layer_products

    options = lambda **kw: ExportOptions(target="t", draft=None, out="o", **kw)  # noqa: E731
    assert options(quant="int4").layer_products == "auto" and options(quant="int4").recipe.layer_products == "nbits"
    assert auto_layer_products(options(quant="int4"), "qwen2")[0] == ("nbits", "int8")
    assert auto_layer_products(options(quant="int4"), "phi3")[0] == ("nbits",)  # the traced exporter's architecture
    assert auto_layer_products(options(quant="int4", exporter="traced"), "qwen2")[0] == ("nbits",)
    assert auto_layer_products(options(quant="int8"), "qwen2") == (("nbits",), "--quant int8")
    assert bundle.LAYER_PRODUCTS == ("nbits", "int8")
    assert not hasattr(int8_rows, "dot_product_flags")
