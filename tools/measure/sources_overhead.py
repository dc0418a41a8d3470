"""What ``token_sources`` costs: the same greedy requests through one `specdec serve`, with and without the field.

usage: python tools/measure/sources_overhead.py BUNDLE [--requests 10] [--max-tokens 128] [--prompt TEXT] [--threads N]
                                       [--proposer NAME] [--draft-tokens N]

Starts `specdec serve BUNDLE` on 127.0.0.1 on a free port (one worker), warms it up, then sends each request twice,
streamed, once with ``token_sources: true`` and once without, alternating which goes first. Per request it reads the
server's own decode seconds (``specdec.decode_seconds`` of the final chunk: the decode loop, where the span work
runs) and the wall time, checks both answers are the same text (and that the spans concatenate to it), and prints
the medians and the ratios with / without. Without the field no span code runs at all (tested in
tests/serving/test_token_sources.py); the target with it is <= 1.02x decode time. Only the ratio means something on a
machine shared with other work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_overhead import PROMPT, completion_chunks, running_server  # noqa: E402  (tools/ is not a package)


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int, sources: bool, **more) -> dict:
    """A streamed greedy completion: its text, the spans' text, decode seconds (the server's), wall seconds."""
    body = {"model": "overhead", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "token_sources": sources, **more}
    text, spans, final = [], [], None
    started = time.perf_counter()
    for chunk in completion_chunks(client, url, body):
        choice = chunk["choices"][0]
        text.append(choice["text"])
        spans += [span["text"] for span in (chunk.get("specdec") or {}).get("sources", ())]
        if choice["finish_reason"]:
            final = chunk["specdec"]
    return {"text": "".join(text), "spans": "".join(spans), "decode": final["decode_seconds"],
            "wall": time.perf_counter() - started, "tokens_per_second": final["tokens_per_second"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--threads", type=int, default=None, help="the server's onnxruntime threads")
    parser.add_argument("--proposer", default=None, help="the requests' proposer (default: the server's)")
    parser.add_argument("--draft-tokens", type=int, default=None, help="the requests' num_draft_tokens (default auto)")
    args = parser.parse_args()
    if not 1 <= args.requests <= 200:
        parser.error("--requests must be in 1..200")
    with running_server(args.bundle, "overhead", args.threads, ("--no-webui",)) as url:
        client = httpx.Client()
        more = {key: value for key, value in (("proposer", args.proposer), ("num_draft_tokens", args.draft_tokens))
                if value is not None}

        def request(sources: bool) -> dict:
            return one_request(client, url, args.prompt, args.max_tokens, sources, **more)

        for sources in (False, True):  # warm-up: cost calibration, first allocations, the suffix store
            request(sources)
        runs = {False: [], True: []}
        print(f"{'req':>3} {'decode without':>14} {'decode with':>11} {'ratio':>6} {'wall without':>12} "
              f"{'wall with':>9}")
        for index in range(args.requests):
            order = (False, True) if index % 2 == 0 else (True, False)  # neither side always runs warmer
            for sources in order:
                runs[sources].append(request(sources))
            plain, spans = runs[False][-1], runs[True][-1]
            if plain["text"] != spans["text"] or spans["spans"] != spans["text"] or plain["spans"]:
                raise SystemExit(f"request {index}: the answers differ, or the spans do not match the text")
            print(f"{index:>3} {plain['decode']:>13.4f}s {spans['decode']:>10.4f}s "
                  f"{spans['decode'] / plain['decode']:>6.3f} {plain['wall']:>11.4f}s {spans['wall']:>8.4f}s")
        decode = {side: statistics.median(r["decode"] for r in runs[side]) for side in runs}
        wall = {side: statistics.median(r["wall"] for r in runs[side]) for side in runs}
        total = {side: sum(r["decode"] for r in runs[side]) for side in runs}
        tps = statistics.median(r["tokens_per_second"] for r in runs[False])
        print(f"median over {args.requests} requests ({tps:.1f} tok/s decode without the field):")
        print(f"  decode seconds: {decode[False]:.4f} without, {decode[True]:.4f} with token_sources: "
              f"{decode[True] / decode[False]:.3f}x (sums: {total[True] / total[False]:.3f}x)")
        print(f"  wall seconds:   {wall[False]:.4f} without, {wall[True]:.4f} with: {wall[True] / wall[False]:.3f}x")
        return 0


if __name__ == "__main__":
    sys.exit(main())
