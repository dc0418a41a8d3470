"""The standard graph form stays TensorRT's input: every op, attribute and dtype is one TensorRT 10.x parses.

The table is pinned from onnx/onnx-tensorrt ``docs/operators.md`` (10.1-GA: opset 9..20, the "Y" rows
and their types), with its caveats: constant ``axes`` for the Reduce*/Squeeze/Unsqueeze/Slice/Pad
family, ``DequantizeLinear`` only from INT8/FP8/INT4 with a zero point of 0 (blocked int4 from opset 21,
block inferred from the scale's shape, as TensorRT 10.x's int4 weight-only quantization reads it),
``LayerNormalization`` with only its first output used, no custom domains. The check is static (no
GPU here); the negative controls show it rejects a fused graph and a planted dynamic axes input.
"""

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

from onnx import TensorProto  # noqa: E402

from specdec.contract.manifest import Manifest  # noqa: E402
from specdec.export.bundle import ExportOptions, export_bundle  # noqa: E402
from tiny_models import ARCHS  # noqa: E402

_ALL = ("FP32", "FP16", "BF16", "INT32", "INT64", "BOOL")
_FLOAT = ("FP32", "FP16", "BF16")
_ARITH = ("FP32", "FP16", "BF16", "INT32", "INT64")
# op -> supported types, grouped as docs/operators.md lists them (10.1-GA)
TENSORRT_OPS = {
    **dict.fromkeys("Abs Add ArgMax ArgMin DepthToSpace Div Equal Greater GreaterOrEqual IsNaN Less LessOrEqual Max "
                    "Min Mod Mul Neg Pad Range ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean "
                    "ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Scatter ScatterElements ScatterND Shrink Sign "
                    "SpaceToDepth Sub Sum TopK".split(), _ARITH),
    **dict.fromkeys("Acos Acosh Asin Asinh Atan Atanh AveragePool BatchNormalization Ceil Celu Clip Conv ConvTranspose "
                    "Cos Cosh CumSum Dropout Einsum Elu Erf Exp Floor Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool "
                    "GroupNormalization GRU HardSigmoid HardSwish Hardmax ImageScaler InstanceNormalization IsInf "
                    "LayerNormalization LeakyRelu Log LogSoftmax LRN LSTM LpNormalization LpPool MatMul MaxPool "
                    "MeanVarianceNormalization ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal "
                    "RandomNormalLike RandomUniform RandomUniformLike Reciprocal Resize RNN Round ScaledTanh Scan Selu "
                    "Sigmoid Sin Sinh Softmax Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Upsample".split(), _FLOAT),
    **dict.fromkeys("And Not Or Xor".split(), ("BOOL",)),
    **dict.fromkeys("Cast CastLike".split(), _ALL + ("UINT8",)),
    **dict.fromkeys("Concat Constant Expand EyeLike Flatten Gather GatherElements GatherND Identity If Loop OneHot "
                    "Reshape ReverseSequence Shape Size Slice Split Squeeze Tile Transpose Trilu Unsqueeze "
                    "Where".split(), _ALL),
    "ConstantOfShape": _ALL,  # the doc's "INF64" is INT64
    **dict.fromkeys("DeformConv GridSample Mish NonMaxSuppression NonZero RoiAlign".split(), ("FP32", "FP16")),
    "DequantizeLinear": ("INT8", "FP8", "INT4"),  # the input; its output is a float type
    "Gelu": ("FP32", "FP16", "BF16", "INT8", "INT32", "INT64"),
    "Mean": ("FP32", "FP16", "BF16", "FP8", "INT32", "INT64"),
}
# input index that must be a constant (initializer or Constant node), per op
CONSTANT_INPUTS = {"ReduceMean": 1, "ReduceMax": 1, "ReduceSum": 1, "ReduceMin": 1, "ReduceProd": 1,
                   "ReduceSumSquare": 1, "ReduceL1": 1, "ReduceL2": 1, "Squeeze": 1, "Unsqueeze": 1, "Slice": 3,
                   "Pad": 3, "CumSum": 1}
MAX_OPSET, QDQ_OPSET = 20, 21  # blocked int4 DequantizeLinear is opset 21
_TYPES = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
          TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.BOOL: "BOOL", TensorProto.INT8: "INT8",
          TensorProto.INT4: "INT4", TensorProto.UINT8: "UINT8", TensorProto.FLOAT8E4M3FN: "FP8",
          TensorProto.DOUBLE: "DOUBLE"}


def tensorrt_problems(model) -> list:
    """Every reason TensorRT 10.x's ONNX parser would refuse ``model`` (empty = parses), statically."""
    from onnx import numpy_helper

    problems = []
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    has_qdq = any(n.op_type == "DequantizeLinear" for n in model.graph.node)
    if set(opsets) != {"ai.onnx"}:
        problems.append(f"custom domains {sorted(set(opsets) - {'ai.onnx'})}")
    if opsets.get("ai.onnx", 0) > (QDQ_OPSET if has_qdq else MAX_OPSET):
        problems.append(f"opset {opsets.get('ai.onnx')}")
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.input,
                                                           *inferred.graph.output)}
    initializers = {t.name: t for t in model.graph.initializer}
    types.update({name: t.data_type for name, t in initializers.items()})
    constants = set(initializers)
    consumed = {name for node in model.graph.node for name in node.input}
    for node in model.graph.node:
        if node.op_type == "Constant":
            constants.update(node.output)
        where = f"{node.op_type} {node.name}"
        if node.domain not in ("", "ai.onnx"):
            problems.append(f"{where}: domain {node.domain}")
            continue
        if node.op_type not in TENSORRT_OPS:
            problems.append(f"{where}: not supported by TensorRT")
            continue
        allowed = set(TENSORRT_OPS[node.op_type])
        checked = node.input[:1] if node.op_type == "DequantizeLinear" else [*node.input, *node.output]
        if node.op_type == "Cast":
            checked = [*node.input, *node.output]
        for name in checked:
            dtype = _TYPES.get(types.get(name), types.get(name))
            if name and dtype is not None and dtype not in allowed:
                problems.append(f"{where}: {name} is {dtype}, TensorRT takes {sorted(allowed)}")
        index = CONSTANT_INPUTS.get(node.op_type)
        if index is not None and len(node.input) > index and node.input[index] and node.input[index] not in constants:
            problems.append(f"{where}: input {index} ({node.input[index]}) must be a constant")
        if node.op_type == "Constant" and {a.name for a in node.attribute} & {"sparse_value", "value_string",
                                                                                  "value_strings"}:
            problems.append(f"{where}: unsupported Constant attribute")
        if node.op_type == "LayerNormalization" and any(o in consumed for o in node.output[1:] if o):
            problems.append(f"{where}: only the first output is supported")
        if node.op_type == "DequantizeLinear":
            if len(node.input) > 2 and node.input[2]:
                zero = initializers.get(node.input[2])
                if zero is None or numpy_helper.to_array(zero).any():
                    problems.append(f"{where}: zero point must be a constant 0")
            block = {a.name: a.i for a in node.attribute}.get("block_size", 0)
            data, scale = initializers.get(node.input[0]), initializers.get(node.input[1])
            if block and (data is None or scale is None or len(data.dims) != len(scale.dims)
                          or any(d != s * (block if d != s else 1) for d, s in zip(data.dims, scale.dims))):
                problems.append(f"{where}: block {block} is not what the scale's shape implies")
    return problems


@pytest.fixture(scope="module")
def standard_graphs(bundle_per_form, quantized_pair_bundle, tmp_path_factory):
    """(graph, parity report) of standard-form tiny targets: every architecture in float32 (with parity; the
    session's shared bundles), llama in float16 and int4-qdq (the quantized pair's target)."""
    graphs = {}
    for arch in ARCHS:
        out, manifest = bundle_per_form(arch, "standard")
        graphs[(arch, "float32", "none")] = (onnx.load(str(out / "target/model.onnx"), load_external_data=False),
                                             manifest.extra["parity_max_abs_error"].get("target", {}))
    out, manifest = quantized_pair_bundle("int4-qdq", "float32")
    assert manifest.target.graph == "standard"
    graphs[("llama", "float32", "int4-qdq")] = (onnx.load(str(out / "target/model.onnx"), load_external_data=False),
                                                manifest.extra["parity_max_abs_error"].get("target", {}))
    out = tmp_path_factory.mktemp("trt") / "llama-float16"
    manifest = export_bundle(ExportOptions(target=str(bundle_per_form.model("llama")), draft=None, out=out,
                                           dtype="float16", graph="standard", parity=False), progress=lambda msg: None)
    graphs[("llama", "float16", "none")] = (onnx.load(str(out / "target/model.onnx"), load_external_data=False),
                                            manifest.extra["parity_max_abs_error"].get("target", {}))
    return graphs


def test_standard_form_matches_pytorch_for_every_architecture(standard_graphs):
    """The standard form's parity (prefill, decode, chain verify, tree) stays within 1e-4 (fused is the default,
    so test_export_architectures checks the fused form)."""
    for (arch, dtype, quant), (_, parity) in standard_graphs.items():
        if dtype == "float32" and quant == "none":
            report = parity["float"]
            assert set(report) == {"prefill", "decode", "chain_verify", "tree", "rows_vs_decode"}
            for scenario, errors in report.items():
                assert errors["logits"] < 1e-4 and errors["kv"] < 1e-4, (arch, scenario, errors)


def test_standard_form_uses_only_what_tensorrt_parses(standard_graphs):
    """Every standard-form graph (8 architectures, float16, int4 QDQ) passes the pinned TensorRT 10.x op table."""
    for case, (model, _) in standard_graphs.items():
        assert tensorrt_problems(model) == [], case


def test_the_check_rejects_a_fused_graph_and_a_dynamic_axes(standard_graphs, tiny_bundle):
    """Negative controls: the fused form (com.microsoft ops) and a ReduceMean with computed axes are refused."""
    fused = onnx.load(str(tiny_bundle / "target/model.onnx"), load_external_data=False)
    problems = tensorrt_problems(fused)
    contrib = "RotaryEmbedding" if Manifest.read(tiny_bundle).target.attention == "folded" else "GroupQueryAttention"
    assert any(contrib in p for p in problems) and any("custom domains" in p for p in problems), problems
    planted = onnx.ModelProto()
    planted.CopyFrom(standard_graphs[("llama", "float32", "none")][0])
    node = next(n for n in planted.graph.node if n.op_type == "ReduceMean")
    shape = onnx.helper.make_node("Shape", [node.input[0]], ["planted_shape"])
    axes = onnx.helper.make_node("Slice", ["planted_shape", node.input[1], node.input[1]], ["planted_axes"])
    index = list(planted.graph.node).index(node)
    planted.graph.node.insert(index, axes)
    planted.graph.node.insert(index, shape)
    node.input[1] = "planted_axes"
    assert any("must be a constant" in p for p in tensorrt_problems(planted))
