"""The host side of a pass binds the cache in place: no per-step copy, no writes outside the new rows.

The onnxruntime run is replaced (the fixture makes it a no-op; two tests swap in a recording
IOBinding and a fake run that writes the new rows through the bound pointers), so only the
runtime's own per-step work is observed. Three independent checks, each able to fail:
- the bound past/new-row pointers are the cache's own slots, and a fake graph writing through
  them changes exactly the new rows of the array the runner keeps (past and future slots hold a
  sentinel that must survive);
- a pass at context 1,500 allocates nothing near the size of the cache (tracemalloc sees numpy
  buffers): a per-step copy of the whole cache, or of the past, would;
- the step time is flat in the context length (catches work proportional to the past, but not
  a copy of the whole fixed-size cache, which costs the same at every length).
"""

import ctypes
import time
import tracemalloc

import numpy as np

PAST, NEW = 1500, 5
SENTINEL = np.float32(-3.25)
MARKER_BYTE = 0x41  # the fake graph fills new rows with this byte: float32 12.078431
MARKER = np.frombuffer(bytes([MARKER_BYTE] * 4), dtype=np.float32)[0]


def _at_context(runner, past: int) -> None:
    runner.length = past
    runner.slot_positions[:past] = np.arange(past)


def _host_seconds(runner, past: int, tokens: int, repeats: int = 300) -> float:
    _at_context(runner, past)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        runner.forward([3] * tokens, range(past, past + tokens))
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def test_host_step_time_is_flat_in_context_length(long_decoder_bundle_free_runner):
    runner = long_decoder_bundle_free_runner
    short = _host_seconds(runner, 100, 5)
    long = _host_seconds(runner, 1500, 5)
    assert long < 2.0 * short + 50e-6, (short, long)


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


def test_pass_allocates_nothing_cache_sized(long_decoder_bundle_free_runner):
    """20 passes at context 1,500 allocate (peak) less than 1/16 of the past's KV bytes: no copy of cache or past."""
    runner = long_decoder_bundle_free_runner
    past_bytes = runner.kv.array[:, :, :, :PAST].nbytes
    _at_context(runner, PAST)
    runner.forward([3] * NEW, range(PAST, PAST + NEW))  # warm caches (chain masks) outside the measurement
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            runner.forward([3] * NEW, range(PAST, PAST + NEW))
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < past_bytes / 16, (peak, past_bytes)
