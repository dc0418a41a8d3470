"""A model's onnxruntime session shared by a runner and its forks, that can be closed while no request uses it.

The draft's weights stay in memory while nothing runs the draft. On a long prompt the default proposer skips
the draft, because its prefill over the pasted files costs more than it saves (``draft_prefill_loses``). The
0.5B draft's packed weights and buffers are 0.38 GiB of the 1.5B pair's 2.0 GiB (measured: 2-core Xeon,
onnxruntime 1.32). ``SessionHolder.close`` frees the session. Runners drop their IO bindings first, and the
freed heap goes back to the OS (``resident.trim_heap``). The next pass of any runner on the holder opens the
session again (``get``) and binds anew, in 0.8-1.5 s on that machine (``open_seconds``: the decoder prices it
like the draft's catch-up). Output cannot change: the session is made again from the same file with the same
options, and the caches are the runners' own (untouched).

A holder made with ``defer=True`` opens nothing yet: ``open_in_background`` opens it on a thread of its own (the
loader does so for the draft once the target's session is made, so a server answers /health while the draft's
weights are still being packed), and a pass that needs it first waits for that open. Its first open checks the
session against the manifest (``check``); a failure there is raised by every ``get``.

Who holds it: a request whose proposer runs the draft holds the session for the whole request
(``held``), so ``close`` never frees a session a thread is running or is about to run again next round:
``close`` then does nothing and returns False. Boundary: no policy here (the decoder decides when to close).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager

from specdec.runners.resident import trim_heap

log = logging.getLogger(__name__)


class SessionHolder:
    """One model's session. ``open_session``: () -> a new session (None: the session given cannot be closed)."""

    def __init__(self, open_session: Callable | None, session=None, name: str = "model", defer: bool = False,
                 check: Callable | None = None):
        self._open = open_session
        self._check = check  # (session) -> None, run after the first open (the manifest's contract)
        self._failure: BaseException | None = None  # what the first open raised: every get raises it
        self.name = name
        self._lock = threading.Lock()
        self._users = 0
        self._runners = weakref.WeakSet()  # runners whose IO bindings belong to the open session
        self._session = session
        self.open_seconds = 0.0  # what the last open took
        self.after_reopen = None  # () -> None, run after each open but the first (the loader's release_after_load)
        self.opens = 0
        self.closes = 0
        if session is None and not defer:
            self.get()

    @property
    def is_open(self) -> bool:
        return self._session is not None

    def attach(self, runner) -> None:
        """``runner`` binds from the held onnxruntime session: ``close`` makes it drop its binding (``drop_binding``)."""
        with self._lock:
            self._runners.add(runner)

    def get(self):
        """The session, opened first if it was closed or not yet opened (waiting for an open under way)."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._session is None:
                begin = time.perf_counter()
                try:
                    session = self._open()
                    if self.opens == 0 and self._check is not None:
                        self._check(session)
                except Exception as exc:
                    if self.opens == 0:
                        self._failure = exc
                    raise
                self._session = session
                self.open_seconds = time.perf_counter() - begin
                self.opens += 1
                if self.opens > 1:
                    if self.after_reopen is not None:
                        self.after_reopen()
                    log.info("%s session opened again in %.2f s", self.name, self.open_seconds)
            return self._session

    def open_in_background(self, then: Callable | None = None) -> threading.Thread:
        """Open the session on a thread of its own (a pass that needs it meanwhile waits for it), then run ``then``;
        returns the thread."""
        def open_quietly():
            try:
                self.get()
            except Exception as exc:  # kept: the next get raises it where a request can report it
                log.error("%s session could not be opened: %s", self.name, exc)
                return
            if then is not None:
                then()

        # not a daemon: a process that ends while onnxruntime is making the session waits for it (ending under it
        # aborts the process: "terminate called without an active exception")
        thread = threading.Thread(target=open_quietly, name=f"specdec-open-{self.name}", daemon=False)
        thread.start()
        return thread

    @contextmanager
    def held(self):
        """While inside, ``close`` does nothing: a request (or a measurement) that runs the model holds it."""
        with self._lock:
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1

    def close(self, reason: str = "") -> bool:
        """Free the session (its weights, its buffers) if it is open, can be opened again and nothing holds it;
        the runners drop their bindings first. Returns whether it was closed."""
        with self._lock:
            if self._session is None or self._open is None or self._users:
                return False
            for runner in list(self._runners):
                runner.drop_binding()
            self._session = None  # the last reference: the runners reach it only through get()
            self.closes += 1
        trim_heap()  # the weights' freed heap blocks go back to the OS
        log.info("%s session closed%s; the next pass that needs it opens it again (%.2f s last time)", self.name,
                 f" ({reason})" if reason else "", self.open_seconds)
        return True


class SessionRunner:
    """What the onnxruntime runners share: ``session`` through their holder, an IO binding made on first use after
    each open (``_new_binding``, the backend's), dropped when the holder closes."""

    sessions: SessionHolder
    _binding = None

    @property
    def session(self):
        return self.sessions.get()

    def _live_binding(self):
        if self._binding is None:
            self._binding = self._new_binding(self.session)
        return self._binding

    def _new_binding(self, session):
        raise NotImplementedError

    def drop_binding(self) -> None:
        self._binding = None
