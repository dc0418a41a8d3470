"""The real TensorRTRunner / DeviceKV / DeviceBuffer / build_engines code, run on a CPU against test doubles of
cuda-python and TensorRT (tests/fake_nvidia.py) that check the contract a GPU and TensorRT would enforce.

What this proves: the native backend binds the shapes, profiles and addresses the graph contract needs and
decodes exactly what onnxruntime on the CPU decodes. What it cannot prove: that real TensorRT parses and
builds the graph, that CUDA kernels agree numerically, or anything about real device memory.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import fake_nvidia
from specdec import SpeculativeDecoder
from specdec.runners.tensorrt.runner import tensorrt_runners
from specdec.runners.tensorrt.profiles import ProfileLimits
from specdec.runners.tensorrt.runner import TensorRTRunner
from specdec.contract.manifest import Manifest
from specdec.runners.standard import ModelRunner

LIMITS = ProfileLimits(max_context=256, max_verify=16, max_prefill=64)
CONTEXT = LIMITS.max_context
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef mul(", "The quick brown fox jumps over the lazy",
           "for i in range(10):\n    print(i * i)\n# "]


@pytest.fixture(scope="module")
def cudart():
    with pytest.MonkeyPatch.context() as patch:
        yield fake_nvidia.install(patch)


@pytest.fixture(scope="module")
def engine_bundle(cudart, tiny_standard_bundle, tmp_path_factory):
    """A copy of the tiny bundle with both engines built and recorded by the real build_engines."""
    from specdec.runners.tensorrt.build import build_engines

    root = tmp_path_factory.mktemp("trt") / "bundle"
    shutil.copytree(tiny_standard_bundle, root)
    build_engines(root, LIMITS, progress=lambda message: None)
    return root


@pytest.fixture(scope="module")
def trt_decoder(engine_bundle):
    return SpeculativeDecoder.load(engine_bundle, provider="tensorrt-native", max_context=CONTEXT)


@pytest.fixture(scope="module")
def cpu_decoder(tiny_standard_bundle):
    return SpeculativeDecoder.load(tiny_standard_bundle, provider="cpu", max_context=CONTEXT)


def _target_runners(engine_bundle):
    """(TensorRTRunner, ModelRunner on the CPU) for the target, with fresh caches."""
    manifest = Manifest.read(engine_bundle)
    spec = manifest.target
    reference = ModelRunner(str(engine_bundle / spec.onnx_file), spec, "cpu", CONTEXT, LIMITS.max_prefill)
    return tensorrt_runners(engine_bundle, manifest, CONTEXT)["target"], reference


def _prompt_ids(count: int, seed: int = 0) -> list:
    return np.random.default_rng(seed).integers(4, 100, count).tolist()


def test_load_goes_through_the_registry_onto_verified_engines(trt_decoder, engine_bundle, cudart):
    """provider="tensorrt-native" loads TensorRTRunners on the recorded engines, one context per profile."""
    manifest = Manifest.read(engine_bundle)
    for role, runner in (("target", trt_decoder.target), ("draft", trt_decoder.draft)):
        assert isinstance(runner, TensorRTRunner)
        record = manifest.engines[role]
        assert (record["tensorrt_version"], record["compute_capability"]) == ("10.3.0", "8.7")
        assert manifest.files[record["file"]] == record["sha256"]
        assert tuple(record["profiles"]) == ("decode", "verify", "prefill")
        assert [c.profile for c in runner.engine.contexts] == [0, 1, 2]
        assert runner.stream in cudart.streams


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_on_tensorrt_equals_target_only_on_onnxruntime(trt_decoder, cpu_decoder, prompt):
    """Chain, lookup and tree speculation through TensorRTRunner == target-only there == target-only on the CPU."""
    baseline = cpu_decoder.generate(prompt, max_new_tokens=32, num_draft_tokens=0).token_ids
    assert trt_decoder.generate(prompt, max_new_tokens=32, num_draft_tokens=0).token_ids == baseline
    modes = {"chain": dict(num_draft_tokens=3, proposer="draft"), "lookup": dict(num_draft_tokens=3, proposer="lookup"),
             "tree": dict(num_draft_tokens=3, proposer="draft", tree="2,2,1")}
    accepted = 0
    for name, options in modes.items():
        result = trt_decoder.generate(prompt, max_new_tokens=32, **options)
        assert result.token_ids == baseline, name
        accepted += result.stats.accepted
    assert accepted > 0  # drafts were accepted, so commits, truncations and compactions ran


def test_each_pass_binds_its_profile_shapes_and_cache_slots(engine_bundle, cudart):
    """decode T=1 / verify T<=16 / prefill: the right context; (1,T) ids, (1,T,past+T) mask, past at slot 0,
    new rows at slot ``past``; logits equal onnxruntime's on the same passes; everything on the runner's stream."""
    runner, reference = _target_runners(engine_bundle)
    spec, engine = runner.spec, runner.engine
    first_copy = len(cudart.copies)
    feeds = [(30, 2), (1, 0), (4, 1), (16, 1), (17, 2), (1, 0)]  # (T, expected profile)
    tokens = _prompt_ids(sum(t for t, _ in feeds))
    for count, profile in feeds:
        past = runner.length
        ids, positions = tokens[past : past + count], range(past, past + count)
        logits = runner.forward(ids, positions)
        np.testing.assert_allclose(logits, reference.forward(ids, positions), rtol=1e-5, atol=1e-5)
        run = engine.executions[-1]
        assert run.profile == profile and runner.contexts[profile].profile == profile
        assert run.shapes["input_ids"] == run.shapes["position_ids"] == (1, count)
        assert run.shapes["attention_mask"] == (1, count, past + count)
        assert run.output_shapes["logits"] == (1, count, spec.vocab_size)
        for layer, names in enumerate(spec.kv):
            for kind, (past_name, new_name) in enumerate(((names.past_key, names.new_key),
                                                          (names.past_value, names.new_value))):
                assert run.shapes[past_name] == (1, past, spec.num_kv_heads, spec.head_dim)
                assert run.addresses[past_name] == runner.kv.pointer(layer, kind, 0)
                assert run.addresses[new_name] == runner.kv.pointer(layer, kind, past)
                assert run.output_shapes[new_name] == (1, count, spec.num_kv_heads, spec.head_dim)
        runner.commit(count)
        reference.commit(count)
    assert {c.stream for c in cudart.copies[first_copy:]} == {runner.stream}
    assert {r.stream for r in engine.executions} == {runner.stream}


@pytest.mark.parametrize("count", [1, 4, 16, 17, 64])
def test_a_pass_ending_at_the_last_slot_fits_its_profile(engine_bundle, count):
    """Any T new tokens after any past with past + T <= max_context is inside the profile TensorRT would pick."""
    runner, reference = _target_runners(engine_bundle)
    tokens = _prompt_ids(CONTEXT)
    while runner.length < CONTEXT - count:
        chunk = min(LIMITS.max_prefill, CONTEXT - count - runner.length)
        for model in (runner, reference):
            model.forward(tokens[model.length : model.length + chunk], range(model.length, model.length + chunk))
            model.commit(chunk)
    ids, positions = tokens[-count:], range(CONTEXT - count, CONTEXT)
    np.testing.assert_allclose(runner.forward(ids, positions), reference.forward(ids, positions), rtol=1e-5, atol=1e-5)


def test_speculation_up_to_the_end_of_the_context(trt_decoder, cpu_decoder):
    """A request that fills max_context (allowed by the decoder) verifies drafts in the last slots: still exact."""
    prompt = _prompt_ids(200, seed=5)
    budget = CONTEXT - len(prompt) - 3 - 1
    baseline = cpu_decoder.generate(prompt, max_new_tokens=budget, num_draft_tokens=0).token_ids
    for options in (dict(num_draft_tokens=3, proposer="draft"), dict(num_draft_tokens=3, proposer="lookup")):
        assert trt_decoder.generate(prompt, max_new_tokens=budget, **options).token_ids == baseline


@pytest.mark.parametrize("planted_bug", [False, True])
def test_tree_compaction_moves_device_rows(engine_bundle, cudart, monkeypatch, planted_bug):
    """keep_path copies the accepted path's rows within the device cache: the next pass's logits equal a fresh
    target-only run over the same committed tokens (and differ when the rows are not moved: the planted bug)."""
    runner, _ = _target_runners(engine_bundle)
    fresh, _ = _target_runners(engine_bundle)
    prompt = _prompt_ids(20, seed=3)
    a, b, c, d, e = 11, 12, 13, 14, 15
    runner.forward(prompt, range(20))
    runner.commit(20)
    runner.forward([a, b, c, d], [20, 21, 21, 22], parents=[-1, 0, 0, 2])  # a -> {b, c}, c -> d
    copies = len(cudart.copies)
    if planted_bug:
        monkeypatch.setattr(runner, "_move_kv", lambda sources, first_slot: None)
    runner.keep_path([20, 22, 23], 20)  # the accepted path a, c, d: slots 22, 23 move to 21, 22
    moved = [copy for copy in cudart.copies[copies:] if copy.kind == "D2D"]
    assert len(moved) == (0 if planted_bug else 2 * 2 * runner.spec.num_layers)
    assert all(copy.nbytes == runner.kv.row_bytes for copy in moved)
    assert runner.length == 23
    fresh.forward(prompt + [a, c, d], range(23))
    fresh.commit(23)
    after_tree, expected = runner.forward([e], [23]), fresh.forward([e], [23])
    if planted_bug:
        assert not np.allclose(after_tree, expected, rtol=1e-4, atol=1e-4)
    else:
        np.testing.assert_allclose(after_tree, expected, rtol=1e-4, atol=1e-4)


def test_the_fakes_refuse_what_tensorrt_would_refuse(engine_bundle, cudart):
    """The contract checks are live: a shape outside the profile, an unbound input, a host pointer, overlaps."""
    runner, _ = _target_runners(engine_bundle)
    decode = runner.contexts[0]
    with pytest.raises(fake_nvidia.ContractViolation, match="outside profile 0"):
        decode.set_input_shape("input_ids", (1, 2))
    with pytest.raises(fake_nvidia.ContractViolation, match="chosen by another execution context"):
        runner.contexts[1].set_optimization_profile_async(0, runner.stream)
    host = np.zeros(4, dtype=np.int64)
    with pytest.raises(fake_nvidia.ContractViolation, match="not device memory"):
        decode.set_tensor_address("input_ids", host.ctypes.data)
    with pytest.raises(fake_nvidia.ContractViolation, match="host-to-device destination"):
        runner._ids.upload(runner._ids.nbytes - 8, np.zeros(2, dtype=np.int64), runner.stream)
    with pytest.raises(fake_nvidia.ContractViolation, match="overlapping"):
        runner.kv.buffer.copy_within(0, 8, 16, runner.stream)
    fresh = runner.engine.create_execution_context()
    with pytest.raises(fake_nvidia.ContractViolation, match="unset shapes or addresses"):
        fresh.execute_async_v3(runner.stream)


def test_a_plan_tensorrt_cannot_deserialize_is_a_one_line_error(engine_bundle, tmp_path):
    """deserialize_cuda_engine returns None for a plan it cannot load (TensorRT logs why): a BundleError, no traceback."""
    from specdec.contract.manifest import BundleError

    plan = tmp_path / "target.engine"
    plan.write_bytes(b"a plan from another TensorRT")
    with pytest.raises(BundleError, match="could not deserialize .*rebuild it with specdec-export build-engine"):
        TensorRTRunner(str(plan), Manifest.read(engine_bundle).target, LIMITS, CONTEXT)


def test_an_engine_whose_profiles_cannot_take_the_decoders_passes_is_refused_at_load(engine_bundle):
    """Engines built with max_prefill below the decoder's 64-token passes (prompt chunks, trees): one line at
    load, not a failed pass in the middle of a generation."""
    from specdec.runners.tensorrt.runner import MAX_PASS_TOKENS
    from specdec.contract.manifest import BundleError

    small = ProfileLimits(max_context=CONTEXT, max_verify=16, max_prefill=MAX_PASS_TOKENS - 1)
    plan = engine_bundle / Manifest.read(engine_bundle).engines["target"]["file"]
    with pytest.raises(BundleError, match=f"takes {MAX_PASS_TOKENS - 1} tokens per pass.*max_prefill >= 64"):
        TensorRTRunner(str(plan), Manifest.read(engine_bundle).target, small, CONTEXT)
