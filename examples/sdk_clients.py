"""The official clients agents use, pointed at `specdec serve`: the OpenAI SDK's Responses API, the Anthropic SDK's
Messages API and the OpenAI Agents SDK, each with a function tool round trip, whole and streamed (streams parsed by
the SDKs' own helpers). Prints a transcript. The answer after the tool's result is asked for with tool_choice none
(a 1.5B model given the tools again tends to call the tool again, through every route alike).

usage: python examples/sdk_clients.py --url http://127.0.0.1:8000 [--model NAME]
needs: pip install -e ".[examples]" anthropic openai-agents   (a server started with `specdec serve BUNDLE`)

Greedy (temperature 0) with the server's default speculation; loopback only (tracing of the Agents SDK is off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

TOOL = {"name": "get_weather", "description": "Get the current weather in a city",
        "schema": {"type": "object", "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
                   "required": ["city"]}}
QUESTION = "What is the weather in Paris right now?"
# newer anthropic SDKs dropped the temperature argument (the API still takes the field): sent as extra body
GREEDY = {"temperature": 0}


def weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


def show(label: str, value) -> None:
    text = value if isinstance(value, str) else json.dumps(value, indent=1, ensure_ascii=False, default=str)
    print(f"--- {label}\n{text}", flush=True)


def responses(url: str, model: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": TOOL["name"], "description": TOOL["description"],
              "parameters": TOOL["schema"]}]
    print("\n=== OpenAI SDK: client.responses (whole, tool round trip)")
    show("user", QUESTION)
    started = time.perf_counter()
    first = client.responses.create(model=model, input=QUESTION, tools=tools, tool_choice="required", temperature=0,
                                    max_output_tokens=120)
    call = next(item for item in first.output if item.type == "function_call")
    show("function_call", {"name": call.name, "arguments": call.arguments})
    result = weather(**json.loads(call.arguments))
    show("function_call_output", result)
    final = client.responses.create(model=model, previous_response_id=first.id, tools=tools, tool_choice="none",
                                    temperature=0,
                                    max_output_tokens=120,
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    show("assistant", final.output_text or [item.model_dump() for item in final.output])
    show("usage", final.usage.model_dump())
    print(f"({time.perf_counter() - started:.1f} s)")
    print("\n=== OpenAI SDK: client.responses.stream (the SDK's stream helper)")
    with client.responses.stream(model=model, input="Name three Python web frameworks, one line.", temperature=0,
                                 max_output_tokens=60) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    show("events", sorted(set(kinds)))
    show("assistant", response.output_text)


def messages(url: str, model: str) -> None:
    from anthropic import Anthropic

    client = Anthropic(base_url=url, api_key="unused", max_retries=0)
    tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["schema"]}]
    print("\n=== Anthropic SDK: client.messages.create (tool use round trip)")
    show("user", QUESTION)
    question = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model=model, max_tokens=120, messages=question, tools=tools,
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    use = next(block for block in first.content if block.type == "tool_use")
    show("tool_use", {"name": use.name, "input": use.input, "stop_reason": first.stop_reason})
    result = weather(**use.input)
    show("tool_result", result)
    final = client.messages.create(model=model, max_tokens=120, tools=tools, tool_choice={"type": "none"},
                                   extra_body=GREEDY, messages=question + [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    show("assistant", "".join(block.text for block in final.content if block.type == "text"))
    show("usage", final.usage.model_dump())
    print("\n=== Anthropic SDK: client.messages.stream (the SDK's stream helper)")
    with client.messages.stream(model=model, max_tokens=60, extra_body=GREEDY, stop_sequences=["\n\n"],
                                messages=[{"role": "user", "content": "Name three Rust crates for HTTP, one line."}]) \
            as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    show("assistant", text)
    show("stop", {"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence})


def agent(url: str, model: str) -> None:
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    import agents
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        result = weather(city)
        show("tool ran", {"city": city, "result": result})
        return result

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")
    runner_agent = agents.Agent(name="weather", instructions="Answer in one sentence.", model=model,
                                tools=[get_weather],
                                model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                    max_tokens=120))

    async def run():
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        whole = await agents.Runner.run(runner_agent, QUESTION)
        streamed = agents.Runner.run_streamed(runner_agent, QUESTION)
        kinds = {event.type async for event in streamed.stream_events()}
        await client.close()
        return whole, streamed, kinds

    print("\n=== OpenAI Agents SDK: Runner.run and Runner.run_streamed, one function tool")
    show("user", QUESTION)
    whole, streamed, kinds = asyncio.run(run())
    show("items", [type(item).__name__ for item in whole.new_items])
    show("final output (run)", whole.final_output)
    show("final output (run_streamed)", streamed.final_output)
    show("stream event types", sorted(kinds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="any-name", help="the name the clients send (any name is the served model)")
    args = parser.parse_args()
    for client in (responses, messages, agent):
        client(args.url, args.model)


if __name__ == "__main__":
    main()
