"""A scripted model behind the runner protocol: decoder-loop tests without torch or onnxruntime, in milliseconds.

``ScriptedRunner`` implements ``Runner._run`` / ``_move_kv`` over a table of logits: the logits of a
new token are a fixed function of the sequence it can see, which the runner rebuilds from the
attention mask (visible past slots + tree ancestors) and checks against the positions it was given.
So a wrong mask, a wrong position, a stale cache row or a bad compaction changes the logits (or
raises), exactly as it would in a real graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from specdec.decoding.decoder import SpeculativeDecoder
from specdec.runners.runner import Runner


class ScriptedModel:
    """logits(sequence) = table[second-to-last, last] (+ a small term in the length): a 'bigram' LM over V ids."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.0, base: "ScriptedModel | None" = None,
                 noise: float = 0.0):
        rng = np.random.default_rng(seed)
        if base is None:
            self.table = (rng.standard_normal((vocab, vocab, vocab)) * scale).astype(np.float32)
        else:  # a draft: the target's table, perturbed
            self.table = (base.table + rng.standard_normal(base.table.shape) * noise).astype(np.float32)
        self.vocab = vocab

    def logits(self, sequence: list) -> np.ndarray:  # -> [V]
        before = sequence[-2] if len(sequence) > 1 else 0
        return self.table[before, sequence[-1]]


class ScriptedRunner(Runner):
    def __init__(self, model: ScriptedModel, max_context: int = 512, max_step_tokens: int = 64,
                 sliding_window=None):
        spec = SimpleNamespace(has_sliding_mask=False, sliding_window=sliding_window, vocab_size=model.vocab,
                               role="scripted")
        self._init_book(spec, max_context, max_step_tokens)
        self.model = model
        self.slot_tokens = np.zeros(max_context, dtype=np.int64)
        self.kv_copies = 0  # slots moved by compaction

    def _run(self, ids, positions, mask, sliding, past) -> np.ndarray:
        count = len(ids)
        self.slot_tokens[past : past + count] = ids
        every_position = np.concatenate([self.slot_positions[:past], positions])
        out = np.zeros((count, self.model.vocab), dtype=np.float32)
        for row in range(count):
            visible = np.flatnonzero(mask[row])
            seen_positions = every_position[visible]
            # a causal LM's view: positions 0..n-1 in order, ending at this token's own position
            if not np.array_equal(seen_positions, np.arange(len(visible))) or visible[-1] != past + row:
                raise AssertionError(f"token {row} sees positions {seen_positions.tolist()} (its own: {positions[row]})")
            out[row] = self.model.logits(self.slot_tokens[visible].tolist())
        return out

    def _move_kv(self, sources, first_slot: int) -> None:
        for offset, slot in enumerate(sources):
            self.slot_tokens[first_slot + offset] = self.slot_tokens[slot]
            self.kv_copies += 1

    def _fork(self) -> "ScriptedRunner":
        return ScriptedRunner(self.model, self.max_context, self.max_step_tokens)


class ByteCodec:
    """Token i -> a byte string (some multi-byte UTF-8 characters split over two tokens), decoded with
    replacement like a byte-level BPE tokenizer."""

    PIECES = [b"a", b"b", b"c", b"k", b"<", b" ", b"\n", b"xy", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"k<", b"d",
              b"e", b""]

    def __init__(self, vocab: int):
        self.pieces = [self.PIECES[i % len(self.PIECES)] for i in range(vocab)]

    def encode(self, text: str) -> list:
        return [self.pieces.index(bytes([b])) if bytes([b]) in self.pieces else 0 for b in text.encode()]

    def decode(self, ids) -> str:
        return b"".join(self.pieces[int(i)] for i in ids).decode("utf-8", errors="replace")


def scripted_decoder(vocab: int = 16, eos: int = 15, draft_noise: float = 0.6, seed: int = 0, max_context: int = 512,
                     costs=None, with_draft: bool = True, draft_runner=None) -> SpeculativeDecoder:
    """A SpeculativeDecoder over scripted target/draft runners (draft = target + noise; ``draft_runner``: the
    draft's runner class, ScriptedRunner or a subclass)."""
    from specdec.decoding.cost_model import Costs

    target_model = ScriptedModel(vocab, seed)
    target = ScriptedRunner(target_model, max_context)
    draft = (draft_runner or ScriptedRunner)(ScriptedModel(vocab, seed + 1, base=target_model, noise=draft_noise),
                                             max_context) if with_draft else None
    manifest = SimpleNamespace(target=SimpleNamespace(vocab_size=vocab, eos_token_ids=(eos,), max_positions=max_context))
    costs = costs or Costs(draft_step=0.2, verify=tuple(1.0 + 0.1 * t for t in range(9)))
    return SpeculativeDecoder(None, manifest, target, draft, ByteCodec(vocab), costs)


def forked_map(function, items, parts: int = 2, timeout: float = 300.0) -> list:
    """``[function(item) for item in items]``, the items split over ``parts`` processes (fork: each inherits this
    process's state, monkeypatches included); the results are the same, in order, as the plain loop's. Without
    fork (or with one CPU) the plain loop. A child that fails or does not answer in ``timeout`` seconds is killed
    and its share computed here. Results cross a pipe pickled."""
    import os
    import pickle
    import select
    import signal

    items = list(items)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parts = max(1, min(parts, cpus, len(items)))
    if parts == 1 or not hasattr(os, "fork"):
        return [function(item) for item in items]
    shares = [items[i::parts] for i in range(parts)]  # interleaved: each share sees the same mix of work
    children = []
    for share in shares[1:]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compute its share, send it, leave without running pytest's exit handlers
            os.close(read)
            try:
                payload = pickle.dumps(("ok", [function(item) for item in share]))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which recomputes the share
                payload = pickle.dumps(("error", repr(exc)))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
            os._exit(0)
        os.close(write)
        children.append((pid, read, share))
    results = [[function(item) for item in shares[0]]]
    for pid, read, share in children:
        data, status = b"", None
        with os.fdopen(read, "rb") as pipe:
            while select.select([pipe], [], [], timeout)[0]:
                chunk = os.read(pipe.fileno(), 1 << 20)
                if not chunk:
                    status, value = pickle.loads(data) if data else ("error", "no answer")
                    break
                data += chunk
        if status != "ok":  # failed or silent: kill it, do its share here (a real error then raises here)
            os.kill(pid, signal.SIGKILL)
            value = [function(item) for item in share]
        os.waitpid(pid, 0)
        results.append(value)
    ordered = [None] * len(items)
    for part, share_results in enumerate(results):
        ordered[part::parts] = share_results
    return ordered
