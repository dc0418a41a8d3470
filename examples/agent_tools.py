"""An agent's calls through the official OpenAI client against `specdec serve`: a tool-call round trip (call,
tool result, final answer), streamed and not, and a JSON-schema answer. Prints a transcript.

usage: python examples/agent_tools.py BUNDLE [--threads 2] [--url http://127.0.0.1:PORT]
needs: pip install -e ".[serve,examples]"   (the server, and the openai / httpx clients this script uses)

Without --url it starts `specdec serve BUNDLE` on 127.0.0.1 on a free port (needs the [serve] extra) and stops
it at the end. Greedy (temperature 0) with the server's default speculation ("auto").
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import httpx
from openai import OpenAI

from specdec.bench.llama_server import free_port  # a free 127.0.0.1 port (the session bench uses it too)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
QUESTION = [{"role": "user", "content": "What's the weather in Paris right now, in celsius?"}]
PACKAGE = {"type": "object", "properties": {
    "name": {"type": "string"}, "language": {"type": "string"},
    "first_release_year": {"type": "integer", "minimum": 1970, "maximum": 2030},
    "license": {"type": "string"}, "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["name", "language", "first_release_year", "license", "keywords"], "additionalProperties": False}


def weather(city: str, unit: str = "celsius") -> str:
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "sunny"})


def show(label: str, value) -> None:
    text = value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)
    print(f"--- {label}\n{text}", flush=True)


def round_trip(client: OpenAI, model: str, stream: bool) -> None:
    print(f"\n=== tool-call round trip ({'streaming' if stream else 'one response'})")
    show("user", QUESTION[0]["content"])
    kwargs = dict(model=model, messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=128)
    if stream:
        calls, finish, content = {}, None, ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
                show("delta.tool_calls", part.model_dump(exclude_none=True))
            finish = chunk.choices[0].finish_reason or finish
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in calls.values()]
        assistant = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
    else:
        response = client.chat.completions.create(**kwargs)
        message, finish = response.choices[0].message, response.choices[0].finish_reason
        show("assistant message", message.model_dump(exclude_none=True))
        assistant = message.model_dump(exclude_none=True)
        tool_calls = assistant.get("tool_calls", [])
    show("finish_reason", finish)
    if not tool_calls:
        print("(the model answered without calling the tool)")
        return
    results = [{"role": "tool", "tool_call_id": call["id"],
                "content": weather(**json.loads(call["function"]["arguments"]))} for call in tool_calls]
    for result in results:
        show("tool result", result)
    final = client.chat.completions.create(model=model, messages=QUESTION + [assistant] + results, tools=[WEATHER],
                                           temperature=0, max_tokens=96)
    show("final answer", final.choices[0].message.content)
    show("finish_reason", final.choices[0].finish_reason)


def json_answer(client: OpenAI, model: str) -> None:
    print("\n=== response_format json_schema")
    question = "Describe the Python package requests."
    show("user", question)
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "package", "schema": PACKAGE, "strict": True}})
    text = response.choices[0].message.content
    show("assistant content", text)
    value = json.loads(text)
    try:
        import jsonschema

        jsonschema.validate(value, PACKAGE)
        show("validates against the schema", "yes")
    except ImportError:
        show("parsed as JSON", "yes (jsonschema not installed: not validated)")
    show("specdec", response.model_extra.get("specdec"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    args = parser.parse_args()
    server, url = None, args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "serve", args.bundle, "--host",
                                   "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
                                   "--model-name", "specdec"])
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or (server is not None and server.poll() is not None):
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=900, max_retries=0)
        model = client.models.list().data[0].id
        round_trip(client, model, stream=False)
        round_trip(client, model, stream=True)
        json_answer(client, model)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
