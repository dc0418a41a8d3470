"""The runner protocol: one model's passes over new tokens, and its KV cache's bookkeeping.

Every backend (onnxruntime host or device cache, native TensorRT, onnxruntime's fused graph)
subclasses ``Runner`` and implements two things: ``_run`` (bind and execute one pass whose new
KV rows land in slots [length, length + T)) and ``_move_kv`` (copy cache rows between slots).
Everything else a cache needs lives here, once:

  length           valid slots; slot j holds the keys/values of one committed (or candidate) token
  slot_positions   [max_context] int64: the position each slot was written at (trees reuse positions)
  slot_ids      [max_context] int64: the token id each slot holds the keys/values of
  held_prefix(ids) how many leading ``ids`` the cache already holds (at positions 0, 1, ...): a new request
                   keeps them and computes only the rest (cache reuse across requests)
  commit(n)        keep the first n rows the last pass wrote
  truncate(n)      keep the first n slots (rejected drafts are dropped by moving a length)
  keep_path(s, f)  tree compaction: slots ``s`` (ascending) move to f, f + 1, ...; the rest is dropped
  masks            the boolean attention mask of a pass (and its sliding-window twin)

No caller writes ``length`` or ``slot_positions``: the decoder, the cost model and tests go
through these methods.
"""

from __future__ import annotations

import numpy as np

from specdec.contract.manifest import ModelSpec
from specdec.runners.kv_store import release_pages, release_slots
from specdec.runners.masks import ancestor_matrix, chain_parents, fill_masks
from specdec.runners.vocab_map import expand_logits_into


class Runner:
    """Base of every backend's runner. Subclasses set up the session and cache, then call ``_init_book``."""

    spec: ModelSpec
    max_context: int
    max_step_tokens: int

    def _init_book(self, spec: ModelSpec, max_context: int, max_step_tokens: int, kept_ids=None) -> None:
        """``kept_ids``: [K] ascending ids a pruned-vocabulary graph scores (runners/vocab_map.py); the runner
        returns full-vocabulary logits with -inf elsewhere, so every caller sees [T, vocab_size]."""
        self.spec = spec
        self.kept_ids = kept_ids
        self.logits_width = spec.vocab_size if kept_ids is None else len(kept_ids)
        self._full_logits = None if kept_ids is None else np.empty((max_step_tokens, spec.vocab_size), np.float32)
        self.max_context = max_context
        self.max_step_tokens = max_step_tokens
        self.length = 0
        self.slot_positions = np.zeros(max_context, dtype=np.int64)
        self.slot_ids = np.full(max_context, -1, dtype=np.int64)
        # a slot written by a chain row (it saw every earlier slot and nothing else): what a prefill computes, bit for
        # bit. A tree node's row masks columns mid-row, which can round differently: never reused by another request
        self.slot_exact = np.zeros(max_context, dtype=bool)
        self.forward_count = 0
        self.rows_written = 0  # slots any pass wrote since the cache was last emptied (a high-water mark)
        self._mask = np.zeros(max_step_tokens * max_context, dtype=bool)
        self._sliding = np.zeros_like(self._mask) if spec.has_sliding_mask else None

    # ------------------------------------------------------------ backend hooks
    def _run(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, sliding: np.ndarray | None,
             past: int) -> np.ndarray:
        """Execute one pass: ids/positions [T], mask/sliding [T, past + T]; returns logits [T, logits_width]."""
        raise NotImplementedError

    def _run_last(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, sliding: np.ndarray | None,
                  past: int) -> np.ndarray:
        """``_run`` for a chain whose last row alone is read: logits [1, logits_width]. A backend whose graph can
        skip the other rows' logits overrides it."""
        return self._run(ids, positions, mask, sliding, past)[-1:]

    def _move_kv(self, sources: np.ndarray, first_slot: int) -> None:
        raise NotImplementedError

    def _kv_rows(self, count: int) -> np.ndarray:
        """A host copy of the keys/values of slots [0, count) (the backend's own layout)."""
        raise NotImplementedError(f"{type(self).__name__} cannot snapshot its KV cache")

    def _set_kv_rows(self, rows: np.ndarray, count: int) -> None:
        """Write the first ``count`` slots of a ``_kv_rows`` copy back into slots [0, count)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore a KV snapshot")

    # ------------------------------------------------------------ the protocol
    def forward(self, tokens, positions, parents=None, visible_past=None, last_logits_only: bool = False) -> np.ndarray:
        """Run T new tokens after the valid past; returns logits [T, V] (valid until the next call).

        tokens, positions: [T] ints. parents: [T] tree parents (-1 = the past); None = a chain.
        visible_past: [T, length] bool, which past slots each new token sees (draft trees); None = all.
        last_logits_only: a chain whose other rows' logits nobody reads (a prefill chunk): returns [1, V], the
        last row's, and a graph that can skips the lm_head on the rest. The KV rows are the same either way.
        New KV rows land in slots [length, length + T); ``commit`` keeps some of them.
        """
        count, past = len(tokens), self.length
        if count < 1:
            raise ValueError("a pass needs at least one token")
        if (count == 1 and self.pad_one_row and visible_past is None and (parents is None or int(parents[0]) == -1)
                and past + 2 <= self.max_context and self.max_step_tokens >= 2):  # a one-node tree is a chain
            # the token twice, every row's logits: the multi-row kernels' rounding, as in a verify pass; the
            # second row's KV slot lies past the one committed and the next pass overwrites it
            return self.forward([tokens[0]] * 2, [positions[0], positions[0] + 1])[:1]
        if count > self.max_step_tokens:
            raise ValueError(f"{count} tokens in one pass exceed this runner's {self.max_step_tokens}")
        if past + count > self.max_context:
            raise ValueError(f"context of {past + count} tokens exceeds max_context {self.max_context}")
        ids = np.asarray(tokens, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        total = past + count
        mask = self._mask[: count * total].reshape(count, total)
        sliding = None if self._sliding is None else self._sliding[: count * total].reshape(count, total)
        visible = ancestor_matrix(np.asarray(parents)) if parents is not None else _chain_visibility(count)
        fill_masks(mask, sliding, past, visible, self.slot_positions[:past], pos, self.spec.sliding_window,
                   visible_past)
        if last_logits_only:
            if parents is not None or visible_past is not None:
                raise ValueError("last_logits_only is for chains over the whole past")
            logits = self._run_last(ids, pos, mask, sliding, past)
        else:
            logits = self._run(ids, pos, mask, sliding, past)
        if self.kept_ids is not None:  # a pruned draft: its distribution is exactly zero outside the kept ids
            logits = expand_logits_into(logits, self.kept_ids, self._full_logits[: len(logits)])
        self.slot_positions[past:total] = pos
        self.slot_ids[past:total] = ids
        self.slot_exact[past:total] = True if parents is None and visible_past is None else _chain_rows(visible, visible_past)
        self.forward_count += 1
        self.rows_written = max(self.rows_written, total)
        return logits

    def commit(self, count: int) -> None:
        """Keep the first ``count`` rows written by the last forward."""
        if not 0 <= self.length + count <= self.max_context:
            raise ValueError(f"cannot commit {count} rows at length {self.length}")
        self.length += count

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` slots: rejected rows are overwritten by the next pass."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def keep_path(self, sources, first_slot: int) -> None:
        """Tree compaction: slots ``sources`` (ascending, >= first_slot) move to first_slot, first_slot + 1, ...;
        the cache then ends after them."""
        sources = np.asarray(sources, dtype=np.int64)
        if len(sources) and (sources[0] < first_slot or np.any(np.diff(sources) <= 0)):
            raise ValueError("keep_path needs ascending source slots at or after first_slot")
        if len(sources):
            self._move_kv(sources, first_slot)
            self.slot_positions[first_slot : first_slot + len(sources)] = self.slot_positions[sources]
            self.slot_ids[first_slot : first_slot + len(sources)] = self.slot_ids[sources]
            self.slot_exact[first_slot : first_slot + len(sources)] = self.slot_exact[sources]
        self.length = first_slot + len(sources)

    def reset(self) -> None:
        self.length = 0

    def release_cache(self) -> None:
        """Empty the cache and give its host pages back to the OS: after passes over rows no request will read
        (the load's row checks, the calibration's random rows), which would otherwise stay resident until a
        request long enough overwrites them (4,096 rows: 112 MiB of the 1.5B target's fp16 cache)."""
        self.reset()
        for array in self._host_kv():
            release_pages(array)
        self.rows_written = 0

    def release_rows_from(self, start: int) -> int:
        """Give back the host pages of slots from ``start`` (never below ``length``) that earlier passes wrote:
        a shorter conversation after a long one leaves the long one's rows resident otherwise (a 32k-token
        context: 0.9 GiB of the 1.5B target's fp16 cache). No valid slot changes; a slot written again is backed
        again. Returns the bytes given back."""
        start = max(start, self.length)
        if self.rows_written <= start:
            return 0
        released = sum(release_slots(array, self._slot_axis, start) for array in self._host_kv())
        self.rows_written = start
        return released

    def _host_kv(self) -> tuple:
        """The host arrays that hold this runner's keys/values (none: a device cache or no cache)."""
        cache = getattr(self, "cache", None)
        return () if cache is None else (cache,)

    def random_kv(self, count: int) -> np.ndarray:
        """``count`` slots of random keys/values (standard normal / 2, seed 0) in ``snapshot``'s layout."""
        shape, dtype = self.kv_layout(count)
        return (np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * 0.5).astype(dtype)

    # one-token passes run as two rows (exact_rows): on CPUs whose one-row int4 kernel rounds unlike the
    # multi-row one, a verify pass's rows then equal target-only decoding's bit for bit
    pad_one_row: bool = False
    # the widest pass whose rows equal a narrow pass's bit for bit on this machine (row_parity.exact_width):
    # prefill chunks and verify passes stay within it, so a warm cache gives a cold one's output
    exact_width: int | None = None

    _slot_bytes: int | None = None  # host bytes of one slot's keys/values (set by backends that can snapshot)

    def snapshot_bytes(self, count: int) -> int:
        """What ``snapshot`` of ``count`` slots will allocate (NotImplementedError: this backend cannot)."""
        if self._slot_bytes is None:
            raise NotImplementedError(f"{type(self).__name__} cannot snapshot its KV cache")
        return count * (self._slot_bytes + 8)

    _slot_axis: int = 3  # the axis of the host cache (and of a ``_kv_rows`` copy) that counts slots

    def kv_layout(self, count: int) -> tuple:
        """(shape, dtype) of a ``snapshot`` of ``count`` slots' keys/values (NotImplementedError: this backend
        cannot snapshot). What a saved slot file must hold to be restored here (decoding/slot_file.py)."""
        cache = getattr(self, "cache", None)
        if cache is None or self._slot_bytes is None:
            raise NotImplementedError(f"{type(self).__name__} cannot snapshot its KV cache")
        shape = list(cache.shape)
        shape[self._slot_axis] = count
        return tuple(shape), cache.dtype

    def snapshot(self) -> "KVSnapshot":
        """A host copy of the cache's chain prefix (slots at positions 0, 1, ...) with the token ids it holds."""
        count = self.length
        bad = np.flatnonzero((self.slot_positions[:count] != np.arange(count)) | ~self.slot_exact[:count])
        count = int(bad[0]) if len(bad) else count
        return KVSnapshot(self.slot_ids[:count].copy(), self._kv_rows(count))

    def restore(self, snapshot: "KVSnapshot", count: int) -> None:
        """Make the cache hold the snapshot's first ``count`` tokens (one copy); the rest is dropped."""
        if not 0 <= count <= min(len(snapshot.token_ids), self.max_context):
            raise ValueError(f"cannot restore {count} slots from a snapshot of {len(snapshot.token_ids)}")
        self._set_kv_rows(snapshot.rows, count)
        self.slot_ids[:count] = snapshot.token_ids[:count]
        self.slot_positions[:count] = np.arange(count)
        self.slot_exact[:count] = True
        self.length = count
        self.rows_written = max(self.rows_written, count)

    def held_prefix(self, token_ids) -> int:
        """The number of leading ``token_ids`` whose keys/values this cache holds, each at its own position,
        as a chain pass computed them.

        Every write goes through ``forward`` / ``keep_path``, which record the token, position and pass kind
        of each slot, so this is exact: a slot counts only if it holds that token at that position, written
        by a chain pass (a tree pass's rows may round differently from the prefill a cold cache would run)."""
        count = min(len(token_ids), self.length)
        if count == 0:
            return 0
        ids = np.asarray(token_ids[:count], dtype=np.int64)
        same = (self.slot_ids[:count] == ids) & (self.slot_positions[:count] == np.arange(count)) & self.slot_exact[:count]
        return count if same.all() else int(np.argmin(same))

    def first_inexact(self, start: int) -> int | None:
        """The first slot from ``start`` on that a tree node's row wrote (not offered to other requests: see
        ``held_prefix``), or None."""
        bad = np.flatnonzero(~self.slot_exact[start : self.length])
        return start + int(bad[0]) if len(bad) else None

    def fork(self) -> "Runner":
        """A runner on the same weights with its own cache (for concurrent requests), whose passes run as this
        one's do (``pad_one_row``)."""
        forked = self._fork()
        forked.pad_one_row = self.pad_one_row
        forked.exact_width = self.exact_width
        return forked

    def _fork(self) -> "Runner":
        """Backend hook of ``fork``: a new runner on the same weights and session, with its own cache."""
        raise ValueError(f"{type(self).__name__} cannot be forked: serve one request at a time on this backend")


class KVSnapshot:
    """The keys/values of a cache's first ``len(token_ids)`` slots, copied to host memory."""

    __slots__ = ("token_ids", "rows", "nbytes")

    def __init__(self, token_ids: np.ndarray, rows: np.ndarray):
        self.token_ids = token_ids  # [N] int64
        self.rows = rows  # the backend's layout, N slots
        self.nbytes = int(token_ids.nbytes + rows.nbytes)


def _chain_rows(visible: np.ndarray, visible_past: np.ndarray | None) -> np.ndarray:
    """[T] bool: which rows of a pass see exactly a causal chain (all past slots, new tokens 0..i).
    visible: [T, T] bool (row i sees new token j); visible_past: [T, past] bool or None (= all)."""
    chain = np.array_equal(visible, np.tril(np.ones_like(visible))) if visible.ndim == 2 else True
    if chain and visible_past is None:
        return np.ones(len(visible), dtype=bool)
    rows = (visible == np.tril(np.ones_like(visible))).all(axis=1)
    return rows if visible_past is None else rows & visible_past.all(axis=1)


_CHAIN_CACHE: dict = {}


def _chain_visibility(count: int) -> np.ndarray:
    if count not in _CHAIN_CACHE:
        _CHAIN_CACHE[count] = ancestor_matrix(chain_parents(count))
    return _CHAIN_CACHE[count]


def fill_random(runner, context: int) -> None:
    """Reset the runner and give it ``context`` committed slots of random keys/values (token 0): what a pass at that
    depth reads, without the minutes a prefill of it takes."""
    rows = runner.random_kv(context)
    runner.reset()
    runner.restore(KVSnapshot(np.zeros(context, dtype=np.int64), rows), context)
