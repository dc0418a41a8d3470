"""JSON-schema answers through the OpenAI client, with speculation on: how many of N validate against their schema.

usage: python tools/check/json_schema_check.py BUNDLE [--prompts 50] [--threads 2] [--max-tokens 160] [--out FILE.json]

Starts `specdec serve BUNDLE` on 127.0.0.1 (one worker, default speculation "auto"), then sends N chat requests,
each with ``response_format: {"type": "json_schema", ...}`` (strict), over 10 schemas x the subjects below, greedy.
Each answer is parsed and validated with ``jsonschema``; an answer cut by max_tokens counts as a failure.
Prints one line per request and the pass count; writes every answer to --out.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import httpx
import jsonschema
from openai import OpenAI

from specdec.bench.llama_server import free_port  # a free 127.0.0.1 port (the session bench uses it too)

SCHEMAS = {
    "package": ("Describe the software package {s}.", {
        "type": "object", "properties": {"name": {"type": "string"}, "language": {"type": "string"},
                                         "license": {"type": "string"},
                                         "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["name", "language", "license", "keywords"], "additionalProperties": False}),
    "function": ("Give the signature of a Python function that does: {s}.", {
        "type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"},
                                         "parameters": {"type": "array", "items": {
                                             "type": "object", "properties": {"name": {"type": "string"},
                                                                              "type": {"type": "string"}},
                                             "required": ["name", "type"], "additionalProperties": False},
                                             "maxItems": 4},
                                         "returns": {"type": "string"}},
        "required": ["name", "parameters", "returns"], "additionalProperties": False}),
    "bug": ("File a bug report about: {s}.", {
        "type": "object", "properties": {"title": {"type": "string", "maxLength": 80},
                                         "severity": {"enum": ["low", "medium", "high", "critical"]},
                                         "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                   "maxItems": 3}},
        "required": ["title", "severity", "steps"], "additionalProperties": False}),
    "rating": ("Rate this idea from 1 to 10 and say why: {s}.", {
        "type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10},
                                         "reason": {"type": "string", "maxLength": 200}},
        "required": ["score", "reason"], "additionalProperties": False}),
    "yesno": ("Answer with a boolean and a short explanation: is {s} a programming language?", {
        "type": "object", "properties": {"answer": {"type": "boolean"},
                                         "explanation": {"type": "string", "maxLength": 160}},
        "required": ["answer", "explanation"], "additionalProperties": False}),
    "commit": ("Write a commit message for a change that fixes: {s}.", {
        "type": "object", "properties": {"type": {"enum": ["fix", "feat", "refactor", "docs", "test"]},
                                         "scope": {"type": "string", "maxLength": 20},
                                         "subject": {"type": "string", "maxLength": 72}},
        "required": ["type", "subject"], "additionalProperties": False}),
    "config": ("Give a config for a web server that serves {s}.", {
        "type": "object", "properties": {"host": {"type": "string"}, "port": {"type": "integer", "minimum": 1,
                                                                             "maximum": 65535},
                                         "tls": {"type": "boolean"}, "workers": {"type": "integer", "minimum": 1}},
        "required": ["host", "port", "tls", "workers"], "additionalProperties": False}),
    "steps": ("List up to 4 steps to: {s}.", {
        "type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string", "maxLength": 100},
                                                   "minItems": 1, "maxItems": 4}},
        "required": ["steps"], "additionalProperties": False}),
    "entity": ("Extract the person and the city from: 'Ada met {s} in Paris.'", {
        "type": "object", "properties": {"people": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                         "city": {"type": ["string", "null"]}},
        "required": ["people", "city"], "additionalProperties": False}),
    "number": ("How many letters are in the word '{s}'? Give the count and the word.", {
        "type": "object", "properties": {"word": {"type": "string"}, "count": {"type": "integer", "minimum": 0}},
        "required": ["word", "count"], "additionalProperties": False}),
}
SUBJECTS = ["numpy", "a memory leak in a cache", "parsing CSV files", "Rust", "HTTP retries"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = [(name, template.format(s=subject), schema) for subject in SUBJECTS
             for name, (template, schema) in SCHEMAS.items()][: args.prompts]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "serve", args.bundle, "--host", "127.0.0.1",
                               "--port", str(port), "--threads", str(args.threads), "--model-name", "specdec"])
    records, passed = [], 0
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=900, max_retries=0)
        for index, (name, prompt, schema) in enumerate(cases):
            started = time.perf_counter()
            response = client.chat.completions.create(
                model="specdec", messages=[{"role": "user", "content": prompt}], temperature=0,
                max_tokens=args.max_tokens,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}})
            choice = response.choices[0]
            error = None
            try:
                jsonschema.validate(json.loads(choice.message.content), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                error = str(exc).splitlines()[0]
            passed += error is None
            extra = response.model_extra.get("specdec", {})
            records.append({"schema": name, "prompt": prompt, "answer": choice.message.content,
                            "finish_reason": choice.finish_reason, "valid": error is None, "error": error,
                            "tokens": response.usage.completion_tokens,
                            "acceptance_rate": extra.get("acceptance_rate"),
                            "tokens_per_second": extra.get("tokens_per_second"),
                            "seconds": round(time.perf_counter() - started, 2)})
            print(f"{index + 1:3d} {name:9s} {'ok  ' if error is None else 'FAIL'} {choice.finish_reason:6s} "
                  f"{response.usage.completion_tokens:4d} tok {extra.get('tokens_per_second', 0):5.1f} tok/s "
                  f"acc {extra.get('acceptance_rate', 0):.2f}  {choice.message.content[:90]!r}"
                  + (f"  [{error}]" if error else ""), flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    print(f"valid: {passed}/{len(cases)}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump({"passed": passed, "total": len(cases), "records": records}, out, indent=1, ensure_ascii=False)
    return 0 if passed == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
