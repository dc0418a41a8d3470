"""The draft's session closed on contexts too long for it to pay, and opened again by a request it pays on.

runners/sessions.py holds the session; decoding/decoder.py decides when to close it. Output must never change:
the draft only proposes. Costs here are the scripted ones (a one-token target pass costs 1.0, the draft's step 0.2,
the target's prefill 0.2 a token), so with max_context 1,024 a skipped draft is closed above about 731 tokens.
"""

from __future__ import annotations

import gc

import pytest

from scripted import ScriptedRunner, scripted_decoder
from specdec.runners.sessions import SessionHolder


class _Session:
    """Stands in for an onnxruntime session: the runner below asks for it on every pass."""


class SessionDraft(ScriptedRunner):
    """A scripted draft whose passes need its holder's session (opened again after a close), as the onnxruntime
    runners' do."""

    def __init__(self, *args, sessions=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sessions = sessions or SessionHolder(_Session, name="draft")
        self.sessions.attach(self)
        self.dropped = 0

    def _fork(self) -> "SessionDraft":
        return SessionDraft(self.model, self.max_context, self.max_step_tokens, sessions=self.sessions)

    def _run(self, *args):
        self.sessions.get()
        return super()._run(*args)

    def drop_binding(self) -> None:
        self.dropped += 1


def _decoder(monkeypatch):
    decoder = scripted_decoder(max_context=1024, draft_runner=SessionDraft)
    decoder.closes_draft = True
    monkeypatch.setattr(decoder, "_observe_prefill", lambda computed, seconds: None)
    decoder._prefill_per_token = 0.2
    return decoder


def _prompt(length: int) -> list:
    return [(j * 5 + j // 7) % 15 for j in range(length)]


def test_the_draft_s_session_is_closed_on_a_context_too_long_for_it_to_pay_and_opened_again(monkeypatch):
    decoder = _decoder(monkeypatch)
    sessions = decoder.draft_sessions
    assert sessions is decoder.draft.sessions and sessions.is_open and sessions.opens == 1
    # skipped (a short answer), but an answer filling the rest of the context would pay: kept
    skipped = decoder.generate(_prompt(600), max_new_tokens=20)
    assert skipped.stats.draft_skipped and sessions.is_open
    # too long for any answer to pay: closed, the runner's binding dropped, the tokens target-only's
    long_prompt = _prompt(900)
    closed = decoder.generate(long_prompt, max_new_tokens=20)
    assert closed.stats.draft_skipped and not sessions.is_open and decoder.draft.dropped == 1
    assert closed.token_ids == scripted_decoder(max_context=1024).generate(
        long_prompt, max_new_tokens=20, num_draft_tokens=0).token_ids
    # a short prompt the draft pays on opens it again, and decodes as a decoder that never closed it
    short = _prompt(40)
    drafted = decoder.generate(short, max_new_tokens=20)
    assert drafted.stats.draft_forwards > 0 and sessions.is_open and sessions.opens == 2
    assert drafted.token_ids == scripted_decoder(max_context=1024).generate(short, max_new_tokens=20).token_ids


def test_opening_the_draft_again_is_priced_like_its_catch_up(monkeypatch):
    """A closed draft whose open costs more than a short request can save stays closed: lookup alone proposes."""
    decoder = _decoder(monkeypatch)
    sessions = decoder.draft_sessions
    decoder.generate(_prompt(900), max_new_tokens=20)
    assert not sessions.is_open
    sessions.open_seconds = 100.0  # the scripted units: 100 one-token target passes
    priced = decoder.generate(_prompt(40), max_new_tokens=20)
    assert priced.stats.draft_skipped and priced.stats.draft_forwards == 0 and not sessions.is_open
    sessions.open_seconds = 0.0
    assert decoder.generate(_prompt(40), max_new_tokens=20).stats.draft_forwards > 0 and sessions.is_open


def test_a_request_running_the_draft_holds_it_open_against_another_worker(monkeypatch):
    """A fork running the draft holds the shared session: a long request on another fork cannot close it."""
    decoder = _decoder(monkeypatch)
    worker = decoder.fork()
    assert worker.draft.sessions is decoder.draft_sessions and worker.closes_draft
    stream = worker.stream(_prompt(40), max_new_tokens=60, num_draft_tokens=3, proposer="draft")
    next(iter(stream))  # mid-request: it holds the draft
    decoder.generate(_prompt(900), max_new_tokens=20)
    assert decoder.draft_sessions.is_open
    for _ in stream:
        pass
    decoder.generate(_prompt(900), max_new_tokens=20)
    assert not decoder.draft_sessions.is_open


def test_a_decoder_that_does_not_close_the_draft_keeps_it(monkeypatch):
    decoder = _decoder(monkeypatch)
    decoder.closes_draft = False  # what load sets on a GPU provider (never measured there)
    decoder.generate(_prompt(900), max_new_tokens=20)
    assert decoder.draft_sessions.is_open and decoder.draft_sessions.closes == 0


def test_a_holder_refuses_to_close_while_held_or_given_an_open_session():
    opened = []
    holder = SessionHolder(lambda: opened.append(_Session()) or opened[-1], name="draft")
    with holder.held():
        assert not holder.close() and holder.is_open
    assert holder.close() and not holder.is_open and holder.get() is opened[-1] and len(opened) == 2
    fixed = SessionHolder(None, _Session())
    assert not fixed.close() and fixed.is_open


def test_a_deferred_holder_opens_in_the_background_checks_once_and_keeps_a_failure():
    """A holder made with defer opens nothing until asked; its background open runs ``then`` after it; a pass that
    needs it meanwhile waits for that open (one session, not two); a failed first open (the contract check) is
    raised by every later get."""
    import threading

    release, opened, checked, after = threading.Event(), [], [], []

    def slow_open():
        release.wait(10)
        opened.append(_Session())
        return opened[-1]

    holder = SessionHolder(slow_open, name="draft", defer=True, check=checked.append)
    assert not holder.is_open and not opened
    thread = holder.open_in_background(then=lambda: after.append(1))
    waiter = threading.Thread(target=lambda: after.append(holder.get()))
    waiter.start()
    release.set()
    thread.join(10)
    waiter.join(10)
    assert len(opened) == 1 and checked == opened and opened[0] in after and 1 in after
    assert holder.close() and holder.get() is opened[-1] and len(checked) == 1  # reopened: not checked again

    def refuse(session):
        raise ValueError("the graph's inputs differ from the manifest's")

    broken = SessionHolder(lambda: _Session(), name="draft", defer=True, check=refuse)
    broken.open_in_background().join(10)
    for _ in range(2):
        with pytest.raises(ValueError, match="differ from the manifest"):
            broken.get()


@pytest.mark.integration
def test_the_loaded_draft_opens_after_the_target_and_decodes_as_an_eager_one(tiny_bundle):
    """load returns with the target's session made and the draft's opening on its own thread; the first request
    that runs the draft waits for it; the tokens are a draft session's like any other."""
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(tiny_bundle)
    prompt = decoder.codec.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return")
    mode = dict(max_new_tokens=16, num_draft_tokens=3, proposer="draft")
    first = decoder.generate(prompt, **mode)
    assert decoder.draft_sessions.opens == 1 and first.stats.draft_forwards > 0
    again = SpeculativeDecoder.load(tiny_bundle)
    again.draft_sessions.get()  # opened before the request, as a server that waited would find it
    assert again.generate(prompt, **mode).token_ids == first.token_ids


@pytest.mark.integration
def test_closed_and_opened_again_a_real_draft_decodes_the_same_tokens(tiny_bundle):
    """onnxruntime sessions: after a close, the draft's runner (and a fork made while it was closed) binds the new
    session and the draft's proposals, hence the verified tokens, are the same."""
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(tiny_bundle)
    assert decoder.closes_draft
    prompt = decoder.codec.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return")
    mode = dict(max_new_tokens=16, num_draft_tokens=3, proposer="draft")
    before = decoder.generate(prompt, **mode)
    sessions = decoder.draft_sessions
    assert sessions.close("test") and not sessions.is_open and decoder.draft._binding is None
    gc.collect()
    worker = decoder.fork()
    decoder.clear_cache()
    after = decoder.generate(prompt, **mode)
    assert sessions.is_open and sessions.opens == 2 and after.stats.draft_forwards > 0
    assert after.token_ids == before.token_ids and after.stats.accepted == before.stats.accepted
    assert worker.generate(prompt, **mode).token_ids == before.token_ids


def test_metrics_say_whether_the_draft_s_session_is_in_memory(monkeypatch):
    """/metrics' gauge and counter follow the shared session: 1 and 0 closes, then 0 and 1 after a long context."""
    from types import SimpleNamespace

    from specdec.serving.metrics import Metrics

    decoder = _decoder(monkeypatch)
    pool = SimpleNamespace(decoder=decoder, waiting=0, busy=0, options=SimpleNamespace(workers=1), cancelled_jobs=0)
    text = Metrics().render(pool)
    assert "specdec_draft_session_open 1" in text and "specdec_draft_session_closes_total 0" in text
    decoder.generate(_prompt(900), max_new_tokens=20)
    text = Metrics().render(pool)
    assert "specdec_draft_session_open 0" in text and "specdec_draft_session_closes_total 1" in text
