"""Seconds from a server's start to its first 200 on /health: `specdec serve BUNDLE` and, beside it, llama-server on a
GGUF, quiet or beside a process that keeps ``--load`` cores busy (a duty-cycled spin loop, as an editor or a test
runner beside the server would).

    python tools/measure/startup_time.py BUNDLE [--llama-server BIN --gguf FILE] [--starts 3] [--load 0.5]
        [--fresh-cache] [--checkout DIR ...] [--first-request TRACE [--delay S]]

``--fresh-cache`` points SPECDEC_CACHE at an empty folder for the first start (what a first start on a new machine
measures and stores), then keeps it for the later starts. ``--checkout DIR`` (repeatable) also starts specdec from
another source tree (``DIR/src`` first on PYTHONPATH, e.g. a ``git worktree`` of an earlier commit), each start
of every arm in turn, the order reversed every other start. ``--first-request TRACE`` (a ``make_traces.py`` trace)
also sends its first request to each server ``--delay`` seconds after /health answers (streamed, greedy, its
``max_tokens``) and prints the seconds to its first streamed text: a user's first turn after starting the server, with
whatever the server still does after a load. Every server binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spin(share: float, stop) -> None:
    """Keep ``share`` of one core busy (10 ms periods) until ``stop`` is set."""
    period = 0.01
    while not stop.is_set():
        begin = time.perf_counter()
        while time.perf_counter() - begin < period * share:
            pass
        time.sleep(period * (1 - share))


def first_token_seconds(port: int, request: dict, limit: float = 600.0) -> float:
    """Seconds from sending ``request`` (a trace's first: chat messages or a completion prompt) to its first text."""
    chat = request.get("route", "chat") == "chat"
    body = {"model": "served", "max_tokens": request.get("max_tokens", 128), "stream": True, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": request["user"]}]
    else:
        body["prompt"] = request["prompt"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    sent = time.perf_counter()
    call = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
    with urllib.request.urlopen(call, timeout=limit) as answer:
        for line in answer:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                return time.perf_counter() - sent
    raise SystemExit("the first request streamed no text")


def time_to_health(argv: list, env: dict, port: int, limit: float = 300.0, then=None):
    """Seconds to the first 200 on /health; with ``then`` (port -> value), (those seconds, its value) before the
    server is stopped."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - started < limit:
            if process.poll() is not None:
                raise SystemExit(f"{argv[0]} exited with {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        ready = time.perf_counter() - started
                        return ready if then is None else (ready, then(port))
            except OSError:
                pass
            time.sleep(0.02)
        raise SystemExit(f"no /health within {limit} s")
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.0, help="cores kept busy beside the servers (0: quiet)")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty SPECDEC_CACHE for the first start")
    parser.add_argument("--checkout", action="append", default=[], help="another source tree to start specdec from")
    parser.add_argument("--first-request", default=None, metavar="TRACE", help="time the trace's first request too")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between /health and the first request")
    args = parser.parse_args(argv)
    then = None
    if args.first_request:
        with open(args.first_request, encoding="utf-8") as trace:
            request = json.load(trace)["requests"][0]

        def then(port):
            time.sleep(args.delay)
            return first_token_seconds(port, request)

    def cell(name, timed):
        return f" {name} {timed:.2f} s" if then is None else f" {name} {timed[0]:.2f} s (first token {timed[1]:.2f} s)"

    env = dict(os.environ)
    if args.fresh_cache:
        env["SPECDEC_CACHE"] = tempfile.mkdtemp(prefix="specdec-cache-")
    stop = multiprocessing.Event()
    spinners = []
    whole, part = divmod(args.load, 1.0)
    for share in [1.0] * int(whole) + ([part] if part > 0 else []):
        spinners.append(multiprocessing.Process(target=_spin, args=(share, stop), daemon=True))
        spinners[-1].start()
    arms = [("specdec", env)] + [(f"specdec at {folder}", dict(env, PYTHONPATH=os.path.join(folder, "src")))
                                 for folder in args.checkout]
    try:
        for start in range(args.starts):
            line = f"start {start + 1}:"
            for name, arm_env in arms if start % 2 == 0 else arms[::-1]:
                port = _free_port()
                timed = time_to_health([sys.executable, "-m", "specdec.cli.main", "serve", args.bundle, "--port",
                                        str(port), "--host", "127.0.0.1"], arm_env, port, then=then)
                line += cell(name, timed) + ","
            line = line.rstrip(",")
            if args.llama_server:
                port = _free_port()
                llama = time_to_health([args.llama_server, "-m", args.gguf, "--port", str(port), "--host",
                                        "127.0.0.1", "-c", "32768"], env, port, then=then)
                line += "," + cell("llama-server", llama)
            print(line + f" (load beside: {args.load} cores)", flush=True)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
