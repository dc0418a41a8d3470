"""Seconds from a server's start to its first 200 on /health: `specdec serve BUNDLE` and, beside it, llama-server on a
GGUF, quiet or beside a process that keeps ``--load`` cores busy (a duty-cycled spin loop, as an editor or a test
runner beside the server would).

    python tools/measure/startup_time.py BUNDLE [--llama-server BIN --gguf FILE] [--starts 3] [--load 0.5] [--fresh-cache]
        [--checkout DIR ...]

``--fresh-cache`` points SPECDEC_CACHE at an empty folder for the first start (what a first start on a new machine
measures and stores), then keeps it for the later starts. ``--checkout DIR`` (repeatable) also starts specdec from
another source tree (``DIR/src`` first on PYTHONPATH, e.g. a ``git worktree`` of an earlier commit), each start
of every arm in turn, the order reversed every other start. Every server binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
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


def time_to_health(argv: list, env: dict, port: int, limit: float = 300.0) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - started < limit:
            if process.poll() is not None:
                raise SystemExit(f"{argv[0]} exited with {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - started
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
    args = parser.parse_args(argv)
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
                seconds = time_to_health([sys.executable, "-m", "specdec.cli.main", "serve", args.bundle, "--port",
                                          str(port), "--host", "127.0.0.1"], arm_env, port)
                line += f" {name} {seconds:.2f} s,"
            line = line.rstrip(",")
            if args.llama_server:
                port = _free_port()
                llama = time_to_health([args.llama_server, "-m", args.gguf, "--port", str(port), "--host",
                                        "127.0.0.1", "-c", "32768"], env, port)
                line += f", llama-server {llama:.2f} s"
            print(line + f" (load beside: {args.load} cores)", flush=True)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
