"""An app served by uvicorn in a thread of the test process, on 127.0.0.1 (for the server tests); a stand-in for
``specdec serve``'s background load."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def served_app(app, grace: float = 1.0, seconds: float = 30.0, ready_path: str = "/health"):
    """Yields (base url, the uvicorn server) once ``ready_path`` answers 200 (within ``seconds``; "/" for an app
    still loading, whose /health answers 503); stops it on exit."""
    import httpx
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}{ready_path}", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"server at {url} not healthy within {seconds}s")
            time.sleep(0.1)
        yield url, server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def failing_load(error: BaseException):
    """A stand-in for ``load_options.BackgroundLoad`` whose load ends in ``error`` (nothing is read or loaded)."""

    class FailingLoad:
        def __init__(self, *args, **kwargs):
            pass

        def let_it_start(self):
            pass

        def result(self):
            raise error

    return FailingLoad
