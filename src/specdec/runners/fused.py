"""One fused-form model (GroupQueryAttention on a shared KV buffer): session, cache, IO binding.

The cache is one array ``[layers, 2 (key, value), batch=1, kv_heads, max_context + scratch, head_dim]``
allocated once; layer l's keys are the contiguous block ``cache[l, 0]``, bound as both the
graph's ``past.{l}.key`` input and its ``present.{l}.key`` output. onnxruntime's kernel reads
slots [0, length) and writes the T new rows at slots [length, length + T) in place (and the
graph's scratch rows after them, never committed); no other slot is touched and nothing
past-sized is allocated or copied per pass. The KV bindings are made once; a pass only rebinds
the small per-pass inputs (ids, positions, bias, lengths).
``commit``/``truncate`` move ``length`` (rollback is a smaller length: rejected rows are
overwritten by the next pass); ``keep_path`` compacts a tree's accepted path (``_move_kv``).

``runners/factory.py`` picks this runner for fused-form bundles without folded attention.
"""

from __future__ import annotations

import numpy as np

from specdec.contract.manifest import LOGIT_ROWS, BundleError, ModelSpec
from specdec.runners.backends import backend, backends
from specdec.runners.kv_store import cache_zeros
from specdec.runners.standard import attach_session, bind_array, providers_for
from specdec.runners.sessions import SessionRunner
from specdec.runners.runner import Runner

# The additive bias where the boolean mask says "may not attend" (Hugging Face's masked value).
BLOCKED = np.finfo(np.float32).min


def check_fused_provider(spec: ModelSpec, provider: str) -> None:
    """The fused form runs only where its backend says so (runners/backends/: onnxruntime's CPU provider, this
    runner's host-side shared cache); elsewhere the bundle must be exported in the standard form."""
    entry = backend(provider)  # an unknown provider is reported as for the standard form
    if entry.providers:
        providers_for(provider)  # a missing package first, as for the standard form: nothing runs without it
    if not entry.fused_form:
        where = ", ".join(name for name, other in backends().items() if other.fused_form)
        raise BundleError(f"the {spec.role} graph is the fused onnxruntime form (GroupQueryAttention), which specdec "
                          f"runs on provider {where} only: export the bundle with --graph standard for provider "
                          f"{provider}")


def _tree_at_slot_zero(positions: np.ndarray, past: int) -> bool:
    """A pass with an empty past whose positions are not first, first + 1, ... (a tree): onnxruntime's kernel would
    take them for a prompt. ``positions``: [T] int64."""
    count = len(positions)
    return past == 0 and count > 1 and bool(np.any(positions != positions[0] + np.arange(count)))


class FusedRunner(SessionRunner, Runner):
    """The bookkeeping (length, slot positions, masks, commit/truncate/keep_path) is the shared ``Runner``;
    this class converts the mask to GroupQueryAttention's additive bias, binds and runs."""

    _slot_axis = 4  # the cache is [layers, 2, 1, kv_heads, slots, head_dim]

    def __init__(self, onnx_path: str, spec: ModelSpec, provider: str, max_context: int, max_step_tokens: int,
                 threads: int | None = None, session=None, kept_ids=None):
        if spec.graph != "fused":
            raise BundleError(f"{spec.role}: FusedRunner needs a fused-form graph, this one is {spec.graph!r}")
        check_fused_provider(spec, provider)
        if spec.kv_dtype != "float32":
            raise BundleError(f"{spec.role}: the fused form's CPU attention needs a float32 KV cache, not {spec.kv_dtype}")
        if max_context > spec.max_positions:
            raise ValueError(f"max_context {max_context} exceeds the model's {spec.max_positions} positions")
        self._init_book(spec, max_context, max_step_tokens, kept_ids)
        attach_session(self, onnx_path, provider, threads, session)
        # max_context slots plus the graph's scratch slots (ModelSpec.attention_scratch_rows), written after the new rows
        slots = max_context + spec.attention_scratch_rows
        self.cache = cache_zeros((spec.num_layers, 2, 1, spec.num_kv_heads, slots, spec.head_dim), np.float32)
        self._slot_bytes = self.cache.nbytes // slots
        self._ids = np.zeros(max_step_tokens, dtype=np.int64)
        self._positions = np.zeros(max_step_tokens, dtype=np.int64)
        self._bias = np.zeros(max_step_tokens * max_context, dtype=np.float32)
        self._sliding_bias = np.zeros_like(self._bias) if spec.has_sliding_mask else None
        self._seqlens = np.zeros(1, dtype=np.int32)
        self._total = np.zeros((), dtype=np.int32)
        self._logits = np.zeros(max_step_tokens * self.logits_width, dtype=np.float32)
        # graphs with a logit_rows input compute logits only for the rows asked for (contract/manifest.py)
        self._logit_rows = np.arange(max_step_tokens, dtype=np.int64) if spec.has_input(LOGIT_ROWS) else None
        self._bound_rows = None  # (start, stop) of _logit_rows bound now

    def _new_binding(self, session):
        binding = session.io_binding()
        spec, slots = self.spec, self.cache.shape[4]
        cache_shape = [1, spec.num_kv_heads, slots, spec.head_dim]
        for layer, names in enumerate(spec.kv):  # bound once: the same buffer is the past and the present
            for kind, (past, present) in enumerate(((names.past_key, names.new_key),
                                                    (names.past_value, names.new_value))):
                block = self.cache[layer, kind]
                binding.bind_input(past, "cpu", 0, np.float32, cache_shape, block.ctypes.data)
                binding.bind_output(present, "cpu", 0, np.float32, cache_shape, block.ctypes.data)
        bind_array(binding.bind_input, "seqlens_k", self._seqlens)
        bind_array(binding.bind_input, "total_sequence_length", self._total)
        self._bound_rows = None
        return binding

    def _fork(self) -> "FusedRunner":
        """A runner on the same onnxruntime session with its own cache, buffers and IO binding."""
        return FusedRunner("", self.spec, self.provider, self.max_context, self.max_step_tokens, session=self.sessions,
                           kept_ids=self.kept_ids)

    # ------------------------------------------------------------ backend hooks
    def _run(self, ids, positions, mask, sliding, past) -> np.ndarray:
        """One pass: ids/positions [T], boolean mask/sliding [T, past + T]; returns logits [T, V]."""
        count = len(ids)
        if _tree_at_slot_zero(positions, past):
            # With an empty past, onnxruntime's kernel takes the positions to be first, first + 1, ... (a
            # prompt): a tree at slot 0 runs its root alone, then the rest with the root as a one-slot past.
            self._execute(ids[:1], positions[:1], mask[:1, :1], None if sliding is None else sliding[:1, :1], 0, 0)
            self._execute(ids[1:], positions[1:], mask[1:], None if sliding is None else sliding[1:], 1, 1)
        else:
            self._execute(ids, positions, mask, sliding, past, 0)
        return self._logits[: count * self.logits_width].reshape(count, self.logits_width)

    def _run_last(self, ids, positions, mask, sliding, past) -> np.ndarray:
        """A chain pass that computes only the last row's logits, when the graph can (else all of them)."""
        if self._logit_rows is None or _tree_at_slot_zero(positions, past):
            return self._run(ids, positions, mask, sliding, past)[-1:]
        self._execute(ids, positions, mask, sliding, past, 0, last_only=True)
        return self._logits[: self.logits_width].reshape(1, self.logits_width)

    def _execute(self, ids, positions, mask, sliding, past, first_row, last_only: bool = False) -> None:
        count = len(ids)
        total = past + count
        self._ids[:count] = ids
        self._positions[:count] = positions
        bias = self._bias[: count * total].reshape(1, 1, count, total)
        np.multiply(~mask, BLOCKED, out=bias[0, 0])
        self._seqlens[0] = total - 1
        self._total[...] = total
        vocab = self.logits_width
        rows = 1 if last_only else count
        logits = self._logits[first_row * vocab : (first_row + rows) * vocab].reshape(1, rows, vocab)
        binding = self._live_binding()
        rows_range = (count - 1, count) if last_only else (0, count)
        if self._logit_rows is not None and rows_range != self._bound_rows:  # a binding stays until replaced
            bind_array(binding.bind_input, LOGIT_ROWS, self._logit_rows[rows_range[0] : rows_range[1]])
            self._bound_rows = rows_range
        bind_array(binding.bind_input, "input_ids", self._ids[:count].reshape(1, count))
        bind_array(binding.bind_input, "position_ids", self._positions[:count].reshape(1, count))
        bind_array(binding.bind_input, "attention_bias", bias)
        if sliding is not None:
            sliding_bias = self._sliding_bias[: count * total].reshape(1, 1, count, total)
            np.multiply(~sliding, BLOCKED, out=sliding_bias[0, 0])
            bind_array(binding.bind_input, "sliding_attention_bias", sliding_bias)
        bind_array(binding.bind_output, "logits", logits)
        self.session.run_with_iobinding(binding)

    def _move_kv(self, sources, first_slot: int) -> None:
        count = len(sources)
        if first_slot < 0 or first_slot + count > self.max_context or sources.max() >= self.max_context:
            raise ValueError(f"move_rows: slots out of range (first_slot {first_slot}, sources up to {sources.max()})")
        # fancy indexing copies the source rows first, so overlapping moves are safe
        self.cache[:, :, :, :, first_slot : first_slot + count] = self.cache[:, :, :, :, sources]

    def _kv_rows(self, count: int) -> np.ndarray:
        return self.cache[:, :, :, :, :count].copy()

    def _set_kv_rows(self, rows: np.ndarray, count: int) -> None:
        self.cache[:, :, :, :, :count] = rows[:, :, :, :, :count]

