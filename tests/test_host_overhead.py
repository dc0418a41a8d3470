"""The host side of a pass (binding the cache, filling masks) does not grow with the context length.

The onnxruntime run itself is replaced by a no-op, so only the runtime's own per-step work is
timed; a per-step copy or concatenation of the cache would make the long-context step many
times slower than the short one.
"""

import time

import numpy as np


def _host_seconds(runner, past: int, tokens: int, repeats: int = 300) -> float:
    runner.length = past
    runner.slot_positions[:past] = np.arange(past)
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


def test_cache_buffers_are_not_reallocated_per_step(long_decoder_bundle_free_runner):
    runner = long_decoder_bundle_free_runner
    base, logits = runner.kv.base, runner._logits.ctypes.data
    _host_seconds(runner, 1000, 9, repeats=5)
    assert runner.kv.base == base and runner._logits.ctypes.data == logits
