"""The cost tools on tiny inputs: kernel_curve.py (every kernel's row for every row count, ratios against one row),
pass_widths.py (pass times by width while decoding, beside the calibration) and draft_agreement.py."""

import sys

import pytest
from paths import tool_module

pytest.importorskip("onnx")


def _tool(name: str):
    return tool_module(f"measure/{name}.py")


def test_kernel_curve_prints_one_row_per_kernel(tmp_path, monkeypatch, capsys):
    out = tmp_path / "curve.md"
    monkeypatch.setattr(sys, "argv", ["kernel_curve.py", "--k", "64", "--n", "96", "--layers", "2", "--rows", "1,3",
                                      "--levels", "1,4", "--blocks", "32", "--repeats", "2", "--int8-rows",
                                      "--out", str(out)])
    assert _tool("kernel_curve").main() == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| int4 b32 level 1", "| int4 b32 level 4",
                                                      "| int8 rows (MatMulInteger)", "| float32 MatMul (2 pairs)"]
    assert all(row.count("(1.00x)") >= 1 and row.count(" ms ") == 2 for row in rows)
    assert out.read_text().count("\n") == len(rows) + 4


def test_pass_widths_times_each_width_beside_the_calibration(tiny_bundle, tmp_path, capsys):
    """tools/measure/pass_widths.py on the tiny bundle: one row per pass width the runs used, each with the stored and
    the fresh calibration's ratio; the one-token row is 1.00x in every column."""
    import json

    tool = _tool("pass_widths")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"id": "p", "kind": "code", "prompt": "def f(x):\n    return x + x + x + x"}]))
    assert tool.main([str(tiny_bundle), str(prompts), "--modes", "suffix,target", "--max-new-tokens", "16",
                      "--repeats", "2", "--fresh", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows and rows[0][0] == "| 1" and rows[0][3:] == ["1.00x", "1.00x", "1.00x |"]
    assert sum(line.endswith(" tok/s") for line in out.splitlines()) == 4 and "sum of tok/s: suffix" in out
    assert tool.main([str(tiny_bundle), str(prompts), "--modes", "nope"]) == 2


def test_draft_agreement_scores_every_pairing_on_one_text(tiny_bundle, tmp_path, capsys):
    """tools/measure/draft_agreement.py on the tiny bundle given twice: four (target, draft) pairings, all equal since the
    bundles are one; a target agrees with itself everywhere, while the tiny random draft does not (a tool that
    compared a role with itself would report 1.0 there); a text shorter than one context is a usage error."""
    import json

    tool = _tool("draft_agreement")
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n    y = 2\n" * 20)
    out = tmp_path / "agreement.json"
    assert tool.main([str(tiny_bundle), str(tiny_bundle), "--text", str(text), "--tokens", "128", "--context", "64",
                      "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    shares = {pair["agreement"] for pair in result["pairs"]}
    assert result["tokens"] == 128 and len(result["pairs"]) == 4 and len(shares) == 1
    assert 0.0 <= shares.pop() < 1.0 and result["targets"][0]["agreement"] == 1.0
    assert capsys.readouterr().out.count("target ") == 4
    text.write_text("x")
    with pytest.raises(SystemExit):
        tool.main([str(tiny_bundle), "--text", str(text), "--context", "64"])


def test_products_alone_runs_each_product_on_the_bundle_weights(tmp_path):
    """graph_profile's products-alone graph: every MatMulNBits / MatMulIntegerToFloat of a graph (an int8 row
    product's activation typed as its QuantizeLinear makes it), reading the weights from the model's external data in
    place; the first product, fed the graph's own input, gives the graph's own intermediate output bit for bit."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from specdec.runners.standard import session_options

    curve, profile = _tool("kernel_curve"), _tool("graph_profile")
    for name, model in (("nbits", curve.nbits_model(64, 96, 32, 4, 1)), ("int8", curve.int8_rows_model(64, 96, 1))):
        proto = onnx.load_from_string(model)
        first = next(node for node in proto.graph.node if node.op_type in ("MatMulNBits", "MatMulIntegerToFloat"))
        proto.graph.output.append(helper.make_tensor_value_info(first.output[0], onnx.TensorProto.FLOAT, None))
        folder = tmp_path / name
        folder.mkdir()
        onnx.save_model(proto, str(folder / "model.onnx"), save_as_external_data=True, location="model.data",
                        size_threshold=0)
        count, run = profile.products_alone_session(folder / "model.onnx", None)
        outputs = run()
        assert count == 2
        assert [out.shape for out in outputs] == [(1, 1, 96), (1, 1, 64)]
        assert outputs[0].dtype == np.float32
        if name == "nbits":  # the first product reads the graph input itself: same feed, same weights
            feed = np.random.default_rng(0).standard_normal((1, 1, 64)).astype(np.float32)
            whole = ort.InferenceSession(str(folder / "model.onnx"), session_options(None),
                                         providers=["CPUExecutionProvider"])
            np.testing.assert_array_equal(outputs[0][0], whole.run([first.output[0]], {"x": feed[0]})[0])
