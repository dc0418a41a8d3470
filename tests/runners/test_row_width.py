"""Pass widths whose rows round apart: ``row_parity.exact_width`` finds the widest exact one, and prefill keeps to it.

A fake runner stands in for onnxruntime: its rows are a function of (token, position) unless a pass is at least
``apart`` tokens wide (and, optionally, only behind a deep cache), where they move by a rounding-sized step, as
the threaded SGEMM of a wide folded-attention pass does on some CPUs.
"""

from types import SimpleNamespace

import numpy as np

from specdec.contract.limits import PREFILL_CELLS, PREFILL_WIDTHS, prefill_width
from specdec.decoding.rounds import catch_up
from specdec.runners.row_parity import DEEP, WIDTHS, exact_width
from specdec.runners.runner import KVSnapshot


class WidthRunner:
    def __init__(self, apart=None, deep_only=False, max_context=2048, max_step_tokens=64):
        self.apart, self.deep_only = apart, deep_only
        self.max_context, self.max_step_tokens = max_context, max_step_tokens
        self.spec = SimpleNamespace(vocab_size=300)
        self.cache = np.zeros((max_context, 4), np.float32)
        self.ids = np.zeros(max_context, np.int64)
        self.length, self.pending, self.widths = 0, 0, []
        self.exact_width = None

    def forward(self, tokens, positions, parents=None, visible_past=None, last_logits_only=False):
        positions = list(positions)
        self.widths.append(len(tokens))
        step = 0.0
        if self.apart is not None and len(tokens) >= self.apart and (not self.deep_only or positions[0] >= DEEP):
            step = 1e-6
        for token, position in zip(tokens, positions):
            self.cache[position] = [token, position, token * 0.5 + step, 1.0]
            self.ids[position] = token
        self.pending = len(tokens)
        return np.array([[float(t) + step] * 3 for t in tokens])

    def commit(self, count):
        self.length += count

    def truncate(self, length):
        self.length = min(self.length, length)

    def reset(self):
        self.length = 0

    def kv_layout(self, count):
        return (count, 4), np.float32

    def random_kv(self, count):
        return np.random.default_rng(0).standard_normal((count, 4), dtype=np.float32)

    def snapshot(self):
        return KVSnapshot(self.ids[: self.length].copy(), self.cache[: self.length].copy())

    def restore(self, snapshot, count):
        self.cache[:count] = snapshot.rows[:count]
        self.ids[:count] = snapshot.token_ids[:count]
        self.length = count


def test_exact_width_is_the_widest_pass_that_rounds_as_a_narrow_one():
    assert exact_width(WidthRunner()) == max(WIDTHS)
    assert exact_width(WidthRunner(apart=32)) == 20  # WIDTHS: 64, 32, 20, 16, 8
    assert exact_width(WidthRunner(apart=9)) == 8
    assert exact_width(WidthRunner(apart=3)) is None  # not even 8 rows


def test_a_width_that_rounds_apart_only_behind_a_deep_cache_is_found():
    assert exact_width(WidthRunner(apart=32, deep_only=True, max_context=DEEP + 128)) == 20
    # a cache too small for the deep check: only the shallow one, which cannot see it
    assert exact_width(WidthRunner(apart=32, deep_only=True, max_context=512)) == max(WIDTHS)


def test_prefill_chunks_stay_within_the_exact_width():
    runner = WidthRunner()
    runner.exact_width = 20
    catch_up(runner, list(range(1, 200)))
    assert max(runner.widths) == 20 and runner.length == 197
    runner = WidthRunner()
    catch_up(runner, list(range(1, 200)))  # not measured: the default chunk
    assert max(runner.widths) == 64


def test_prefill_chunks_halve_deep_in_a_long_prompt_to_widths_the_load_checks():
    assert set(PREFILL_WIDTHS) <= set(WIDTHS)
    assert [prefill_width(depth) for depth in (0, 16320, 16321, 32700, 32800)] == [64, 64, 32, 32, 16]
    for depth in range(0, 40000, 97):
        width = prefill_width(depth)
        assert width == min(PREFILL_WIDTHS) or width * (depth + width) <= PREFILL_CELLS
    runner = WidthRunner(max_context=16600)
    runner.length = 16200  # a long prompt's prefill, its first 16,200 tokens cached
    catch_up(runner, list(range(16500)))
    assert runner.widths == [64, 64, 32, 32, 32, 32, 32, 10] and runner.length == 16498


def _widths_of(decoder, prompt, **mode):
    inner = getattr(decoder.target, "runner", decoder.target)
    widths, forward = [], inner.forward

    def recorded(tokens, *args, **kwargs):
        widths.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    inner.forward = recorded
    try:
        return decoder.generate(prompt, max_new_tokens=48, **mode).token_ids, widths
    finally:
        inner.forward = forward


def test_every_target_pass_stays_within_the_exact_width_with_the_same_output():
    from scripted import scripted_decoder

    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6] * 6  # repeats: long suffix proposals
    for mode in ({}, {"proposer": "suffix"}, {"proposer": "draft", "num_draft_tokens": 8}):
        free = scripted_decoder()
        expected, wide = _widths_of(free, prompt, **mode)
        capped = scripted_decoder()
        getattr(capped.target, "runner", capped.target).exact_width = 12
        got, widths = _widths_of(capped, prompt, **mode)
        assert got == expected, mode
        assert max(widths) <= 12 < max(wide), (mode, max(widths), max(wide))
