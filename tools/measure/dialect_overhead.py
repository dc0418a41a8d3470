"""Dialect overhead: the same greedy conversation through /v1/chat/completions, /v1/responses and /v1/messages on one
running `specdec serve`, interleaved, whole and streamed.

usage: python tools/measure/dialect_overhead.py BUNDLE [--requests 5] [--max-tokens 64] [--threads N]

Starts `specdec serve BUNDLE` on 127.0.0.1 on a free port (one worker), sends one warm-up per route, then for
each request sends the conversation once through every route and mode (6 calls, in an order rotated each
request so no route always runs on a warmer cache), timing each call's wall time on one kept-alive httpx client.
Prints each route's median wall time per mode and its ratio to the chat route's (the target: <= 1.05), and
whether every route answered the same text (greedy: it must). Needs the [serve] extra and httpx. On a machine
shared with other work only the ratios mean something.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_overhead import running_server  # noqa: E402

SYSTEM = "You are a careful Python programmer. Answer with code only."
USER = "Write a function that returns the n-th Fibonacci number."


def bodies(model: str, max_tokens: int) -> dict:
    """route -> (path, body) of the same conversation, greedy."""
    chat = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]}
    responses = {"model": model, "max_output_tokens": max_tokens, "temperature": 0, "instructions": SYSTEM,
                 "input": USER}
    messages = {"model": model, "max_tokens": max_tokens, "temperature": 0, "system": SYSTEM,
                "messages": [{"role": "user", "content": USER}]}
    return {"chat": ("/v1/chat/completions", chat), "responses": ("/v1/responses", responses),
            "messages": ("/v1/messages", messages)}


def answer_text(route: str, reply: dict) -> str:
    if route == "chat":
        return reply["choices"][0]["message"]["content"] or ""
    if route == "responses":
        return "".join(part["text"] for item in reply["output"] if item["type"] == "message"
                       for part in item["content"])
    return "".join(block["text"] for block in reply["content"] if block["type"] == "text")


def streamed_text(route: str, lines) -> str:
    """The text of a stream, read from its data lines in the route's own event shapes."""
    text = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if ("error" in event and route == "chat") or event.get("type") in ("error", "response.failed"):
            raise SystemExit(f"{route}: server error: {event}")
        if route == "chat":
            text += [choice["delta"].get("content") or "" for choice in event.get("choices", [])]
        elif route == "responses" and event["type"] == "response.output_text.delta":
            text.append(event["delta"])
        elif route == "messages" and event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text.append(event["delta"]["text"])
    return "".join(text)


def call(client: httpx.Client, url: str, route: str, path: str, body: dict, stream: bool) -> tuple[float, str]:
    """(wall seconds, answer text) of one call."""
    started = time.perf_counter()
    if stream:
        with client.stream("POST", url + path, json={**body, "stream": True}, timeout=600) as response:
            response.raise_for_status()
            text = streamed_text(route, response.iter_lines())
    else:
        response = client.post(url + path, json=body, timeout=600)
        response.raise_for_status()
        text = answer_text(route, response.json())
    return time.perf_counter() - started, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads")
    args = parser.parse_args()
    if not 1 <= args.requests <= 100:
        parser.error("--requests must be in 1..100")
    with running_server(args.bundle, "overhead", args.threads) as url:
        client = httpx.Client()  # one kept-alive connection pool for every route
        routes = bodies("overhead", args.max_tokens)
        runs = [(route, stream) for stream in (False, True) for route in routes]
        for route, (path, body) in routes.items():  # warm-up: cost calibration, first allocations, the prompt cache
            call(client, url, route, path, body, False)
        walls: dict = {run: [] for run in runs}
        texts: set = set()
        for index in range(args.requests):
            for route, stream in runs[index % len(runs):] + runs[: index % len(runs)]:
                wall, text = call(client, url, route, *routes[route], stream)
                walls[(route, stream)].append(wall)
                texts.add(text)
    print(f"median wall time over {args.requests} requests ({args.max_tokens} tokens max, greedy, one worker)")
    print(f"{'route':<10} {'mode':<7} {'median':>9} {'vs chat':>8}")
    for route, stream in runs:
        median = statistics.median(walls[(route, stream)])
        base = statistics.median(walls[("chat", stream)])
        print(f"{route:<10} {'stream' if stream else 'whole':<7} {median:>8.3f}s {median / base:>7.3f}x")
    print(f"every route answered the same text: {len(texts) == 1}")
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
