"""tools/inputs/reblock.py: a carried node's effective weight (codes, scales and the correction rows' minimum)
equals what onnxruntime computes with it, and the block search rounds no worse than round-to-nearest."""

import numpy as np
import pytest
from paths import tool_module

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from specdec.export.gguf_blocks import Grid  # noqa: E402
from specdec.export.nbits import pack_grid  # noqa: E402
from specdec.runners.standard import session_options  # noqa: E402  (the process's shared thread pool)


def _tool():
    return tool_module("inputs/reblock.py")


def _carried_model(n: int = 48, k: int = 128):
    """x -> block sums -> Concat(x, sums, sums) -> MatMulNBits holding a grid with a float minimum per block."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 0.001).astype(np.float32)
    correction = (rng.standard_normal((n, k // 32)) * 0.05).astype(np.float32)
    packed = pack_grid(Grid(4, q, scale, np.full(scale.shape, 8, np.uint8), correction))
    count, padded = k // 32, packed.k - k
    nodes = [helper.make_node("Reshape", ["x", "view"], ["blocks"]),
             helper.make_node("ReduceSum", ["blocks", "last"], ["sums"], keepdims=0),
             helper.make_node("Pad", ["sums", "pads"], ["padded"]),
             helper.make_node("Concat", ["x", "padded", "padded"], ["augmented"], axis=-1),
             helper.make_node("MatMulNBits", ["augmented", "W", "S"], ["y"], name="layers.0/gate_up/MatMulNBits",
                              domain="com.microsoft", K=packed.k, N=n, bits=4, block_size=32, accuracy_level=0)]
    inits = [numpy_helper.from_array(np.array([1, count, 32], np.int64), "view"),
             numpy_helper.from_array(np.array([-1], np.int64), "last"),
             numpy_helper.from_array(np.array([0, 0, 0, padded // 2 - count], np.int64), "pads"),
             numpy_helper.from_array(packed.data, "W"), numpy_helper.from_array(packed.scales, "S")]
    graph = helper.make_graph(nodes, "carried", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def test_effective_weight_equals_onnxruntimes_product():
    model = _carried_model()
    weight, x_name = _tool().dequantized(model, model.graph.node[-1])
    assert x_name == "x" and weight.shape == (48, 128)
    x = np.random.default_rng(1).standard_normal((1, 128)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), session_options(None), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight.T, rtol=1e-4, atol=1e-4)


def test_rewritten_node_reads_the_activation_and_the_block_sums_are_dropped():
    tool = _tool()
    model = _carried_model()
    weight, _ = tool.dequantized(model, model.graph.node[-1])
    assert tool.rewrite(model, {"gate_up"}, 64, "rms") == [("layers.0/gate_up/MatMulNBits", 128, 48)]
    tool.prune(model)
    assert [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    x = np.random.default_rng(1).standard_normal((1, 128)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), session_options(None), providers=["CPUExecutionProvider"])
    error = np.abs(session.run(None, {"x": x})[0] - x @ weight.T).max()
    assert 0 < error < 0.1 * np.abs(x @ weight.T).max()  # a second rounding: close, not equal


@pytest.mark.parametrize("block", [32, 64, 128])
def test_search_rounds_no_worse_than_nearest_and_keeps_constant_blocks(block):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((16, 256)) * 0.02).astype(np.float32)
    weight[0, :block], weight[1, :block], weight[2, :block] = 0.01, -0.01, 0.0
    codes, scales, zeros = _tool().requantized(weight, block, "rms")
    values = ((codes.reshape(16, -1, block).astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(16, -1)
    np.testing.assert_allclose(values[:3, :block], weight[:3, :block], atol=1e-7)
    blocks = weight[3:].reshape(13, -1, block)  # rows without a constant block
    low, high = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
    step = (high - low) / 15
    zero = np.clip(np.round(-low / step), 0, 15)
    nearest = (np.clip(np.round(blocks / step) + zero, 0, 15) - zero) * step  # min-max round-to-nearest, 4-bit zero
    importance = np.sqrt((blocks ** 2).mean(-1, keepdims=True)) + np.abs(blocks)  # what the search weighs

    def weighted(rounded):
        return (importance * (rounded.reshape(blocks.shape) - blocks) ** 2).sum()

    assert weighted(values[3:]) < weighted(nearest)
