"""How a load makes its sessions: weights prepacked by the thread pool (the same bytes as one thread's), the target's
session before load returns, the draft's on its own thread after it."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def _logits(bundle, parallel: str, monkeypatch) -> dict:
    from specdec import SpeculativeDecoder
    from specdec.runners import standard

    made = standard.session_options

    def options(threads):
        chosen = made(threads)
        chosen.add_session_config_entry("session.prepack.enable_parallel", parallel)
        return chosen

    monkeypatch.setattr(standard, "session_options", options)
    decoder = SpeculativeDecoder.load(bundle, max_context=256)
    ids = decoder.codec.encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n")
    out = {}
    for role, runner in (("target", decoder.target), ("draft", decoder.draft)):
        runner.reset()
        wide = np.array(runner.forward(ids, range(len(ids))))
        runner.commit(len(ids))
        out[role] = np.concatenate([wide, np.array(runner.forward(ids[:1], [len(ids)]))])
    return out


def test_parallel_prepacking_packs_the_same_weights(tiny_bundle, monkeypatch):
    """Logits of a prefill and a one-token pass of both models, bit for bit, with weights packed by one thread and
    by the pool (what session_options asks for). Measured on the real int8-rows pair too (2-core Xeon)."""
    serial = _logits(tiny_bundle, "0", monkeypatch)
    parallel = _logits(tiny_bundle, "1", monkeypatch)
    for role in ("target", "draft"):
        assert np.array_equal(serial[role], parallel[role]), role


def test_load_returns_with_the_target_open_and_the_draft_opening(tiny_bundle):
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(tiny_bundle)
    assert decoder.target.sessions.is_open
    decoder.draft_sessions.get()  # waits for the background open if it is still under way
    assert decoder.draft_sessions.is_open and decoder.draft_sessions.opens == 1


def test_weights_mapped_by_specdec_give_the_logits_of_onnxruntimes_own_loading(tiny_bundle, monkeypatch):
    """runners/mapped_weights.py hands onnxruntime every weight over specdec's own mapping (its pages dropped while
    the session is made): both models' logits bit for bit as onnxruntime's own loading gives them. Measured on the
    real pair too (both target forms and the draft, a prefill and a one-token pass: equal)."""
    mapped = _logits(tiny_bundle, "1", monkeypatch)
    monkeypatch.setenv("SPECDEC_MAP_WEIGHTS", "0")
    own = _logits(tiny_bundle, "1", monkeypatch)
    for role in ("target", "draft"):
        assert np.array_equal(mapped[role], own[role]), role
