"""Slot save / restore across a server restart, timed: what a saved conversation buys after `specdec serve` restarts.

usage: python tools/measure/slot_timing.py BUNDLE --prompt-file F [--next TEXT] [--max-tokens 64] [--threads N]
                                   [--max-context N] [--keep DIR]

On 127.0.0.1 (free ports), one worker, greedy, through llama-server's native routes:
  1. start `specdec serve BUNDLE --slot-save-path DIR`; the first turn (F's text) streamed from /completion:
     cold time to first token;
  2. save slot 0 (POST /slots/0?action=save), stop the server, start a fresh one (its startup time is shown);
  3. a one-token request on another prompt (the fresh process's first-request costs: calibration, allocations),
     then restore slot 0; the next turn (the first turn's prompt and answer, then --next) streamed: time to first token
     with the restored cache;
  4. erase slot 0 and run the same next turn cold: its time to first token, and whether both answers are the
     same tokens (they must be: a restored cache gives the output a cold one does).
Prints a table. Needs the [serve] extra and httpx. Times mean something only on a machine not shared with other
work; run it on the real model for real numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench.llama_server import ServerProcess, free_port


@contextlib.contextmanager
def server(bundle: str, folder: Path, extra: list):
    """`specdec serve` on a free 127.0.0.1 port; yields (url, seconds until healthy)."""
    port = free_port()
    argv = [sys.executable, "-m", "specdec.cli.main", "serve", bundle, "--host", "127.0.0.1", "--port", str(port),
            "--slot-save-path", str(folder), "--shutdown-grace", "5", *extra]
    started = time.perf_counter()
    try:
        process = ServerProcess(argv, port, "specdec serve").start(600)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    try:
        yield process.url, time.perf_counter() - started
    finally:
        process.stop()


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=600)
    if response.status_code != 200:
        raise SystemExit(f"{path}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def turn(url: str, prompt, max_tokens: int) -> dict:
    """One streamed /completion on slot 0: time to the first token, the tokens, the server's timings."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True, "return_tokens": True,
            "id_slot": 0, "cache_prompt": True}
    tokens, first, last = [], None, {}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise SystemExit(f"/completion: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise SystemExit(f"/completion: {event['error']['message']}")
            if event["tokens"] and first is None:
                first = time.perf_counter() - started
            tokens += event["tokens"]
            last = event
    return {"ttft": first if first is not None else time.perf_counter() - started, "tokens": tokens,
            "timings": last.get("timings", {})}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--prompt-file", required=True, help="the first turn's text (a long prompt)")
    parser.add_argument("--next", default="\n\n# Now explain the code above in one sentence.\n",
                        help="the text the next turn adds after the first turn's prompt and answer")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--keep", default=None, metavar="DIR", help="save the slot file here (default: a temp folder)")
    args = parser.parse_args(argv)
    text = Path(args.prompt_file).read_text(encoding="utf-8")
    extra = ([f"--threads={args.threads}"] if args.threads else []) + (
        [f"--max-context={args.max_context}"] if args.max_context else [])
    with contextlib.ExitStack() as stack:
        folder = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        with server(args.bundle, folder, extra) as (url, first_start):
            cold_first = turn(url, text, args.max_tokens)
            saved = post(url, "/slots/0?action=save", {"filename": "slot_timing.bin"})
            prompt_ids = post(url, "/tokenize", {"content": text, "add_special": True})["tokens"]
            more = post(url, "/tokenize", {"content": args.next})["tokens"]
        next_turn = prompt_ids + cold_first["tokens"] + more
        with server(args.bundle, folder, extra) as (url, restart):
            turn(url, "warm-up", 1)  # the first request's one-time costs, kept out of both next-turn timings
            restored = post(url, "/slots/0?action=restore", {"filename": "slot_timing.bin"})
            warm = turn(url, next_turn, args.max_tokens)
            post(url, "/slots/0?action=erase", {})
            cold = turn(url, next_turn, args.max_tokens)
    rows = [
        ("first turn, cold: time to first token", cold_first["ttft"] * 1000, len(prompt_ids),
         cold_first["timings"].get("cache_n", 0)),
        ("save slot 0", saved["timings"]["save_ms"], saved["n_saved"], f"{saved['n_written'] / 2**20:.1f} MiB"),
        ("server restart (until healthy)", restart * 1000, "", ""),
        ("restore slot 0", restored["timings"]["restore_ms"], restored["n_restored"], ""),
        ("next turn, restored: time to first token", warm["ttft"] * 1000, len(next_turn),
         warm["timings"].get("cache_n", 0)),
        ("next turn, cold: time to first token", cold["ttft"] * 1000, len(next_turn), cold["timings"].get("cache_n", 0)),
    ]
    print(f"slot timing: {args.bundle}, first turn {len(prompt_ids)} tokens, next turn {len(next_turn)}, "
          f"{args.max_tokens} new tokens each, greedy, one worker")
    print("| step | ms | prompt tokens | cached tokens (or size) |")
    print("|---|---|---|---|")
    for name, ms, tokens, cached in rows:
        print(f"| {name} | {ms:.1f} | {tokens} | {cached} |")
    same = warm["tokens"] == cold["tokens"]
    if args.keep:  # the token ids, to check against an in-process run
        (folder / "tokens.json").write_text(json.dumps({"first_prompt": prompt_ids, "first": cold_first["tokens"],
                                                        "next_turn": next_turn, "restored": warm["tokens"],
                                                        "cold": cold["tokens"]}))
    print(f"next turn restored vs cold: {'the same' if same else 'DIFFERENT'} {len(warm['tokens'])} tokens; time to "
          f"first token {warm['ttft'] * 1000:.1f} ms against {cold['ttft'] * 1000:.1f} ms "
          f"(cold / restored = {cold['ttft'] / max(warm['ttft'], 1e-9):.2f})")
    if not same:
        at = next((i for i, (a, b) in enumerate(zip(warm["tokens"], cold["tokens"])) if a != b),
                  min(len(warm["tokens"]), len(cold["tokens"])))
        print(f"first difference at token {at}: restored {warm['tokens'][at:at + 8]}, cold {cold['tokens'][at:at + 8]}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
