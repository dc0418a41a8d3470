"""A prompt cache in host RAM (llama.cpp's ``--cache-ram``): KV snapshots of recent prefixes of both models.

After a request, each model's cache is copied here (``Runner.snapshot``: the token ids it holds and their
keys/values). A later request on any worker that shares a longer prefix with an entry than with its own
cache gets the entry's rows back by one copy (``Runner.restore``) and computes only the rest. Entries are
found by longest token prefix (a scan with numpy over the few entries a RAM budget holds), evicted least
recently used by bytes, and keyed by the bundle's identity and the model's role as well as the token ids,
so an entry of another bundle or of the other model is never used. One cache is shared by every fork of a
decoder (every worker of a server); all methods take its lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np

from specdec.runners.runner import KVSnapshot

log = logging.getLogger(__name__)

MIN_TOKENS = 16  # shorter prefixes are cheaper to compute than to keep


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:  # a: [N] int64, b: [M] int64
    count = min(len(a), len(b))
    differ = np.flatnonzero(a[:count] != b[:count])
    return int(differ[0]) if len(differ) else count


class PromptCache:
    def __init__(self, capacity_bytes: int, identity: str):
        if capacity_bytes < 0:
            raise ValueError(f"the prompt cache's capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.identity = identity  # the bundle's identity: entries of another bundle never match
        self._entries: OrderedDict = OrderedDict()  # (identity, role, serial) -> KVSnapshot, least recent first
        self._serial = 0
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.evictions = self.stores = 0
        self.restored_tokens = 0

    def lookup(self, role: str, token_ids, better_than: int = 0) -> tuple[KVSnapshot | None, int]:
        """The entry sharing the longest prefix with ``token_ids`` (if longer than ``better_than``), and that length."""
        ids = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            best, best_len, best_key = None, better_than, None
            for key, entry in self._entries.items():
                if key[0] != self.identity or key[1] != role:
                    continue
                shared = common_prefix(entry.token_ids, ids)
                if shared > best_len:
                    best, best_len, best_key = entry, shared, key
            if best is None:
                self.misses += 1
                return None, better_than
            self._entries.move_to_end(best_key)
            self.hits += 1
            self.restored_tokens += best_len
            return best, best_len

    def peek(self, role: str, token_ids) -> int:
        """The longest prefix of ``token_ids`` an entry holds, without counting a hit or touching the LRU order."""
        ids = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            return max((common_prefix(entry.token_ids, ids) for key, entry in self._entries.items()
                        if key[0] == self.identity and key[1] == role), default=0)

    def store(self, role: str, runner) -> bool:
        """Keep a snapshot of ``runner``'s cache unless an entry already holds it; evicts LRU entries for room."""
        length = runner.length
        if length < MIN_TOKENS:
            return False
        held = runner.slot_ids[:length]
        with self._lock:
            for key, entry in list(self._entries.items()):
                if key[0] != self.identity or key[1] != role:
                    continue
                shared = common_prefix(entry.token_ids, held)
                if shared == length:  # an entry already holds all of it: keep that one, now the most recent
                    self._entries.move_to_end(key)
                    return False
                if shared == len(entry.token_ids):  # the new snapshot extends this entry: it replaces it
                    self._drop(key)
        try:
            needed = runner.snapshot_bytes(length)
        except NotImplementedError:
            return False
        with self._lock:
            if needed > self.capacity:
                return False
            while self.bytes + needed > self.capacity and self._entries:  # make room before copying: RSS stays bounded
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            snapshot = runner.snapshot()
            self._serial += 1
            self._entries[(self.identity, role, self._serial)] = snapshot
            self.bytes += snapshot.nbytes
            self.stores += 1
            return True

    def _drop(self, key) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "capacity_bytes": self.capacity,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions, "stores": self.stores,
                    "restored_tokens": self.restored_tokens}
