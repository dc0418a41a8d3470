"""NVIDIA backends, checked without a GPU: profiles, engine records and refusals, memory budgets, selection errors."""

import dataclasses
import hashlib

import pytest

from specdec.runners.memory import MemoryBudgetError, budget, check_fits
from specdec.runners.tensorrt.profiles import ProfileLimits, build_profiles, profile_for
from specdec.runners.tensorrt.records import DeviceInfo, EngineRecord, verified_engine
from specdec.contract.manifest import BundleError, Manifest
from paths import ROOT

DEVICE = DeviceInfo(tensorrt_version="10.3.0", compute_capability="8.7")


def test_profiles_cover_decode_verify_and_prefill_over_the_context(tiny_standard_bundle):
    spec = Manifest.read(tiny_standard_bundle).target
    limits = ProfileLimits(max_context=256, max_verify=9, max_prefill=64)
    profiles = build_profiles(spec, limits)
    assert [p.name for p in profiles] == ["decode", "verify", "prefill"]
    decode, verify, prefill = (p.shapes for p in profiles)
    assert decode["input_ids"] == ((1, 1), (1, 1), (1, 1))
    assert verify["input_ids"][2] == (1, 9) and prefill["input_ids"][2] == (1, 64)
    low, _, high = prefill["past.0.key"]
    assert low[1] == 0 and high[1] == 255  # a pass of any T may end at the last slot of the context
    assert prefill["attention_mask"][2] == (1, 64, 255 + 64)  # total = past + new at every corner
    assert verify["past.0.key"][2][1] == decode["past.0.key"][2][1] == 255
    assert set(decode) == {t.name for t in spec.inputs}
    assert [profile_for(profiles, t) for t in (1, 5, 9, 10, 64)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        profile_for(profiles, 65)
    with pytest.raises(ValueError):
        ProfileLimits(max_context=64, max_verify=9, max_prefill=64)


@pytest.fixture
def bundle_with_fake_engine(tiny_standard_bundle, tmp_path):
    import shutil

    root = tmp_path / "bundle"
    shutil.copytree(tiny_standard_bundle, root)
    engine = root / "engines" / "target.engine"
    engine.parent.mkdir()
    engine.write_bytes(b"not really a TensorRT plan")
    digest = hashlib.sha256(engine.read_bytes()).hexdigest()
    manifest = Manifest.read(root)
    record = EngineRecord("engines/target.engine", digest, DEVICE.tensorrt_version, DEVICE.compute_capability,
                          ("decode", "verify", "prefill"), 256, 9, 64)
    manifest = dataclasses.replace(manifest, files={**manifest.files, record.file: digest},
                                   engines={"target": record.to_dict()})
    (root / "manifest.json").write_text(manifest.to_json())
    return root


def test_recorded_engine_passes_the_checks(bundle_with_fake_engine):
    manifest = Manifest.read(bundle_with_fake_engine)
    path, record = verified_engine(bundle_with_fake_engine, manifest, "target", DEVICE)
    assert path.name == "target.engine" and record.max_context == 256
    assert Manifest.from_json(manifest.to_json()).engines == manifest.engines


def test_tampered_engine_is_refused_before_deserializing(bundle_with_fake_engine):
    (bundle_with_fake_engine / "engines" / "target.engine").write_bytes(b"evil plan")
    manifest = Manifest.read(bundle_with_fake_engine)
    with pytest.raises(BundleError, match="does not match its sha256.*never deserialized"):
        verified_engine(bundle_with_fake_engine, manifest, "target", DEVICE)


@pytest.mark.parametrize("device, message", [
    (DeviceInfo("10.8.0", "8.7"), "built with TensorRT 10.3.0, this machine has 10.8.0"),
    (DeviceInfo("10.3.0", "9.0"), "compute capability 8.7, this GPU is 9.0"),
])
def test_mismatched_engine_is_refused(bundle_with_fake_engine, device, message):
    manifest = Manifest.read(bundle_with_fake_engine)
    with pytest.raises(BundleError, match=message):
        verified_engine(bundle_with_fake_engine, manifest, "target", device)


def test_unknown_engine_is_refused(bundle_with_fake_engine):
    manifest = Manifest.read(bundle_with_fake_engine)
    with pytest.raises(BundleError, match="no TensorRT engine for the draft"):
        verified_engine(bundle_with_fake_engine, manifest, "draft", DEVICE)


def test_int4_bundles_are_refused_for_tensorrt_with_a_reason(tiny_standard_bundle):
    from specdec.runners.tensorrt.build import check_engine_ready

    spec = dataclasses.replace(Manifest.read(tiny_standard_bundle).target, quant="int4")
    with pytest.raises(ValueError, match="MatMulNBits.*TensorRT cannot parse.*int4-qdq"):
        check_engine_ready(spec)
    check_engine_ready(dataclasses.replace(spec, quant="int4-qdq"))  # DequantizeLinear + MatMul: TensorRT's form


def test_memory_budget_suggests_a_context_that_fits(tiny_standard_bundle):
    manifest = Manifest.read(tiny_standard_bundle)
    plan = budget(tiny_standard_bundle, manifest, max_context=512)
    assert plan.weights > 0 and plan.kv_cache > 0
    check_fits(plan, manifest, available=plan.total * 2, max_context=512)
    tight = plan.total - plan.kv_cache // 2
    with pytest.raises(MemoryBudgetError, match="load with max_context=|--quant int4"):
        check_fits(plan, manifest, available=int(tight / 0.9), max_context=512)
    assert manifest.target.quant != "int4"
    with pytest.raises(MemoryBudgetError, match="weights alone do not fit: export with --quant int4"):
        check_fits(plan, manifest, available=plan.weights // 2, max_context=512)
    # a bundle already int4 is not told to export with --quant int4
    quantized = {role: dataclasses.replace(spec, quant="int4") for role, spec in manifest.models().items()}
    int4 = dataclasses.replace(manifest, **quantized)
    with pytest.raises(MemoryBudgetError, match="a smaller draft/target") as refused:
        check_fits(plan, int4, available=plan.weights // 2, max_context=512)
    assert "--quant int4" not in str(refused.value)


def test_the_default_context_is_the_trained_one_capped_by_memory(tiny_bundle, monkeypatch):
    """The trained context when it fits; else the largest multiple of 256 that does, counting every KV cache the
    caller holds and the reserved RAM caches (a budget that forgot a cache or the reserve would pick the trained 512
    here); the load keeps the reason; a prompt over it stays a one-line error naming max_context."""
    from specdec import SpeculativeDecoder
    from specdec.contract.limits import MAX_DRAFT_TOKENS, PREFILL_CHUNK
    from specdec.runners.memory import CONTEXT_STEP, default_context, kv_bytes_per_token, pass_bytes_per_token

    manifest = Manifest.read(tiny_bundle)
    trained = manifest.target.max_positions
    context, why = default_context(tiny_bundle, manifest, available=1 << 40)
    assert context == trained and "trained context" in why
    assert default_context(tiny_bundle, manifest, available=None)[0] == trained
    assert trained == 2 * CONTEXT_STEP
    step = max(PREFILL_CHUNK, MAX_DRAFT_TOKENS + 2)
    fixed = budget(tiny_bundle, manifest, 0, step).total
    per_token = kv_bytes_per_token(manifest) + pass_bytes_per_token(manifest, step)
    for caches, reserved in ((1, 0), (3, 0), (2, 1 << 16)):
        room = fixed + reserved + caches * per_token * (CONTEXT_STEP + 200)  # one step fits, not two
        context, why = default_context(tiny_bundle, manifest, int(room / 0.9) + 1, step, reserved, caches)
        assert (context, "capped" in why) == (CONTEXT_STEP, True), (caches, reserved, why)
        check_fits(budget(tiny_bundle, manifest, context, step, caches=caches), manifest, int(room / 0.9) + 1 - reserved,
                   context, caches=caches)
    available = int((fixed + per_token * (CONTEXT_STEP + 200)) / 0.9) + 1
    monkeypatch.setattr("specdec.decoding.decoder.available_host_memory", lambda: available)
    decoder = SpeculativeDecoder.load(tiny_bundle, suffix_cache_mib=0)
    assert decoder.max_context == CONTEXT_STEP and "capped" in decoder.context_reason
    two = int((fixed + 2 * per_token * (CONTEXT_STEP + 200)) / 0.9) + 1
    monkeypatch.setattr("specdec.decoding.decoder.available_host_memory", lambda: two)
    assert SpeculativeDecoder.load(tiny_bundle, suffix_cache_mib=0, kv_caches=2).max_context == CONTEXT_STEP
    assert SpeculativeDecoder.load(tiny_bundle, suffix_cache_mib=0).max_context == 2 * CONTEXT_STEP and decoder.fork().context_reason == decoder.context_reason
    with pytest.raises(ValueError, match="max_context"):
        decoder.generate("x" * (decoder.max_context + 10), max_new_tokens=4)


def test_gpu_providers_without_their_packages_say_what_to_install(tiny_standard_bundle):
    import onnxruntime

    from specdec import SpeculativeDecoder

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has onnxruntime-gpu")
    with pytest.raises(ValueError, match="provider cuda requested but onnxruntime has no CUDAExecutionProvider: "
                                         "install onnxruntime-gpu"):
        SpeculativeDecoder.load(tiny_standard_bundle, provider="cuda")
    with pytest.raises(ValueError, match="TensorRT is not installed|cuda-python is not installed"):
        SpeculativeDecoder.load(tiny_standard_bundle, provider="tensorrt-native")
    with pytest.raises(ValueError, match="provider 'npu' is not one of"):
        SpeculativeDecoder.load(tiny_standard_bundle, provider="npu")


@pytest.mark.gpu
def test_gpu_check_script_runs_on_a_gpu():
    """Runs only with -m gpu on a machine with a GPU: the prepared end-to-end check."""
    import subprocess
    import sys
    
    script = ROOT / "tools" / "check" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--tiny-only"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
