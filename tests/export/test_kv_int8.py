"""The int8 KV cache (``--kv-dtype int8``, llama.cpp's ``q8_0`` KV with a scale per row of head_dim values).

The rows are stored as the graph writes them (export/folded_attention._int8_rows); runners/kv_int8.py is that rule
in numpy, and the snapshot layout the RAM cache and slot files keep. What must hold, each shown to fail on a
planted bug: the graph quantizes exactly as the numpy rule does; verify rows equal one-token passes bit for bit,
so greedy speculation in every mode is target-only decoding at int8 KV and seeded sampling is target-only's
seeded sample; a snapshot restores the cache exactly (a warm prompt gives the cold prompt's tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from every_mode import assert_every_mode_is_target_only

from specdec.contract.manifest import BundleError, Manifest
from specdec.runners import kv_int8


def test_rows_round_trip_within_half_a_step_and_zero_rows_stay_zero():
    rows = np.random.default_rng(0).standard_normal((3, 5, 16), dtype=np.float32) * 4
    rows[1, 2] = 0.0
    steps, scales = kv_int8.quantize_rows(rows)
    assert steps.dtype == np.int8 and scales.shape == (3, 5, 1) and scales.dtype == np.float32
    assert np.abs(steps).max() == 127
    error = np.abs(kv_int8.dequantize_rows(steps, scales) - rows)
    assert (error <= scales / 2 * (1 + 1e-6)).all()
    assert not steps[1, 2].any() and np.isfinite(scales).all()


def test_a_snapshot_packs_each_rows_scale_after_its_steps_and_unpacks_exactly():
    steps, scales = kv_int8.quantize_rows(np.random.default_rng(1).standard_normal((2, 4, 7, 8), dtype=np.float32))
    packed = kv_int8.pack_rows(steps, scales)
    assert packed.dtype == np.int8 and packed.shape == (2, 4, 7, 8 + kv_int8.SCALE_BYTES)
    again_steps, again_scales = kv_int8.unpack_rows(packed)
    assert np.array_equal(again_steps, steps) and np.array_equal(again_scales, scales)


def test_the_memory_budget_counts_an_int8_rows_scale():
    from specdec.runners.memory import kv_bytes_per_token

    spec = lambda dtype: type("S", (), dict(num_layers=2, num_kv_heads=3, head_dim=64, kv_dtype=dtype))  # noqa: E731
    manifest = lambda dtype: type("M", (), dict(models=lambda self: {"target": spec(dtype)}))()  # noqa: E731
    assert kv_bytes_per_token(manifest("int8")) == 2 * 2 * 3 * (64 + 4)
    assert kv_bytes_per_token(manifest("float16")) == 2 * 2 * 3 * 64 * 2


pytest.importorskip("torch")


@pytest.fixture(scope="module")
def int8_bundle(tiny_pair_dirs, tmp_path_factory):
    from specdec.export.bundle import ExportOptions, export_bundle

    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("kv_int8") / "bundle"
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, kv_dtype="int8"),
                  progress=lambda message: None)
    return out


@pytest.fixture(scope="module")
def float_bundle(tiny_pair_dirs, tmp_path_factory):
    from specdec.export.bundle import ExportOptions, export_bundle

    target, _ = tiny_pair_dirs
    out = tmp_path_factory.mktemp("kv_float") / "bundle"
    export_bundle(ExportOptions(target=str(target), draft=None, out=out, kv_dtype="float32", parity=False),
                  progress=lambda message: None)
    return out


def _smoothing(bundle, role="target"):
    """[layers, kv_heads, D] key factors of the bundle's int8 graph."""
    from specdec.export.kv_smoothing import read_key_smoothing

    spec = getattr(Manifest.read(bundle), role)
    return read_key_smoothing(bundle / spec.onnx_file, spec.num_layers, spec.num_kv_heads)


def _runner(bundle, role="target", max_context=256):
    from specdec.runners.factory import make_runner

    spec = getattr(Manifest.read(bundle), role)
    return make_runner(str(bundle / spec.onnx_file), spec, "cpu", max_context, 64)


@pytest.mark.integration
def test_the_manifest_the_cache_and_export_parity_say_int8(int8_bundle, float_bundle):
    """Both models' caches are int8 with a float32 scale per row: (head_dim + 4) / (4 head_dim) of float32's bytes;
    verify rows equal one-token passes bit for bit (parity ``rows_vs_decode``)."""
    manifest = Manifest.read(int8_bundle)
    assert manifest.target.kv_dtype == manifest.draft.kv_dtype == "int8"
    assert {t.name for t in manifest.target.inputs} >= {"past.0.key_scale.0", "past.1.value_scale.1"}
    runner, single = _runner(int8_bundle), _runner(float_bundle)
    assert runner.cache.dtype == np.int8 and runner.scales.dtype == np.float32
    dim = manifest.target.head_dim
    assert runner.cache.nbytes + runner.scales.nbytes == single.cache.nbytes * (dim + 4) // (4 * dim)
    for role in ("target", "draft"):
        report = manifest.extra["parity_max_abs_error"][role]["float"]
        assert report["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}, report


@pytest.mark.integration
@pytest.mark.parametrize("divisor", [127.0, 126.0], ids=["rule", "planted: another scale"])
def test_the_graph_writes_rows_by_the_numpy_rule(int8_bundle, float_bundle, divisor):
    """A prefill from an empty cache: layer 0's keys and values are the same float rows in the float32 bundle, so
    the int8 bundle's steps and scales must be exactly ``quantize_rows`` of them (a scale of max/126: differs)."""
    ids = np.random.default_rng(4).integers(3, 120, 40)
    quantized, single = _runner(int8_bundle), _runner(float_bundle)
    for runner in (quantized, single):
        runner.forward(ids, range(40))
    rows = single.cache[0, :, 0, :, :40].astype(np.float32)  # [2, kv_heads, 40, D]
    rows[0] /= _smoothing(int8_bundle)[0][:, None]  # the keys are stored smoothed (export/kv_smoothing.py)
    scales = np.maximum(np.abs(rows).max(-1, keepdims=True) / np.float32(divisor), kv_int8.SMALLEST_SCALE)
    steps = np.clip(np.round(rows / scales), -127, 127).astype(np.int8)
    same = np.array_equal(quantized.cache[0, :, 0, :, :40], steps) and \
        np.array_equal(quantized.scales[0, :, 0, :, :40], scales)
    assert same == (divisor == 127.0)
    if divisor == 127.0:  # the rule written out above is runners/kv_int8's
        assert all(np.array_equal(a, b) for a, b in zip(kv_int8.quantize_rows(rows), (steps, scales)))


@pytest.mark.integration
def test_greedy_and_seeded_sampling_in_every_mode_are_target_only_at_int8(int8_bundle):
    assert_every_mode_is_target_only(int8_bundle)


@pytest.mark.integration
@pytest.mark.parametrize("planted", [False, True], ids=["exact", "planted: scales not restored"])
def test_a_snapshot_restores_rows_and_scales(int8_bundle, monkeypatch, planted):
    """Snapshot after a prefill, restore into a fresh runner: the next pass's logits are the original runner's bit for
    bit. Planted: a restore that leaves the scales as they were (zeros) must change them."""
    from specdec.runners.folded import FoldedRunner

    ids = np.random.default_rng(5).integers(3, 120, 50)
    source = _runner(int8_bundle)
    source.forward(ids, range(50))
    source.commit(50)
    snapshot = source.snapshot()
    assert snapshot.rows.dtype == np.int8 and snapshot.rows.shape[-1] == source.cache.shape[-1] + 4
    assert snapshot.nbytes == source.snapshot_bytes(50)
    if planted:
        monkeypatch.setattr(FoldedRunner, "_set_kv_rows", lambda self, rows, count: self.cache.__setitem__(
            (slice(None),) * 4 + (slice(0, count),), kv_int8.unpack_rows(rows[:, :, :, :, :count])[0]))
    restored = _runner(int8_bundle)
    restored.restore(snapshot, 50)
    expected = source.forward([7], [50]).copy()
    assert np.array_equal(restored.forward([7], [50]), expected) != planted


@pytest.mark.integration
def test_random_rows_and_release_cover_the_scales(int8_bundle):
    """``fill_random`` (calibration and row checks at depth) writes valid int8 rows; ``release_cache`` empties the
    scales with the rows."""
    from specdec.runners.runner import fill_random

    runner = _runner(int8_bundle)
    fill_random(runner, 200)
    assert np.isfinite(runner.forward([5, 6], [200, 201])).all()
    assert runner.scales[:, :, :, :, :200].min() > 0
    runner.release_cache()
    assert not runner.scales.any() and not runner.cache.any()


@pytest.mark.integration
def test_an_int8_manifest_without_its_scales_or_on_gqa_is_refused(int8_bundle):
    data = json.loads((int8_bundle / "manifest.json").read_text())
    data["target"]["inputs"] = [t for t in data["target"]["inputs"] if t["name"] != "past.1.value_scale.0"]
    with pytest.raises(BundleError, match="kv_dtype int8 needs a float32 \\[cache_rows, 1\\] tensor 'past.1.value_scale.0'"):
        Manifest.from_json(json.dumps(data))
    data = json.loads((int8_bundle / "manifest.json").read_text())
    data["draft"]["attention"] = "gqa"
    with pytest.raises(BundleError, match="attention"):
        Manifest.from_json(json.dumps(data))


@pytest.mark.integration
@pytest.mark.parametrize("planted", [None, "scales", "smoothing"],
                         ids=["scaled", "planted: scales ignored", "planted: keys read unsmoothed"])
def test_int8_attention_reads_the_rows_it_stored(int8_bundle, float_bundle, planted):
    """The int8 bundle's next passes (one token: the main graph; 40 tokens: the chunked Scan) against the float32
    bundle given the same rows dequantized (keys times their smoothing factors): the same weights read the same
    keys and values, so the logits differ by the rounding of the new rows only. Planted: every stored scale set to 1
    (the scales not applied), or the smoothed keys handed over as they are stored: far off."""
    ids = np.random.default_rng(6).integers(3, 120, 300)
    quantized, single = _runner(int8_bundle, max_context=512), _runner(float_bundle, max_context=512)
    for start in range(0, 300, 60):
        quantized.forward(ids[start : start + 60], range(start, start + 60))
        quantized.commit(60)
    rows = kv_int8.dequantize_rows(quantized.cache[:, :, :, :, :300], quantized.scales[:, :, :, :, :300])
    if planted != "smoothing":
        rows[:, 0] *= _smoothing(int8_bundle)[:, None, :, None, :]  # [layers, 1, kv_heads, 1, D]
    single.cache[:, :, :, :, :300] = rows
    single.slot_positions[:300] = np.arange(300)
    single.length = 300
    if planted == "scales":
        quantized.scales[:, :, :, :, :300] = 1.0
    for count in (1, 40):
        new = np.random.default_rng(count).integers(3, 120, count)
        got = quantized.forward(new, range(300, 300 + count)).copy()
        want = single.forward(new, range(300, 300 + count)).copy()
        error = np.abs(got - want).max() / np.abs(want).max()
        assert (error < 0.05) == (planted is None), (count, error)


@pytest.mark.integration
@pytest.mark.parametrize("planted", [False, True], ids=["moved", "planted: scales left behind"])
def test_a_kept_tree_path_moves_its_rows_scales(int8_bundle, monkeypatch, planted):
    """``keep_path`` (a tree's accepted path compacted) moves each row's scale with its steps. Planted: the float
    cache's move (steps only)."""
    from specdec.runners.fused import FusedRunner

    if planted:
        from specdec.runners.folded import FoldedRunner

        monkeypatch.setattr(FoldedRunner, "_move_kv", FusedRunner._move_kv)
    runner = _runner(int8_bundle)
    runner.forward(np.random.default_rng(7).integers(3, 120, 30), range(30))
    sources = np.array([21, 25, 29])
    rows, scales = runner.cache[:, :, :, :, sources].copy(), runner.scales[:, :, :, :, sources].copy()
    runner.keep_path(sources, 20)
    assert np.array_equal(runner.cache[:, :, :, :, 20:23], rows)
    assert np.array_equal(runner.scales[:, :, :, :, 20:23], scales) != planted


def test_smoothed_keys_keep_the_small_channels_that_a_row_scale_rounds_away():
    """Keys with two channels 40x the rest (Qwen2's k_proj biases): quantized per row as they are, q . k loses the
    small channels; divided by ``key_factors`` first (and q multiplied by them), the scores stay close. Planted:
    factors of 1 (no smoothing) keep the error."""
    from specdec.export.kv_smoothing import key_factors

    rng = np.random.default_rng(8)
    keys = rng.standard_normal((400, 2, 64), dtype=np.float32)
    keys[:, :, [3, 40]] = 40 + rng.standard_normal((400, 2, 2), dtype=np.float32)
    queries = rng.standard_normal((2, 64), dtype=np.float32)
    exact = np.einsum("shd,hd->sh", keys, queries)
    calibration, later = keys[:200], keys[200:]

    def score_error(factors):
        steps, scales = kv_int8.quantize_rows(later / factors)
        read = kv_int8.dequantize_rows(steps, scales)
        return np.abs(np.einsum("shd,hd->sh", read, queries * factors) - exact[200:]).mean()

    factors = key_factors(calibration)
    assert factors.shape == (2, 64) and factors.dtype == np.float32 and (factors > 0).all()
    peak = np.abs(calibration[:, :, 3]).max(0)
    assert (factors[:, 3] >= peak).all() and (factors[:, 3] < 2 * peak).all()
    assert np.array_equal(np.exp2(np.round(np.log2(factors))), factors)  # powers of two: exact to divide by
    assert score_error(factors) < score_error(np.ones_like(factors)) / 4


@pytest.mark.parametrize("planted", [False, True], ids=["pair peaks", "planted: channel peaks"])
def test_smoothing_holds_where_the_rotary_embedding_has_turned_the_outliers(planted):
    """Calibration sees a few hundred positions, where a slow rotary pair has barely turned: its outlier sits in
    channel 3, channel 35 (its partner, D/2 on) stays small. At a far position the pair has turned by pi/2 and the
    outlier is in channel 35. Factors from the pair's magnitude keep the score error of the calibration positions;
    per-channel peaks (planted) give channel 35 a small factor and the rows' scales blow up."""
    from specdec.export import kv_smoothing

    rng = np.random.default_rng(9)
    keys = rng.standard_normal((400, 2, 64), dtype=np.float32)
    keys[:, :, 3] = 40 + rng.standard_normal((400, 2), dtype=np.float32)
    queries = rng.standard_normal((2, 64), dtype=np.float32)
    turned = keys[200:].copy()
    turned[:, :, 3], turned[:, :, 35] = -keys[200:, :, 35], keys[200:, :, 3]  # the pair rotated by pi/2

    def score_error(factors, rows):
        steps, scales = kv_int8.quantize_rows(rows / factors)
        read = kv_int8.dequantize_rows(steps, scales)
        return np.abs(np.einsum("shd,hd->sh", read, queries * factors) - np.einsum("shd,hd->sh", rows, queries)).mean()

    if planted:
        peaks = np.abs(keys[:200]).max(0)
        factors = np.exp2(np.ceil(np.log2(np.maximum(peaks, peaks.max(-1, keepdims=True) / 64))))
    else:
        factors = kv_smoothing.key_factors(keys[:200])
    near, far = score_error(factors, keys[200:]), score_error(factors, turned)
    assert (far < 1.5 * near) != planted, (near, far)
