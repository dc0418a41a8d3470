"""Server overhead: the same greedy requests through `specdec serve` (streaming) and in-process, interleaved.

usage: python tools/measure/serve_overhead.py BUNDLE [--requests 5] [--max-tokens 128] [--prompt TEXT] [--threads N]

Starts `specdec serve BUNDLE` on 127.0.0.1 on a free port (one worker), then for each request times
one streaming /v1/completions call (time to first token, wall time, tokens from `usage`) and one
in-process `dec.generate` (and `dec.stream`, what the server runs) of the same prompt, rotating which
goes first. Prints per-request numbers, the medians and the ratios server / in-process wall time. Needs the [serve] extra and httpx.
Only the ratio means something on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from specdec import SpeculativeDecoder

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {seconds:.0f}s")


@contextlib.contextmanager
def running_server(bundle: str, model: str, threads: int | None = None, extra: tuple = ()):
    """`specdec serve BUNDLE` on a free 127.0.0.1 port, one worker (``extra``: more flags), healthy: yields its url;
    stopped (SIGINT, then killed) on the way out."""
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli.main", "serve", bundle, "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1", "--model-name", model, *extra]
    if threads:
        command += ["--threads", str(threads)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def completion_chunks(client: httpx.Client, url: str, payload: dict):
    """The chunks of one streamed /v1/completions answer (a server error ends the tool)."""
    with client.stream("POST", f"{url}/v1/completions", json={**payload, "stream": True}, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise SystemExit(f"server error: {chunk['error']['message']}")
            yield chunk


def through_server(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming request: time to the first text, wall time, usage and the server's own decode speed."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "stream_options": {"include_usage": True}}
    text, first, usage, specdec = [], None, None, None
    started = time.perf_counter()
    for chunk in completion_chunks(client, url, payload):
        for choice in chunk.get("choices", []):
            if choice["text"] and first is None:
                first = time.perf_counter() - started
            text.append(choice["text"])
        usage = chunk.get("usage") or usage
        specdec = chunk.get("specdec") or specdec
    wall = time.perf_counter() - started
    return {"text": "".join(text), "ttft": first or wall, "wall": wall, "tokens": usage["completion_tokens"],
            "server_decode_tps": specdec["tokens_per_second"]}


def in_process(decoder, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    result = decoder.generate(prompt, max_new_tokens=max_tokens)
    wall = time.perf_counter() - started
    return {"text": result.text, "wall": wall, "tokens": len(result.token_ids),
            "prefill": result.stats.prefill_seconds, "decode_tps": result.stats.tokens_per_s}


def in_process_stream(decoder, prompt: str, max_tokens: int) -> dict:
    """The same request through dec.stream (what the server runs): splits HTTP cost from streaming cost."""
    pieces, first = [], None
    started = time.perf_counter()
    for piece in decoder.stream(prompt, max_new_tokens=max_tokens):
        first = first if first is not None else time.perf_counter() - started
        pieces.append(piece)
    wall = time.perf_counter() - started
    return {"text": "".join(pieces), "wall": wall, "ttft": first if first is not None else wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads, both sides")
    args = parser.parse_args()
    if not 1 <= args.requests <= 100:
        parser.error("--requests must be in 1..100")
    model = "overhead"
    with running_server(args.bundle, model, args.threads) as url:
        decoder = SpeculativeDecoder.load(args.bundle, threads=args.threads)
        client = httpx.Client()  # one connection pool, as a real client keeps (a new client per call costs ~0.1 s)
        through_server(client, url, model, args.prompt, args.max_tokens)  # warm-up (cost calibration, first allocations)
        in_process(decoder, args.prompt, args.max_tokens)
        served, local, streamed = [], [], []
        runs = [lambda: served.append(through_server(client, url, model, args.prompt, args.max_tokens)),
                lambda: local.append(in_process(decoder, args.prompt, args.max_tokens)),
                lambda: streamed.append(in_process_stream(decoder, args.prompt, args.max_tokens))]
        print(f"{'req':>3} {'server wall':>11} {'ttft':>7} {'tok':>4} {'generate wall':>13} {'tok':>4} "
              f"{'stream wall':>11} {'ttft':>7}")
        for index in range(args.requests):
            for run in runs[index % 3:] + runs[: index % 3]:  # rotate the order: no side always runs warmer
                run()
            s, p, t = served[-1], local[-1], streamed[-1]
            print(f"{index:>3} {s['wall']:>10.3f}s {s['ttft']:>6.3f}s {s['tokens']:>4} {p['wall']:>12.3f}s "
                  f"{p['tokens']:>4} {t['wall']:>10.3f}s {t['ttft']:>6.3f}s")
        same = all(s["text"] == p["text"] == t["text"] for s, p, t in zip(served, local, streamed))
        server_wall = statistics.median(s["wall"] for s in served)
        local_wall = statistics.median(p["wall"] for p in local)
        tokens = statistics.median(s["tokens"] for s in served)
        print(f"median over {args.requests} requests of {tokens:.0f} tokens (greedy, identical text: {same})")
        print(f"  server:     {server_wall:.3f}s wall, {tokens / server_wall:.1f} tok/s end to end, "
              f"time to first token {statistics.median(s['ttft'] for s in served):.3f}s, "
              f"decode {statistics.median(s['server_decode_tps'] for s in served):.1f} tok/s inside the server")
        print(f"  in-process: {local_wall:.3f}s wall, {tokens / local_wall:.1f} tok/s end to end, "
              f"prefill {statistics.median(p['prefill'] for p in local):.3f}s, "
              f"decode {statistics.median(p['decode_tps'] for p in local):.1f} tok/s")
        stream_wall = statistics.median(t["wall"] for t in streamed)
        print(f"  in-process dec.stream: {stream_wall:.3f}s wall, "
              f"time to first piece {statistics.median(t['ttft'] for t in streamed):.3f}s")
        print(f"  server / in-process wall time: {server_wall / local_wall:.3f}x vs dec.generate, "
              f"{server_wall / stream_wall:.3f}x vs dec.stream (what the server runs)")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
