"""Every supported architecture exports and matches its Hugging Face model (logits and new KV rows).

The parity check runs four scenarios against a from-scratch Hugging Face forward: prefill
with an empty past, decode (T=1), chain verify (T=5 with a past) and a 5-node tree (siblings
share a position), see ``specdec.export.parity``.
"""

import json

import pytest

torch = pytest.importorskip("torch")

from specdec.export.architectures import ARCHITECTURES  # noqa: E402
from specdec.contract.manifest import Manifest  # noqa: E402
from tiny_models import ARCHS  # noqa: E402

TOLERANCE = 1e-4


def test_every_table_architecture_is_tested():
    assert set(ARCHS) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_exports_with_parity(arch, bundle_per_form):
    """The default (fused) form of every architecture; test_tensorrt_ops checks the standard form's parity."""
    bundle, manifest = bundle_per_form(arch, "fused")
    report = manifest.extra["parity_max_abs_error"]["target"]["float"]
    assert set(report) == {"prefill", "decode", "chain_verify", "tree", "rows_vs_decode"}
    for scenario, errors in report.items():
        assert errors["logits"] < TOLERANCE, (scenario, errors)
        assert errors["kv"] < TOLERANCE, (scenario, errors)
    # the manifest on disk round-trips to the same dataclass
    assert Manifest.read(bundle) == manifest
    spec = manifest.target
    assert spec.architecture == arch and spec.vocab_size == 128 and spec.graph == "fused"
    assert spec.has_sliding_mask == (arch in ("mistral", "gemma3_text"))
    assert json.loads((bundle / "manifest.json").read_text())["format_version"] == 1


@pytest.mark.parametrize("quant,dtype", [("int4", "float32"), ("int8", "float32"), ("int4-qdq", "float32"),
                                         ("int4-qdq", "float16")])  # the last: TensorRT's int4 weight-only form
def test_weight_only_quantized_bundles_load_and_decode(quant, dtype, quantized_pair_bundle):
    """MatMulNBits / int4 QDQ bundles: every MatMul weight quantized, parity reported, the runtime decodes exactly."""
    from specdec import SpeculativeDecoder

    bundle, manifest = quantized_pair_bundle(quant, dtype)
    assert manifest.target.quant == quant and manifest.draft.quant == quant
    parity = manifest.extra["parity_max_abs_error"]["target"]
    # the quantized graph was checked (the traced exporter also checks its float graph first)
    expected = {quant} if manifest.extra["exporter"]["target"] == "streamed" else {"float", quant}
    assert set(parity) == expected and isinstance(parity[quant], dict)
    assert manifest.extra["quant_block_size"] == {"target": 32, "draft": 128}
    import onnx

    for role, block in (("target", 32), ("draft", 128)):
        graph_nodes = onnx.load(str(bundle / role / "model.onnx"), load_external_data=False).graph.node
        sizes = {a.i for n in graph_nodes for a in n.attribute if a.name == "block_size"}
        if quant == "int4" and manifest.extra["quant_recipe"]["method"] == "k-quant":
            # auto's k-quant (float sources) writes Q4_K's 32-weight sub-blocks whatever --draft-block-size says;
            # what it does not cover (the embedding) keeps the role's block size
            assert 32 in sizes and sizes <= {32, block}, (role, sizes)
        else:
            assert sizes == {block}, (role, sizes)
    graph = (bundle / "target" / "model.onnx").read_bytes()
    if quant == "int4-qdq":  # standard ops only (what TensorRT parses): blocked int4 DequantizeLinear + MatMul
        import onnx

        model = onnx.load(str(bundle / "target" / "model.onnx"), load_external_data=False)
        assert b"MatMulNBits" not in graph
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
        assert max(o.version for o in model.opset_import) >= 21
        int4 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT4]
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert dq and len(int4) == len(dq)
    else:
        assert b"MatMulNBits" in graph
    decoder = SpeculativeDecoder.load(bundle)
    baseline = decoder.generate("def f(x):", max_new_tokens=24, num_draft_tokens=0)
    assert decoder.generate("def f(x):", max_new_tokens=24, num_draft_tokens=3, proposer="draft").token_ids \
        == baseline.token_ids
