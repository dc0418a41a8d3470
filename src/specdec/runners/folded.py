"""One fused-form model with folded attention (export/folded_attention.py): session, cache, IO binding.

The cache is one array ``[layers, 2 (key, value), batch=1, kv_heads, slots, head_dim]`` (float32, float16 or int8,
the bundle's ``kv_dtype``) with ``slots`` = max_context rounded up to ``CHUNK``; an int8 cache has a second,
``scales`` ``[..., slots, 1]`` float32, bound the same way (``past.{l}.key_scale.{h}``; runners/kv_int8.py). The graph's per-head inputs
``past.{l}.key.{h}`` and outputs ``present.{l}.key.{h}`` are both bound to the view ``cache[l, 0, 0, h, :rows]``:
the graph scatters the T new rows into slots [length, length + T) in place and attends over the view. ``rows``
is the pass's total rounded up to ``CHUNK`` (the bias blocks the columns past the total), so the views are rebound
once per ``CHUNK`` tokens, not per pass; a pass binds only its small inputs (ids, positions, bias, past length).

Pages of the cache the OS has not been asked for stay unbacked, 4 KiB at a time (``kv_store.cache_zeros``):
resident memory follows the context in use, not max_context (``Runner.release_rows_from``).
"""

from __future__ import annotations

import numpy as np

from specdec.contract.manifest import LOGIT_ROWS, PAST_LENGTH, BundleError, ModelSpec
from specdec.runners import kv_int8
from specdec.runners.fused import BLOCKED, FusedRunner, check_fused_provider
from specdec.runners.kv_store import cache_zeros
from specdec.runners.standard import bind_array, attach_session

# cache rows bound per step of the views: a pass attends over at most CHUNK - 1 blocked columns, and the views are
# bound again every CHUNK tokens (0.55 ms for the real 1.5B target's 112 views). 32 instead of 256: one-token passes
# 0.43-0.64 ms (1.3-1.9%) faster at 100-1,500 cached tokens, logits bit-equal (tools/measure/view_chunk.py; results
# 2026-12-07-view-step-zen5)
CHUNK = 32
_KV_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


def cache_slots(max_context: int) -> int:
    return -(-max_context // CHUNK) * CHUNK


class FoldedRunner(FusedRunner):
    def __init__(self, onnx_path: str, spec: ModelSpec, provider: str, max_context: int, max_step_tokens: int,
                 threads: int | None = None, session=None, kept_ids=None):
        if spec.graph != "fused" or spec.attention != "folded":
            raise BundleError(f"{spec.role}: FoldedRunner needs a fused graph with folded attention")
        check_fused_provider(spec, provider)
        if spec.kv_dtype not in _KV_DTYPES:
            raise BundleError(f"{spec.role}: the folded attention's cache is float32, float16 or int8, not {spec.kv_dtype}")
        if max_context > spec.max_positions:
            raise ValueError(f"max_context {max_context} exceeds the model's {spec.max_positions} positions")
        self._init_book(spec, max_context, max_step_tokens, kept_ids)
        attach_session(self, onnx_path, provider, threads, session)
        self.slots = cache_slots(max_context)
        self.chunk = CHUNK  # the views' rows step (a pass attends over its total rounded up to it)
        self.cache = cache_zeros((spec.num_layers, 2, 1, spec.num_kv_heads, self.slots, spec.head_dim),
                                 _KV_DTYPES[spec.kv_dtype])
        # an int8 cache's scales: [layers, 2, 1, kv_heads, slots, 1] float32 (runners/kv_int8.py)
        self.scales = cache_zeros(self.cache.shape[:-1] + (1,), np.float32) if spec.kv_dtype == "int8" else None
        self._slot_bytes = sum(array.nbytes for array in self._host_kv()) // self.slots
        self._ids = np.zeros(max_step_tokens, dtype=np.int64)
        self._positions = np.zeros(max_step_tokens, dtype=np.int64)
        self._bias = np.zeros(max_step_tokens * self.slots, dtype=np.float32)
        self._sliding_bias = np.zeros_like(self._bias) if spec.has_sliding_mask else None
        self._past = np.zeros(1, dtype=np.int64)
        self._logits = np.zeros(max_step_tokens * self.logits_width, dtype=np.float32)
        self._logit_rows = np.arange(max_step_tokens, dtype=np.int64)
        self._bound_rows = None
        self._bound_views = 0  # cache rows the per-head views are bound with now

    def _new_binding(self, session):
        binding = session.io_binding()
        bind_array(binding.bind_input, PAST_LENGTH, self._past)
        self._bound_rows = None
        self._bound_views = 0
        return binding

    def _fork(self) -> "FoldedRunner":
        return FoldedRunner("", self.spec, self.provider, self.max_context, self.max_step_tokens, session=self.sessions,
                            kept_ids=self.kept_ids)

    def _bind_views(self, rows: int) -> None:
        spec, binding, dtype = self.spec, self._live_binding(), self.cache.dtype
        for layer in range(spec.num_layers):
            for head, (past_key, past_value, new_key, new_value) in enumerate(spec.kv_tensors(layer)):
                for kind, past, present in ((0, past_key, new_key), (1, past_value, new_value)):
                    pointer = self.cache[layer, kind, 0, head].ctypes.data
                    binding.bind_input(past, "cpu", 0, dtype, [rows, spec.head_dim], pointer)
                    binding.bind_output(present, "cpu", 0, dtype, [rows, spec.head_dim], pointer)
            for head, (past_key, past_value, new_key, new_value) in enumerate(spec.kv_scale_tensors(layer)):
                for kind, past, present in ((0, past_key, new_key), (1, past_value, new_value)):
                    pointer = self.scales[layer, kind, 0, head].ctypes.data
                    binding.bind_input(past, "cpu", 0, np.float32, [rows, 1], pointer)
                    binding.bind_output(present, "cpu", 0, np.float32, [rows, 1], pointer)
        self._bound_views = rows

    def _host_kv(self) -> tuple:
        return (self.cache,) if self.scales is None else (self.cache, self.scales)

    def kv_layout(self, count: int) -> tuple:
        if self.scales is None:
            return super().kv_layout(count)
        layers, _, _, kv_heads, _, dim = self.cache.shape
        return (layers, 2, 1, kv_heads, count, dim + kv_int8.SCALE_BYTES), np.dtype(np.int8)

    def random_kv(self, count: int) -> np.ndarray:
        if self.scales is None:
            return super().random_kv(count)
        shape = self.cache.shape[:4] + (count, self.cache.shape[-1])
        return kv_int8.pack_rows(*kv_int8.quantize_rows(np.random.default_rng(0).standard_normal(shape, np.float32) * 0.5))

    def _move_kv(self, sources, first_slot: int) -> None:
        super()._move_kv(sources, first_slot)
        if self.scales is not None:
            self.scales[:, :, :, :, first_slot : first_slot + len(sources)] = self.scales[:, :, :, :, sources]

    def _kv_rows(self, count: int) -> np.ndarray:
        if self.scales is None:
            return super()._kv_rows(count)
        return kv_int8.pack_rows(self.cache[:, :, :, :, :count], self.scales[:, :, :, :, :count])

    def _set_kv_rows(self, rows: np.ndarray, count: int) -> None:
        if self.scales is None:
            return super()._set_kv_rows(rows, count)
        steps, scales = kv_int8.unpack_rows(rows[:, :, :, :, :count])
        self.cache[:, :, :, :, :count] = steps
        self.scales[:, :, :, :, :count] = scales

    def _run(self, ids, positions, mask, sliding, past) -> np.ndarray:
        self._execute(ids, positions, mask, sliding, past, 0)
        return self._logits[: len(ids) * self.logits_width].reshape(len(ids), self.logits_width)

    def _run_last(self, ids, positions, mask, sliding, past) -> np.ndarray:
        self._execute(ids, positions, mask, sliding, past, 0, last_only=True)
        return self._logits[: self.logits_width].reshape(1, self.logits_width)

    def _execute(self, ids, positions, mask, sliding, past, first_row, last_only: bool = False) -> None:
        count = len(ids)
        total = past + count
        rows = min(self.slots, -(-total // self.chunk) * self.chunk)
        binding = self._live_binding()  # first: a new binding (the session opened again) has no views bound
        if rows != self._bound_views:
            self._bind_views(rows)
        self._ids[:count] = ids
        self._positions[:count] = positions
        self._past[0] = past
        for name, buffer, allowed in (("attention_bias", self._bias, mask),
                                      ("sliding_attention_bias", self._sliding_bias, sliding)):
            if allowed is None:
                continue
            bias = buffer[: count * rows].reshape(1, 1, count, rows)
            bias.fill(BLOCKED)  # then 0 where allowed: no temporaries (a strided cast would allocate per pass)
            np.copyto(bias[0, 0, :, :total], np.float32(0.0), where=allowed)
            bind_array(binding.bind_input, name, bias)
        vocab = self.logits_width
        out_rows = 1 if last_only else count
        logits = self._logits[: out_rows * vocab].reshape(1, out_rows, vocab)
        rows_range = (count - 1, count) if last_only else (0, count)
        if rows_range != self._bound_rows:  # a binding stays until replaced
            bind_array(binding.bind_input, LOGIT_ROWS, self._logit_rows[rows_range[0] : rows_range[1]])
            self._bound_rows = rows_range
        bind_array(binding.bind_input, "input_ids", self._ids[:count].reshape(1, count))
        bind_array(binding.bind_input, "position_ids", self._positions[:count].reshape(1, count))
        bind_array(binding.bind_output, "logits", logits)
        self.session.run_with_iobinding(binding)
