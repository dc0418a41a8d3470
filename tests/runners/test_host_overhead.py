"""The host side of a pass binds the cache in place: no per-step copy, no rebinding, no writes outside the new rows.

Counted, not timed (the machines running this are shared): what a pass binds, and what it allocates
(tracemalloc sees numpy's buffers). For the default runner (``FusedRunner``, the fused graph) the
onnxruntime run is real; for the standard ``ModelRunner`` it is replaced (the fixture makes it a no-op;
one test swaps in a recording IOBinding and a fake run that writes the new rows through the bound pointers):
- fused: a pass rebinds only its small per-pass inputs and the logits, never a KV buffer (bound once, at
  construction, to the cache itself), and the graph's present outputs are the cache's own blocks;
- standard: the bound past/new-row pointers are the cache's own slots, and a fake graph writing through
  them changes exactly the new rows of the array the runner keeps (past and future slots hold a
  sentinel that must survive);
- both: a pass at context 1,500 allocates nothing near the size of the cache (a per-step copy of the
  whole cache, or of the past, would), and what a pass allocates grows with the context by far less than
  the KV of the added slots (work proportional to the past's KV would not).
"""

import ctypes
import os
import tracemalloc

import numpy as np
import pytest

from specdec.runners.sessions import SessionHolder

PAST, NEW = 1500, 5
SENTINEL = np.float32(-3.25)
MARKER_BYTE = 0x41  # the fake graph fills new rows with this byte: float32 12.078431
MARKER = np.frombuffer(bytes([MARKER_BYTE] * 4), dtype=np.float32)[0]


def _at_context(runner, past: int) -> None:
    runner.length = past
    runner.slot_positions[:past] = np.arange(past)


class RecordingBinding:
    """Stands in for onnxruntime's IOBinding: name -> (shape, pointer) of what the runner binds."""

    def __init__(self):
        self.inputs, self.outputs = {}, {}

    def clear_binding_inputs(self):
        self.inputs.clear()

    def clear_binding_outputs(self):
        self.outputs.clear()

    def bind_input(self, name, device, device_id, dtype, shape, pointer):
        self.inputs[name] = (list(shape), int(pointer))

    def bind_output(self, name, device, device_id, dtype, shape, pointer):
        self.outputs[name] = (list(shape), int(pointer))


def test_pass_binds_the_cache_in_place_and_writes_only_the_new_rows(long_decoder_bundle_free_runner):
    """Past = slots [0, PAST) of the kept cache array, new rows = [PAST, PAST+NEW); nothing else is touched."""
    runner = long_decoder_bundle_free_runner
    spec = runner.spec
    cache = runner.kv.array  # the one array the runner must keep reading and writing
    cache[...] = SENTINEL
    binding = RecordingBinding()
    runner._binding = binding
    new_names = {name for names in spec.kv for name in (names.new_key, names.new_value)}

    def fake_graph(bound):  # writes every new KV row through the bound pointer, as the real graph does
        for name in new_names:
            shape, pointer = bound.outputs[name]
            ctypes.memset(pointer, MARKER_BYTE, int(np.prod(shape)) * cache.itemsize)

    runner.session.run_with_iobinding = fake_graph
    _at_context(runner, PAST)
    runner.forward([3] * NEW, range(PAST, PAST + NEW))

    same_array = runner.kv.array is cache
    assert same_array, "the cache array was replaced during a pass"
    rows = [1, None, spec.num_kv_heads, spec.head_dim]
    for layer, names in enumerate(spec.kv):
        for kind, past_name, new_name in ((0, names.past_key, names.new_key), (1, names.past_value, names.new_value)):
            past_bound = (rows[:1] + [PAST] + rows[2:], cache[layer, kind, 0, 0].ctypes.data)
            new_bound = (rows[:1] + [NEW] + rows[2:], cache[layer, kind, 0, PAST].ctypes.data)
            assert binding.inputs[past_name] == past_bound, f"{past_name} is not bound to the cache's slots 0..{PAST}"
            assert binding.outputs[new_name] == new_bound, f"{new_name} is not bound to the cache's slots after the past"
    assert np.all(cache[:, :, :, :PAST] == SENTINEL), "past rows were written on the host"
    assert np.all(cache[:, :, :, PAST: PAST + NEW] == MARKER), "the graph's new rows did not land in the cache"
    assert np.all(cache[:, :, :, PAST + NEW:] == SENTINEL), "slots after the new rows were written"


def _fused_runner(bundle_per_form):
    """The default runner (make_runner on a fused bundle): a 2,048-slot FusedRunner with a real onnxruntime session."""
    from specdec.contract.manifest import Manifest
    from specdec.runners.factory import make_runner
    from specdec.runners.fused import FusedRunner

    bundle, _ = bundle_per_form("llama", "fused")
    spec = Manifest.read(bundle).target
    runner = make_runner(str(bundle / spec.onnx_file), spec, "cpu", 2048, 64)
    assert isinstance(runner, FusedRunner)
    return runner


@pytest.fixture
def fused_runner(bundle_per_form):
    return _fused_runner(bundle_per_form)


def _kv_bytes(runner, slots: int) -> int:
    """Bytes of keys and values ``slots`` slots hold (every layer)."""
    from specdec.runners.fused import FusedRunner

    if isinstance(runner, FusedRunner):  # [layers, 2, 1, kv_heads, slots, head_dim]
        return runner.cache[..., :slots, :].nbytes
    return runner.kv.array[:, :, :, :slots].nbytes


class CountingBinding:
    """Wraps onnxruntime's IOBinding: every name bound, in order."""

    def __init__(self, real):
        self.real, self.bound = real, []

    def bind_input(self, name, *args):
        self.bound.append(name)
        self.real.bind_input(name, *args)

    def bind_output(self, name, *args):
        self.bound.append(name)
        self.real.bind_output(name, *args)

    def __getattr__(self, name):
        return getattr(self.real, name)


class UnwrappingSession:
    """The runner's session, handing onnxruntime the real binding inside a CountingBinding."""

    def __init__(self, real):
        self.real = real

    def run_with_iobinding(self, binding):
        self.real.run_with_iobinding(binding.real)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_fused_pass_rebinds_only_its_per_pass_inputs(fused_runner):
    """20 real passes at context 1,500: each binds ids, positions, bias and logits once, never a KV buffer; the
    graph's KV outputs stay views of the cache (folded attention: each KV head's rows, bound on the first pass and
    again only when the pass's total crosses a 256-row chunk; GroupQueryAttention: each layer's block, bound at
    construction)."""
    runner = fused_runner
    spec = runner.spec
    folded = spec.attention == "folded"
    kv_names = {name for layer in range(spec.num_layers) for names in spec.kv_tensors(layer) for name in names}
    cache = runner.cache
    binding = CountingBinding(runner._live_binding())
    runner._binding, runner.sessions = binding, SessionHolder(None, UnwrappingSession(runner.session))
    _at_context(runner, PAST)
    per_pass = []
    for _ in range(20):
        binding.bound.clear()
        runner.forward([3] * NEW, range(PAST, PAST + NEW))
        per_pass.append(list(binding.bound))
    expected = ["input_ids", "position_ids", "attention_bias", "logits"]
    first = set(per_pass[0]) - kv_names if folded else set(per_pass[0])
    if folded:
        assert kv_names <= set(per_pass[0]), "the first pass binds every KV view"
    if spec.has_input("logit_rows"):  # bound again only when the rows asked for change (here: after the fill)
        assert sorted(first) in (sorted(expected), sorted(expected + ["logit_rows"])), per_pass[0]
        per_pass = per_pass[1:]
    for bound in per_pass:
        assert not kv_names & set(bound), f"a pass rebound KV buffers: {sorted(kv_names & set(bound))}"
        assert sorted(bound) == sorted(expected), bound
    assert runner.cache is cache, "the cache array was replaced during a pass"
    pointers = {value.data_ptr() for value in binding.real.get_outputs()}
    heads = range(spec.num_kv_heads) if folded else [slice(None)]
    blocks = {cache[layer, kind, 0, head].ctypes.data for layer in range(spec.num_layers) for kind in (0, 1)
              for head in heads}
    assert blocks <= pointers and len(pointers) == len(blocks) + 1, "a KV output is not a view of the cache"


def _pass_peak(runner, past: int, passes: int = 20) -> int:
    """Peak bytes allocated (tracemalloc: Python objects and numpy buffers) over ``passes`` passes at ``past``."""
    _at_context(runner, past)
    runner.forward([3] * NEW, range(past, past + NEW))  # warm caches (chain masks) outside the measurement
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(passes):
            runner.forward([3] * NEW, range(past, past + NEW))
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.fixture(params=["fused", "standard"])
def any_runner(request, bundle_per_form, long_decoder_bundle_free_runner):
    """The default FusedRunner (real run) and the standard ModelRunner (no-op run)."""
    return _fused_runner(bundle_per_form) if request.param == "fused" else long_decoder_bundle_free_runner


def test_pass_allocates_nothing_cache_sized(any_runner):
    """20 passes at context 1,500 allocate (peak) less than 1/16 of the past's KV bytes: no copy of cache or past."""
    past_bytes = _kv_bytes(any_runner, PAST)
    peak = _pass_peak(any_runner, PAST)
    assert peak < past_bytes / 16, (peak, past_bytes)


def test_pass_allocations_are_flat_in_the_context(any_runner):
    """From context 100 to 1,500 a pass's peak allocation grows by less than 1/8 of the KV the 1,400 added slots
    hold: the per-pass host work (mask, bias) is O(T x context) booleans/floats, never O(context x KV row)."""
    short, long = _pass_peak(any_runner, 100), _pass_peak(any_runner, PAST)
    assert long - short < _kv_bytes(any_runner, PAST - 100) / 8, (short, long)


def _resident_bytes(array) -> int:
    """Resident bytes of the mappings ``array``'s memory lies in (/proc/self/smaps)."""
    from specdec.runners.proc_maps import read_smaps

    low = array.ctypes.data
    high = low + array.nbytes
    return sum(m.rss_kb * 1024 for m in read_smaps() if m.start < high and m.end > low)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_cache_is_resident_only_where_rows_were_written():
    """One row written in each of 64 regions of 4 MiB (a cache's per-layer, per-head views) brings in about 64
    pages, not 64 transparent huge pages of 2 MiB each: numpy's zeros (which ask for huge pages on arrays of
    4 MiB and more) gave 128 MiB on this project's CI VM (THP ``madvise``) and fail it; where THP is off, both pass."""
    from specdec.runners.kv_store import cache_zeros

    cache = cache_zeros((64, 2048, 1024), np.float16)
    assert cache.shape == (64, 2048, 1024) and cache.dtype == np.float16
    cache[:, 5, :] = 1.0  # written before anything is read: a read could map a shared zero page first
    assert _resident_bytes(cache) < 4 * 2**20, _resident_bytes(cache)
    assert float(cache[:, 5].sum(dtype=np.float64)) == 64 * 1024 and not cache[:, ::97].any()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_released_cache_pages_leave_memory_and_read_as_zeros():
    """release_pages after 32 MiB of written rows: under 1 MiB resident, every byte zero again, and the cache takes
    new rows (a release that does nothing, or numpy's zeros, which it cannot release, keeps 32 MiB and fails)."""
    from specdec.runners.kv_store import cache_zeros, release_pages

    cache = cache_zeros((8, 2048, 1024), np.float16)
    if cache.base is None:
        pytest.skip("cache_zeros falls back to numpy's zeros on this platform")
    cache[:] = 1.0
    assert _resident_bytes(cache) >= 32 * 2**20
    assert release_pages(cache[2:4]) is True  # any view of the cache releases all of it
    assert _resident_bytes(cache) < 2**20, _resident_bytes(cache)
    assert not cache.any()
    cache[:, 7] = 2.0
    assert float(cache[:, 7].sum(dtype=np.float64)) == 8 * 1024 * 2.0
    assert release_pages(np.ones(4, np.float16)) is False


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_released_slots_leave_memory_from_the_first_whole_page_and_earlier_rows_stay():
    """release_slots from slot 40 of every KV head's region (256-byte slots: 16 a page): slots 48 on read zero and
    leave memory, slots 0-47 keep their bytes (the page holding slots 32-47 is kept whole). A release of whole
    regions, or none, fails."""
    from specdec.runners.kv_store import cache_zeros, release_slots

    cache = cache_zeros((4, 2, 1, 2, 2048, 128), np.float16)  # [layers, 2, 1, kv heads, slots, head_dim]
    if cache.base is None:
        pytest.skip("cache_zeros falls back to numpy's zeros on this platform")
    cache[:] = 1.0
    assert release_slots(cache, 4, 40) == 16 * 2000 * 256
    assert (cache[..., :48, :] == 1.0).all() and not cache[..., 48:, :].any()
    assert _resident_bytes(cache) < 16 * 48 * 256 + 2**20, _resident_bytes(cache)
    assert release_slots(np.ones((2, 64, 8), np.float16), 1, 16) == 0


def test_a_shorter_conversation_gives_back_the_longer_one_s_rows(monkeypatch):
    """After a 300-token prompt, a new 40-token one: the target's rows past it are given back (read as zeros
    again), the tokens are a fresh decoder's, and the next turn keeps every row it reuses. Without the call in
    the decoder the cache still holds 300 rows of ones and this fails."""
    from scripted import ScriptedRunner, scripted_decoder
    from specdec.runners.kv_store import cache_zeros

    class CachedRunner(ScriptedRunner):  # a host cache whose rows the passes write (ones)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cache = cache_zeros((2, 2, 1, self.max_context, 1, 64), np.float32)

        def _run(self, ids, positions, mask, sliding, past):
            self.cache[:, :, :, past : past + len(ids)] = 1.0
            return super()._run(ids, positions, mask, sliding, past)

    decoder = scripted_decoder(max_context=1024, draft_runner=CachedRunner)
    decoder.target = target = CachedRunner(decoder.target.model, 1024)
    if target.cache.base is None:
        pytest.skip("cache_zeros falls back to numpy's zeros on this platform")
    long_prompt = [(j * 5 + j // 7) % 15 for j in range(300)]
    decoder.generate(long_prompt, max_new_tokens=8, num_draft_tokens=0)
    assert target.cache[:, :, :, 299].all() and target.rows_written >= 300
    short = long_prompt[:40][::-1]
    reply = decoder.generate(short, max_new_tokens=8)
    assert not target.cache[:, :, :, 128:300].any(), "the long prompt's rows are still there"
    assert reply.token_ids == scripted_decoder(max_context=1024).generate(short, max_new_tokens=8).token_ids
    turn = short + reply.token_ids + [3, 4]
    assert decoder.generate(turn, max_new_tokens=8).stats.cached_tokens >= len(short) + len(reply.token_ids) - 1
    assert target.cache[:, :, :, : len(turn) - 1].all()  # no row it holds was given back


def test_load_and_calibration_release_their_random_rows(tiny_bundle, monkeypatch, tmp_path):
    """The load's row check and the first calibration write rows no request reads: each gives the caches' pages
    back (Runner.release_cache) before any request; removing either call fails this. A later load reads the stored
    checks and writes no rows."""
    from specdec.decoding.decoder import SpeculativeDecoder
    from specdec.runners.runner import Runner

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # nothing measured on this machine yet
    released = []
    monkeypatch.setattr(Runner, "release_cache", lambda self: released.append(self.spec.num_layers))
    SpeculativeDecoder.load(tiny_bundle, max_context=256, verify=False)
    assert len(released) == 1  # the target, after its row check
    released.clear()
    decoder = SpeculativeDecoder.load(tiny_bundle, max_context=256, verify=False)
    assert len(released) == 0  # the checks read from the store: no rows written
    decoder.wrap_target(lambda runner: runner)  # costs forgotten: measured here, never stored on this machine
    decoder.costs()
    assert len(released) == 2  # then both models, after the calibration


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_NOHUGEPAGE"), reason="cache_zeros falls back to np.zeros")
def test_every_host_cache_is_allocated_by_cache_zeros(any_runner):
    """The runners' caches are the mapping cache_zeros makes (an mmap under the array), not numpy's zeros."""
    import mmap

    from specdec.runners.fused import FusedRunner
    from specdec.runners.kv_store import cache_mapping

    cache = any_runner.cache if isinstance(any_runner, FusedRunner) else any_runner.kv.array
    assert isinstance(cache_mapping(cache), mmap.mmap), type(cache.base)
