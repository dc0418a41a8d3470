"""Tool calls through the Responses API and Anthropic's Messages API, and the OpenAI Agents SDK running an agent,
against an in-process server on 127.0.0.1 over the scripted model with Qwen2.5's chat template (test_agents_server.py's:
what it says is noise, but a required call is guaranteed by the grammar). A required call is the same call on every route;
a call's result sent back renders as the chat route renders it; the Agents SDK runs an agent with one function tool
(tracing off) and no socket leaves the loopback; a failure mid-stream is an error event in each dialect's shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_agents_server import ASK, MODEL, TIME, WEATHER, scripted_chat_decoder  # noqa: E402
from served_app import served_app  # noqa: E402

pytestmark = pytest.mark.integration  # servers in threads

TOOLS = [WEATHER, TIME]  # chat's nested function specs
FLAT = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's
ANTHROPIC = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
              **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
             for t in TOOLS]
QUESTION = ASK[0]["content"]
RESULT = '{"temp": 21}'


def _serve(decoder):
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    pool = DecoderPool(decoder, PoolOptions(workers=1, max_queue=4))
    return served_app(create_app(pool, ServerOptions(model_name=MODEL, shutdown_grace=1.0)))


@pytest.fixture(scope="module")
def url():
    with _serve(scripted_chat_decoder()) as (base, _):
        yield base


@pytest.fixture(scope="module")
def oc(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ac(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def _chat_call(oc, choice):
    reply = oc.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120,
                                       temperature=0, parallel_tool_calls=False)
    return reply.choices[0].message


@pytest.mark.parametrize("name", [None, "get_time"])
def test_a_required_call_is_the_same_call_on_every_route(oc, ac, name):
    """tool_choice required / any (or one named function) through each dialect: the same call, in each dialect's
    shape (a function_call output item; a tool_use block with the arguments as an object)."""
    chat = _chat_call(oc, "required" if name is None else {"type": "function", "function": {"name": name}})
    expected = [(call.function.name, call.function.arguments) for call in chat.tool_calls]
    assert len(expected) == 1 and (name is None or expected[0][0] == name)
    reply = oc.responses.create(model=MODEL, input=QUESTION, tools=FLAT, parallel_tool_calls=False, temperature=0,
                                max_output_tokens=120,
                                tool_choice="required" if name is None else {"type": "function", "name": name})
    assert reply.status == "completed" and [item.type for item in reply.output] == ["function_call"]
    call = reply.output[0]
    assert [(call.name, call.arguments)] == expected and call.call_id.startswith("call_") and call.id.startswith("fc_")
    message = ac.messages.create(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": QUESTION}],
                                 tools=ANTHROPIC, extra_body={"temperature": 0},
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True} if name is None else
                                 {"type": "tool", "name": name, "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use" and [block.type for block in message.content] == ["tool_use"]
    block = message.content[0]
    assert (block.name, block.input) == (expected[0][0], json.loads(expected[0][1])) and block.id.startswith("toolu_")


def test_a_required_call_sets_an_output_format_aside_but_not_a_grammar(oc):
    """An agent sends its final answer's format on every turn: with a required call the turn is the call (chat's
    response_format and the Responses API's text.format alike); a grammar cannot be combined with one (400)."""
    schema = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}}, "required": ["sky"]}
    expected = _chat_call(oc, "required").tool_calls[0].function
    chat = oc.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                                      temperature=0, parallel_tool_calls=False, response_format={
                                          "type": "json_schema", "json_schema": {"name": "sky", "schema": schema}})
    assert chat.choices[0].message.tool_calls[0].function == expected
    reply = oc.responses.create(model=MODEL, input=QUESTION, tools=FLAT, tool_choice="required", temperature=0,
                                parallel_tool_calls=False, max_output_tokens=120,
                                text={"format": {"type": "json_schema", "name": "sky", "schema": schema}})
    assert (reply.output[0].name, reply.output[0].arguments) == (expected.name, expected.arguments)
    with pytest.raises(openai.BadRequestError) as info:
        oc.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8,
                                   extra_body={"grammar": 'root ::= "a"'})
    assert info.value.body["param"] == "tool_choice" and "grammar" in info.value.body["message"]


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strnig"}}}


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "x", "max_output_tokens": 50, "tool_choice": "required",
                       "tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]}),
    ("/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"},
                      "tools": [{"name": "f", "input_schema": BAD_SCHEMA}]}),
])
def test_a_tool_schema_that_does_not_compile_names_tools(url, path, body):
    response = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith("tools is not usable") and error.get("param", "tools") == "tools", error


def test_responses_function_tool_round_trip(oc):
    """call -> function_call_output -> answer: sent back as input items (as an agent does) or after
    previous_response_id (the stored conversation), it renders as the chat route's conversation; streamed, the call
    comes as function_call_arguments events and the stream helper's final response holds it."""
    first = oc.responses.create(model=MODEL, input=QUESTION, tools=FLAT, tool_choice="required", temperature=0,
                                parallel_tool_calls=False, max_output_tokens=120)
    call = first.output[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    explicit = oc.responses.create(model=MODEL, tools=FLAT, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), output])
    chained = oc.responses.create(model=MODEL, tools=FLAT, max_output_tokens=8, temperature=0,
                                  previous_response_id=first.id, input=[output])
    chat = oc.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=8, temperature=0, messages=ASK + [
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": RESULT}])
    text = chat.choices[0].message.content or ""
    assert explicit.output_text == chained.output_text == text
    assert explicit.usage.input_tokens == chained.usage.input_tokens == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens > first.usage.input_tokens  # the call and its result were rendered
    with oc.responses.stream(model=MODEL, input=QUESTION, tools=FLAT, tool_choice="required", temperature=0,
                             parallel_tool_calls=False, max_output_tokens=120) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed" and final.output[0].arguments == call.arguments
    assert events[3].item_id == events[5].item.id == final.output[0].id


def test_messages_tool_use_round_trip(ac, oc):
    """tool_use -> tool_result -> answer renders as the chat route's conversation; streamed, the call is a tool_use
    block whose input the SDK's helper assembles from the input_json_delta."""
    ask = dict(model=MODEL, tools=ANTHROPIC, extra_body={"temperature": 0})
    first = ac.messages.create(max_tokens=120, messages=[{"role": "user", "content": QUESTION}],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, **ask)
    block = first.content[0]
    follow = ac.messages.create(max_tokens=8, **ask, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},  # with the SDK's null fields
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]}])
    chat = oc.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=8, temperature=0, messages=ASK + [
        {"role": "assistant", "tool_calls": [{"id": block.id, "type": "function", "function": {
            "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": block.id, "content": RESULT}])
    assert "".join(b.text for b in follow.content if b.type == "text") == (chat.choices[0].message.content or "")
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with ac.messages.stream(max_tokens=120, messages=[{"role": "user", "content": QUESTION}],
                            tool_choice={"type": "any", "disable_parallel_tool_use": True}, **ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", block.name, block.input)]


# ----------------------------------------------------------------------------- the OpenAI Agents SDK
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@contextlib.contextmanager
def loopback_only(monkeypatch):
    """Every connect and name lookup in this process must be the loopback's: any other is refused before it leaves
    (nothing is sent) and recorded in the yielded list."""
    refused: list = []
    connect, lookup = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(sock, address):
        if not (isinstance(address, tuple) and address[0] in LOOPBACK):
            refused.append(address)
            raise OSError(f"test guard: no connection to {address!r}")
        return connect(sock, address)

    def guarded_lookup(host, *args, **kwargs):
        if (host.decode() if isinstance(host, bytes) else host) not in LOOPBACK:
            refused.append(("lookup", host))
            raise socket.gaierror(f"test guard: no lookup of {host!r}")
        return lookup(host, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(socket.socket, "connect", guarded_connect)
        patch.setattr(socket, "getaddrinfo", guarded_lookup)
        yield refused


def test_the_guard_refuses_and_records_other_hosts(monkeypatch):
    """Planted: a connection to a documentation address (never routed) and a lookup of api.openai.com, as a
    tracing exporter would make, are refused before anything is sent, and recorded."""
    with loopback_only(monkeypatch) as refused:
        with pytest.raises(OSError):
            socket.create_connection(("192.0.2.1", 443), timeout=1)
        with pytest.raises(OSError):
            socket.getaddrinfo("api.openai.com", 443)
    assert refused == [("lookup", "192.0.2.1"), ("lookup", "api.openai.com")]


def test_agents_sdk_runs_an_agent_with_a_function_tool(url, monkeypatch):
    """An Agent with one function_tool and a structured final answer, run by Runner.run (Responses API, whole) and
    Runner.run_streamed (streamed): the model's required call runs the tool, its result goes back, the answer is
    the schema's; tracing is off and every socket the run opens is the server's on 127.0.0.1."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # read when agents is first imported
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    called: list = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"It is sunny in {city}."

    class Forecast(BaseModel):
        sky: Literal["sunny", "rainy"]

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")
    # the first turn must call (the scripted model's own choice is noise); the SDK resets tool_choice after a call
    agent = agents.Agent(name="weather", instructions="Be brief.", model=MODEL, tools=[get_weather],
                         output_type=Forecast, model_settings=agents.ModelSettings(tool_choice="required",
                                                                                   temperature=0, max_tokens=120))

    async def both():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        agents.set_default_openai_client(client, use_for_tracing=False)
        whole = await agents.Runner.run(agent, "What is the weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = {event.type async for event in streamed.stream_events()}
        await client.close()
        return whole, streamed, kinds

    with loopback_only(monkeypatch) as refused:
        whole, streamed, kinds = asyncio.run(both())
        agents.tracing.get_trace_provider().force_flush()  # nothing to send: tracing is off
    assert refused == []
    assert isinstance(whole.final_output, Forecast) and streamed.final_output == whole.final_output
    assert len(called) == 2 and "raw_response_event" in kinds
    items = [type(item).__name__ for item in whole.new_items]
    assert items == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], items


# ----------------------------------------------------------------------------- a failure mid-stream
class BreakingDecoder:
    """The scripted decoder whose stream fails after its second piece: a worker's failure once a stream started."""

    def __init__(self, inner):
        self.inner = inner

    def fork(self):
        return BreakingDecoder(self.inner.fork())

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, *args, **kwargs):
        return BreakingStream(self.inner.stream(*args, **kwargs))


class BreakingStream:
    def __init__(self, stream):
        self.stream, self.pieces = stream, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pieces == 2:
            raise RuntimeError("planted failure")
        self.pieces += 1
        return next(self.stream)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_a_failure_mid_stream_is_an_error_event_in_each_dialect():
    with _serve(BreakingDecoder(scripted_chat_decoder())) as (base, _):
        oc = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        events = list(oc.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0,
                                          stream=True))
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
        assert "planted failure" in events[-2].message and events[-1].response.status == "failed"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        ac = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(anthropic.APIStatusError, match="planted failure") as info:
            with ac.messages.stream(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
                                    extra_body={"temperature": 0}) as stream:
                list(stream)
        assert info.value.body == {"type": "error", "error": {"type": "api_error", "message": info.value.body[
            "error"]["message"]}}
