"""The Responses API and Anthropic's Messages API through the official ``openai`` and ``anthropic`` SDKs against a
live `specdec serve` on the tiny chat bundle (127.0.0.1 only): greedy answers equal the chat route's for the same
conversation, token for token, whole and streamed (every stream parsed by the SDK's own stream helpers); counts,
stored conversations, stop sequences; and a table of bad inputs per route, each a 400 naming the field in the
route's error shape. Tool calls and the Agents SDK: test_dialects_agents.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_server import MODEL, served  # noqa: E402,F401 (served: `specdec serve` on the chat bundle, a fixture)

SYSTEM, USER = "be brief", "def add(a, b):"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
SKY = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}}, "required": ["sky"],
       "additionalProperties": False}


@pytest.fixture(scope="module")
def oc(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ac(served):
    """The Anthropic SDK appends /v1/messages to the server's root itself."""
    return anthropic.Anthropic(base_url=served[0], api_key="unused", max_retries=0, timeout=60)


def _chat(oc, messages=CHAT, **more):
    reply = oc.chat.completions.create(model=MODEL, messages=messages, temperature=0, **more)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage


def test_responses_equal_the_chat_route_whole_and_streamed(oc):
    """instructions + input (a string, or message items with parts) is the chat route's system + user: the same
    greedy text and token counts; the stream's typed events come in the API's order with one response id and
    rising sequence numbers, and end with response.incomplete when max_output_tokens cut the answer."""
    text, finish, chat_usage = _chat(oc, max_tokens=20)
    reply = oc.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=20, temperature=0)
    assert reply.output_text == text and reply.model == MODEL and reply.object == "response"
    assert reply.status == ("incomplete" if finish == "length" else "completed")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat_usage.prompt_tokens,
                                                                     chat_usage.completion_tokens)
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    assert reply.usage.input_tokens_details.cached_tokens <= reply.usage.input_tokens
    assert 0.0 <= reply.model_extra["specdec"]["acceptance_rate"] <= 1.0
    items = oc.responses.create(model=MODEL, max_output_tokens=20, temperature=0, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER[:4]},
                                                        {"type": "input_text", "text": USER[4:]}]}])
    assert items.output_text == text
    events = list(oc.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=20,
                                      temperature=0, stream=True))
    kinds = [event.type for event in events]
    last = "response.incomplete" if finish == "length" else "response.completed"
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          last]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert len({events[0].response.id, events[1].response.id, events[-1].response.id}) == 1
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == text == events[-4].text == events[-1].response.output_text
    assert {(d.item_id, d.output_index, d.content_index) for d in deltas} == {(events[2].item.id, 0, 0)}
    assert events[-1].response.usage.output_tokens == chat_usage.completion_tokens


def test_an_output_format_through_every_route_and_the_sdks_stream_helpers(oc, ac):
    """A JSON schema (chat's response_format, the Responses API's text.format, Anthropic's output_config.format)
    completes the answer; the SDKs' own helpers (responses.stream's get_final_response, messages.stream's
    get_final_message) parse the streams, and every route says the same."""
    text, finish, _ = _chat(oc, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "sky", "schema": SKY, "strict": True}})
    assert finish == "stop" and json.loads(text)["sky"] in ("sunny", "rainy")
    form = {"format": {"type": "json_schema", "name": "sky", "schema": SKY, "strict": True}}
    whole = oc.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=40, temperature=0,
                                text=form)
    assert (whole.output_text, whole.status, whole.text.format.type) == (text, "completed", "json_schema")
    with oc.responses.stream(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=40, temperature=0,
                             text=form) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == text and final.status == "completed"
    config = {"format": {"type": "json_schema", "schema": SKY}}
    message = ac.messages.create(model=MODEL, max_tokens=40, system=SYSTEM, messages=[{"role": "user",
                                                                                       "content": USER}],
                                 extra_body={"temperature": 0, "output_config": config})
    assert (message.content[0].text, message.stop_reason) == (text, "end_turn")
    with ac.messages.stream(model=MODEL, max_tokens=40, system=SYSTEM, messages=[{"role": "user", "content": USER}],
                            extra_body={"temperature": 0, "output_config": config}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == text and final.stop_reason == "end_turn"


def test_previous_response_id_continues_the_stored_conversation(oc):
    """A follow-up naming the first response renders as the whole conversation sent to the chat route; a response
    made with store: false (or an unknown id) is a 400 naming previous_response_id."""
    first = oc.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=8, temperature=0)
    second = oc.responses.create(model=MODEL, instructions=SYSTEM, previous_response_id=first.id,
                                 input="and sub?", max_output_tokens=8, temperature=0)
    explicit = CHAT + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "and sub?"}]
    text, _, chat_usage = _chat(oc, explicit, max_tokens=8)
    assert second.output_text == text and second.usage.input_tokens == chat_usage.prompt_tokens
    assert second.previous_response_id == first.id
    unstored = oc.responses.create(model=MODEL, input=USER, max_output_tokens=2, temperature=0, store=False)
    for ident in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as info:
            oc.responses.create(model=MODEL, previous_response_id=ident, input="x", max_output_tokens=2)
        assert info.value.body["param"] == "previous_response_id" and ident in info.value.body["message"]


def test_counts_are_the_rendered_prompt(oc, ac):
    _, _, chat_usage = _chat(oc, max_tokens=1)
    counted = oc.responses.input_tokens.count(model=MODEL, instructions=SYSTEM, input=USER)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", chat_usage.prompt_tokens)
    tokens = ac.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": USER}])
    assert tokens.input_tokens == chat_usage.prompt_tokens


def test_a_prefill_is_continued_alike_on_both_routes(ac, oc):
    """A conversation ending with the assistant's text: Anthropic's Messages and the chat route both continue it
    (the same greedy continuation, and not the answer to the conversation without it)."""
    prefill = {"role": "assistant", "content": "def add(a, b):\n    return"}
    text, _, _ = _chat(oc, CHAT + [prefill], max_tokens=12)
    message = ac.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": USER}, prefill])
    assert message.content[0].text == text
    assert _chat(oc, max_tokens=12)[0] != text  # the prefill was read


def test_messages_equal_the_chat_route_whole_and_streamed(ac, oc):
    """system + messages through the Anthropic SDK: the chat route's greedy text; usage splits the prompt into
    tokens computed and read from the cache; the stream (messages.stream) gives the same message."""
    text, finish, chat_usage = _chat(oc, max_tokens=20)
    reason = "max_tokens" if finish == "length" else "end_turn"
    ask = dict(model=MODEL, max_tokens=20, system=SYSTEM, messages=[{"role": "user", "content": USER}],
               extra_body={"temperature": 0})
    message = ac.messages.create(**ask)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == text
    assert (message.stop_reason, message.stop_sequence, message.model, message.role) == (reason, None, MODEL,
                                                                                          "assistant")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat_usage.prompt_tokens
    assert usage.output_tokens == chat_usage.completion_tokens and usage.cache_creation_input_tokens == 0
    with ac.messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == text and final.stop_reason == reason
    assert final.usage.output_tokens == chat_usage.completion_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat_usage.prompt_tokens


def test_stop_sequences_name_the_one_that_matched(ac, oc):
    text, _, _ = _chat(oc, max_tokens=24)
    # a stop the greedy answer reaches: two visible characters first seen past its start
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text[i:i + 2].strip() == text[i:i + 2] and text.index(text[i:i + 2]) == i)
    ask = dict(model=MODEL, max_tokens=24, system=SYSTEM, messages=[{"role": "user", "content": USER}],
               stop_sequences=["zzzz-never", stop], extra_body={"temperature": 0})
    message = ac.messages.create(**ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[: text.index(stop)]
    with ac.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                               text[: text.index(stop)])


def test_sdk_errors_carry_the_field(ac, oc):
    with pytest.raises(anthropic.BadRequestError, match="temperature") as info:
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                           extra_body={"temperature": 1.5})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError, match="gpt-4"):  # the server runs with --strict-model-name
        ac.messages.create(model="gpt-4", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        oc.responses.create(model=MODEL, input="hi", max_output_tokens=100_000)


# ----------------------------------------------------------------------------- bad inputs, each route
LONE = "\ud800"  # valid JSON ("\\ud800"), not encodable text
TOOL = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
ATOOL = {"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {}}}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
RESULT = {"type": "function_call_output", "call_id": "c1", "output": "42"}
SCHEMA_FORMAT = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
                                                                          "properties": {"a": {"description": LONE}}}}}

RESPONSES_BAD = [  # (body changes, field the error names)
    ({"input": 5}, "input"),
    ({"temperature": "hot", "top_p": 0}, "temperature"),
    ({"temperature": 3.0}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "y" * 600, "max_output_tokens": None}, "input"),  # no budget given: the prompt does not fit
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"tools": [{**TOOL, "name": "bad name"}]}, "tools.0.name"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": "required", "tools": [TOOL]}, "tool_choice"),  # this template has no call syntax
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"num_draft_tokens": 99}, "num_draft_tokens"),
    ({"proposer": "magic"}, "proposer"),
    ({"tree": [2, 1], "proposer": "lookup"}, "tree"),
    ({"stream": "yes"}, "stream"),
    # a lone surrogate in each text field
    ({"model": LONE}, "model"),
    ({"input": LONE}, "input"),
    ({"instructions": LONE}, "instructions"),
    ({"input": [{"role": "user", "content": LONE}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}]}, "input.0.content.0.text"),
    ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": LONE}]}]},
     "input.0.content.0.text"),
    ({"input": [{**CALL, "arguments": LONE}]}, "input.0.arguments"),
    ({"input": [{**CALL, "call_id": LONE}]}, "input.0.call_id"),
    ({"input": [{**CALL, "name": LONE}]}, "input.0.name"),
    ({"input": [CALL, {**RESULT, "output": LONE}]}, "input.1.output"),
    ({"input": [CALL, {**RESULT, "output": [{"type": "input_text", "text": LONE}]}]}, "input.1.output.0.text"),
    ({"tools": [{**TOOL, "description": LONE}]}, "tools.0.description"),
    ({"tools": [{**TOOL, "parameters": {"type": "object", "properties": {LONE: {}}}}]}, "tools.0.parameters"),
    ({"text": SCHEMA_FORMAT}, "text.format.schema"),
    ({"metadata": {"k": LONE}}, "metadata.k"),
    ({"user": LONE}, "user"),
    ({"previous_response_id": LONE}, "previous_response_id"),
]

MESSAGES_BAD = [
    ({"max_tokens": None}, "max_tokens"),  # None: the field left out
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{**ATOOL, "type": "bash_20250124"}]}, "tools.0.type"),
    ({"tools": [ATOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "magic"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                   {"role": "user", "content": "x"}]}, "messages.0.content.0"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "strnig"}}}}, "output_config.format"),
    ({"num_draft_tokens": 99}, "num_draft_tokens"),
    ({"stream": "yes"}, "stream"),
    # a lone surrogate in each text field
    ({"model": LONE}, "model"),
    ({"system": LONE}, "system"),
    ({"system": [{"type": "text", "text": LONE}]}, "system.0.text"),
    ({"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": LONE, "name": "f", "input": {}}]}]},
     "messages.0.content.0.id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": LONE, "input": {}}]}]},
     "messages.0.content.0.name"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                      "input": {"a": [LONE]}}]}]}, "messages.0.content.0.input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": LONE}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": LONE}]}]},
     "messages.0.content.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "text", "text": LONE}]}]}]},
     "messages.0.content.0.content.0.text"),
    ({"tools": [{**ATOOL, "description": LONE}]}, "tools.0.description"),
    ({"tools": [{**ATOOL, "input_schema": {"type": "object", "description": LONE}}]}, "tools.0.input_schema"),
    ({"stop_sequences": [LONE]}, "stop_sequences.0"),
    ({"metadata": {"user_id": LONE}}, "metadata.user_id"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"title": LONE}}}}, "output_config.format.schema"),
]


def _post(url: str, path: str, body: dict | None, raw: str | None = None):
    # json.dumps writes a lone surrogate as the escape "\ud800": valid JSON, as a client may send it
    return httpx.post(url + path, content=raw if raw is not None else json.dumps(body),
                      headers={"Content-Type": "application/json", "x-api-key": "unused",
                               "anthropic-version": "2023-06-01"}, timeout=30)


def _without_none(body: dict) -> dict:
    return {key: value for key, value in body.items() if value is not None}


@pytest.mark.parametrize("path", ["/v1/responses", "/responses"])
@pytest.mark.parametrize("change, field", RESPONSES_BAD, ids=[field for _, field in RESPONSES_BAD])
def test_responses_bad_requests_name_the_field(served, path, change, field):
    response = _post(served[0], path, _without_none({"model": MODEL, "input": "hi", "max_output_tokens": 4, **change}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # the field, or the path inside it down to the bad text (text.format.schema.properties.a.description)
    assert (error["param"] == field or error["param"].startswith(field + ".")) and field in error["message"], error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize("change, field", MESSAGES_BAD, ids=[field for _, field in MESSAGES_BAD])
def test_messages_bad_requests_name_the_field(served, change, field):
    body = _without_none({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change})
    response = _post(served[0], "/v1/messages", body)
    assert response.status_code == 400, response.text
    reply = response.json()
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
    assert reply["error"]["message"].startswith(field) and "\n" not in reply["error"]["message"], reply


@pytest.mark.parametrize("path, body, status, named", [
    ("/v1/responses", None, 400, "not valid JSON"),
    ("/v1/responses/input_tokens", None, 400, "not valid JSON"),
    ("/v1/responses/input_tokens", {"input": [{"role": "user", "content": LONE}]}, 400, "input.0.content"),
    ("/responses/input_tokens", {"input": "hi", "previous_response_id": "resp_x"}, 400, "previous_response_id"),
    ("/v1/responses/input_tokens", {"input": "hi", "max_output_tokens": 4}, 400, "max_output_tokens"),
    ("/v1/responses", {"model": "gpt-4", "input": "hi"}, 404, "gpt-4"),
])
def test_responses_routes_refuse_malformed_bodies_in_openai_shape(served, path, body, status, named):
    response = _post(served[0], path, body, raw="{not json" if body is None else None)
    assert response.status_code == status, response.text
    assert named in response.json()["error"]["message"]


@pytest.mark.parametrize("path, body, status, kind, named", [
    ("/v1/messages", None, 400, "invalid_request_error", "not valid JSON"),
    ("/v1/messages/count_tokens", None, 400, "invalid_request_error", "not valid JSON"),
    ("/v1/messages", [], 400, "invalid_request_error", "body"),
    ("/v1/messages/count_tokens", {"model": MODEL}, 400, "invalid_request_error", "messages"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": LONE}]}, 400,
     "invalid_request_error", "messages.0.content"),
    ("/v1/messages/count_tokens", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
     400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"model": "gpt-4", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error", "gpt-4"),
    ("/v1/messages/batches", {}, 404, "not_found_error", "Not Found"),
])
def test_messages_routes_refuse_malformed_bodies_in_anthropic_shape(served, path, body, status, kind, named):
    response = _post(served[0], path, body, raw="{not json" if body is None else None)
    assert response.status_code == status, response.text
    reply = response.json()
    assert reply["type"] == "error" and reply["error"]["type"] == kind and named in reply["error"]["message"], reply


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("path, body, field", [
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        IMAGE, {"type": "text", "text": "what is it"}]}]}, "messages.0.content.0"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{
        "type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}, IMAGE]}]}]},
     "messages.0.content.0.content.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]}]}, "messages.0.content.0"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAA"}]}]}, "input.0.content.0"),
])
def test_an_image_is_one_clear_line_naming_its_part(served, path, body, field):
    """A text model's server: an image anywhere is a 400 that says so and names the part (not each union
    alternative's complaint), in the route's error shape."""
    response = _post(served[0], path, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message == f"{field}: image input is not supported: the served model reads text only", message
