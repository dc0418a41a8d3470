"""Constrained vs unconstrained decode speed, with and without speculation, on the same chat prompts (greedy).

usage: python tools/measure/constrained_bench.py BUNDLE [--threads 2] [--max-tokens 128] [--repeats 1] [--out FILE.json]

For each prompt (a request for JSON) and each of four modes: target-only (num_draft_tokens=0) and default
speculation ("auto"), each unconstrained and with the prompt's JSON schema (``constraint=``), one
``dec.chat`` call; the four modes run back to back per prompt, their order rotating from prompt to prompt
(the machine's load drifts). Reports per mode: new tokens, decode seconds, tokens/s (sum of tokens / sum of
decode seconds), acceptance, and the time the constraint engine spent computing masks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specdec import Constraint, SpeculativeDecoder

PROMPTS = [
    ("Describe the Python package numpy as JSON.", {
        "type": "object", "properties": {"name": {"type": "string"}, "language": {"type": "string"},
                                         "license": {"type": "string"},
                                         "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["name", "language", "license", "keywords"], "additionalProperties": False}),
    ("Give the signature of a Python function that merges two sorted lists, as JSON.", {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "parameters": {"type": "array", "items": {
                                             "type": "object", "properties": {"name": {"type": "string"},
                                                                              "type": {"type": "string"}},
                                             "required": ["name", "type"], "additionalProperties": False}},
                                         "returns": {"type": "string"}},
        "required": ["name", "parameters", "returns"], "additionalProperties": False}),
    ("List three HTTP status codes with their meaning as a JSON array of objects.", {
        "type": "array", "items": {"type": "object", "properties": {"code": {"type": "integer"},
                                                                    "meaning": {"type": "string"}},
                                   "required": ["code", "meaning"], "additionalProperties": False},
        "minItems": 3, "maxItems": 3}),
    ("Write a JSON config for a web server with host, port, tls and a list of routes.", {
        "type": "object", "properties": {"host": {"type": "string"}, "port": {"type": "integer"},
                                         "tls": {"type": "boolean"},
                                         "routes": {"type": "array", "items": {
                                             "type": "object", "properties": {"path": {"type": "string"},
                                                                              "handler": {"type": "string"}},
                                             "required": ["path", "handler"], "additionalProperties": False},
                                             "maxItems": 4}},
        "required": ["host", "port", "tls", "routes"], "additionalProperties": False}),
    ("File a bug report as JSON about a crash when a file name has spaces.", {
        "type": "object", "properties": {"title": {"type": "string"},
                                         "severity": {"enum": ["low", "medium", "high", "critical"]},
                                         "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                         "expected": {"type": "string"}, "actual": {"type": "string"}},
        "required": ["title", "severity", "steps", "expected", "actual"], "additionalProperties": False}),
    ("Describe a user record (id, name, email, roles) as JSON.", {
        "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                         "email": {"type": "string"},
                                         "roles": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["id", "name", "email", "roles"], "additionalProperties": False}),
]
MODES = [("target-only", False), ("target-only", True), ("auto", False), ("auto", True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    decoder = SpeculativeDecoder.load(args.bundle, threads=args.threads)
    decoder.costs()  # calibrate (or read the stored costs) before timing anything
    decoder.chat([{"role": "user", "content": "hi"}], max_new_tokens=4,
                 constraint=Constraint.json_object())  # builds the engine's tokenizer view once
    totals = {mode: {"tokens": 0, "seconds": 0.0, "proposed": 0, "accepted": 0, "grammar_seconds": 0.0,
                     "grammar_masks": 0, "host_seconds": 0.0, "valid": 0, "runs": 0} for mode in MODES}
    runs = []
    index = 0
    for repeat in range(args.repeats):
        for prompt, schema in PROMPTS:
            order = MODES[index % len(MODES):] + MODES[: index % len(MODES)]
            index += 1
            for speculation, constrained in order:
                options = dict(max_new_tokens=args.max_tokens, num_draft_tokens=0 if speculation == "target-only"
                               else "auto")
                if constrained:
                    options["constraint"] = Constraint.json_schema(schema)
                started = time.perf_counter()
                result = decoder.chat([{"role": "user", "content": prompt}], **options)
                stats = result.stats
                try:
                    json.loads(result.text)
                    valid = True
                except json.JSONDecodeError:
                    valid = False
                total = totals[(speculation, constrained)]
                total["tokens"] += stats.new_tokens
                total["seconds"] += stats.decode_seconds
                total["proposed"] += stats.proposed
                total["accepted"] += stats.accepted
                total["grammar_seconds"] += stats.grammar_seconds
                total["grammar_masks"] += stats.grammar_masks
                total["host_seconds"] += stats.host_seconds
                total["valid"] += valid
                total["runs"] += 1
                runs.append({"prompt": prompt, "speculation": speculation, "constrained": constrained,
                             "text": result.text, "json": valid, **stats.as_dict(),
                             "wall_seconds": time.perf_counter() - started})
                print(f"{speculation:11s} {'constrained' if constrained else 'free':11s} {stats.new_tokens:4d} tok "
                      f"{stats.tokens_per_s:5.2f} tok/s acc {stats.acceptance_rate:.2f} masks {stats.grammar_masks:4d} "
                      f"{stats.grammar_seconds * 1000:7.1f} ms  {result.text[:60]!r}", flush=True)
    print("\n| speculation | output | tokens | decode s | tok/s | acceptance | grammar masks | mask time | JSON parses |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rate = {}
    for mode, total in totals.items():
        rate[mode] = total["tokens"] / total["seconds"] if total["seconds"] else 0.0
        acceptance = total["accepted"] / total["proposed"] if total["proposed"] else 0.0
        share = total["grammar_seconds"] / total["seconds"] if total["seconds"] else 0.0
        print(f"| {mode[0]} | {'json_schema' if mode[1] else 'free'} | {total['tokens']} | {total['seconds']:.1f} | "
              f"{rate[mode]:.2f} | {acceptance:.2f} | {total['grammar_masks']} | "
              f"{total['grammar_seconds'] * 1000:.0f} ms ({share:.1%}) | {total['valid']}/{total['runs']} |")
    print(f"\nconstraint cost, target-only: {1 - rate[('target-only', True)] / rate[('target-only', False)]:+.1%} "
          f"tok/s; auto: {1 - rate[('auto', True)] / rate[('auto', False)]:+.1%} tok/s")
    print(f"speculation speedup: free {rate[('auto', False)] / rate[('target-only', False)]:.2f}x, "
          f"constrained {rate[('auto', True)] / rate[('target-only', True)]:.2f}x")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump({"totals": {f"{k[0]}/{'constrained' if k[1] else 'free'}": v for k, v in totals.items()},
                       "runs": runs}, out, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
