"""The Responses and Messages dialects' pieces without a server: their bodies as chat messages (what the shared chat
path renders), the Responses store's bounds, Anthropic's stop reasons and error types, and what the strict models
accept, refuse and ignore. The SDKs against a live server: test_dialects_server.py and test_dialects_agents.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from pydantic import TypeAdapter, ValidationError  # noqa: E402

from specdec.serving.dialects import anthropic, responses  # noqa: E402
from specdec.serving.dialects.anthropic_models import MessagesRequest  # noqa: E402
from specdec.serving.dialects.responses_models import ResponsesRequest  # noqa: E402
from specdec.serving.jobs import Done  # noqa: E402
from specdec.serving.wire import APIError  # noqa: E402


def _responses_messages(body: dict, history=()) -> list:
    request = ResponsesRequest.model_validate({"model": "m", **body})
    items = request.input if isinstance(request.input, list) else [
        TypeAdapter(responses.InputMessage).validate_python({"role": "user", "content": request.input})]
    return responses.chat_messages(items, list(history))


def test_responses_items_become_the_chat_messages_an_agent_would_send():
    """Messages keep role and content (developer -> system; parts -> text parts); a function_call joins the
    assistant message before it (or opens one); a function_call_output answers its call as role "tool"."""
    items = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "weather "},
                                          {"type": "input_text", "text": "?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
             {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"}]
    assert _responses_messages({"input": items}) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "tool_calls": [{"id": "call_3", "type": "function",
                                              "function": {"name": "get_time", "arguments": "{}"}}]}]
    # after a stored conversation: the history first, untouched (a copy)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    merged = _responses_messages({"input": [items[3]]}, history)
    assert merged[:1] == history[:1] and merged[1]["tool_calls"][0]["id"] == "call_1"
    assert history[1] == {"role": "assistant", "content": "hello"}
    assert _responses_messages({"input": "hi"}) == [{"role": "user", "content": "hi"}]


def test_response_store_is_bounded_by_count_and_bytes_oldest_first():
    store = responses.ResponseStore(max_entries=3, max_bytes=200)
    conversation = [{"role": "user", "content": "x" * 20}]
    for index in range(4):
        store.put(f"resp_{index}", conversation)
    assert store.get("resp_0") is None and store.get("resp_3") == conversation  # count: the oldest went first
    assert len(store.entries) == 3 and store.bytes == 3 * len(json.dumps(conversation, separators=(",", ":")))
    store.put("resp_big", [{"role": "user", "content": "y" * 120}])  # fits alone: the older ones make room
    assert store.bytes <= 200 and store.get("resp_big") is not None and store.get("resp_1") is None
    store.put("resp_huge", [{"role": "user", "content": "z" * 500}])  # larger than the whole store: not kept
    assert store.get("resp_huge") is None and store.get("resp_big") is not None
    got = store.get("resp_big")
    got[0]["content"] = "changed"  # a copy: a caller cannot change what is stored
    assert store.get("resp_big")[0]["content"] == "y" * 120


def _anthropic(body: dict) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})


def test_anthropic_blocks_become_chat_messages_in_order():
    """tool_use blocks are the assistant message's tool_calls (input as JSON text); each tool_result is a role "tool"
    message where it stands among the user's text blocks; is_error is said in the text; system blocks are parts."""
    body = _anthropic({"system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                                          {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "go on"}]},
        {"role": "system", "content": "late note"}]})
    assert anthropic.chat_messages(body.system, body.messages) == [
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}],
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                        {"id": "toolu_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "text", "text": "42"}]},
        {"role": "tool", "tool_call_id": "toolu_2",
         "content": [{"type": "text", "text": "Error: "}, {"type": "text", "text": "boom"}]},
        {"role": "user", "content": [{"type": "text", "text": "go on"}]},
        {"role": "system", "content": "late note"}]


GO_ON = {"role": "user", "content": "go on"}


def test_anthropic_thinking_history_is_the_reasoning_content_templates_render():
    """An earlier answer's thinking blocks (an agent sends its history back) become the assistant message's
    reasoning_content, joined by blank lines; redacted ones carry nothing to render; a template that reads the field
    writes it (Qwen3's <think> blocks), one that does not leaves it out."""
    from specdec.decoding.text.chat import render_chat

    body = _anthropic({"messages": [GO_ON, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "first", "signature": "sig"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "thinking", "thinking": "second"},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}]})
    messages = anthropic.chat_messages(body.system, body.messages)
    assert messages[1]["reasoning_content"] == "first\n\nsecond" and messages[1]["tool_calls"][0]["id"] == "toolu_1"
    thinking = ("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
                "{% endif %}{{ m.role }}\n{% endfor %}")
    assert "<think>first\n\nsecond</think>assistant" in render_chat(thinking, messages)
    plain = "{% for m in messages %}{{ m.role }}\n{% endfor %}"
    assert "first" not in render_chat(plain, messages)


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": [{"type": "thinking", "thinking": "t"}]}], "messages.0.content.0"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}, GO_ON],
     "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "f",
                                                                  "input": {}}]}], "messages.0.content.1"),
])
def test_a_block_in_the_wrong_role_is_a_400_naming_it(messages, field):
    body = _anthropic({"messages": messages})
    with pytest.raises(APIError) as info:
        anthropic.chat_messages(body.system, body.messages)
    assert info.value.status == 400 and info.value.param == field


def test_a_final_assistant_message_stays_last_to_be_continued():
    """A prefill: Anthropic's API continues it (the renderer cuts the prompt after it: test_chat.py)."""
    body = _anthropic({"messages": [GO_ON, {"role": "assistant", "content": "The answer is"}]})
    assert anthropic.chat_messages(body.system, body.messages)[-1] == {"role": "assistant", "content": "The answer is"}


@pytest.mark.parametrize("finish, called, stop_string, expected", [
    ("eos", False, None, ("end_turn", None)),
    ("stop", False, None, ("end_turn", None)),  # the template's end-of-turn token
    ("stop", False, "END", ("stop_sequence", "END")),
    ("length", False, None, ("max_tokens", None)),
    ("stop", True, None, ("tool_use", None)),
    ("length", True, None, ("max_tokens", None)),  # a call cut by the budget is not a finished call
])
def test_anthropic_stop_reasons(finish, called, stop_string, expected):
    done = Done(stats=None, queue_seconds=0.0, finish=finish, stop_string=stop_string)
    assert anthropic.stop_reason(done, called) == expected


def test_anthropic_error_shape_and_types():
    """Every status maps to Anthropic's error type (what the SDK's exception classes are chosen by)."""
    expected = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}
    for status, kind in expected.items():
        response = anthropic.error_response(status, f"m{status}", param="x")
        assert response.status_code == status
        assert json.loads(response.body) == {"type": "error", "error": {"type": kind, "message": f"m{status}"}}
    assert anthropic.owns_errors("/v1/messages") and anthropic.owns_errors("/v1/messages/count_tokens")
    assert not anthropic.owns_errors("/v1/chat/completions") and not anthropic.owns_errors("/v1/messages_x")


def test_ignored_fields_are_the_ones_asking_for_what_specdec_does_not_do():
    plain = ResponsesRequest.model_validate({"model": "m", "input": "hi", "include": [], "store": False,
                                             "truncation": "disabled", "metadata": {"k": "v"}})
    assert plain.ignored_fields == []  # the Agents SDK's include: [] asks for nothing; metadata is echoed
    asks = ResponsesRequest.model_validate({"model": "m", "input": "hi", "user": "u", "service_tier": "auto",
                                            "reasoning": {"effort": "low"}, "truncation": "auto",
                                            "include": ["reasoning.encrypted_content"]})
    assert asks.ignored_fields == ["include", "reasoning", "service_tier", "truncation", "user"]
    assert _anthropic({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}}
                      ).ignored_fields == []
    assert _anthropic({"messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": "u"},
                       "thinking": {"type": "enabled", "budget_tokens": 1024},
                       "output_config": {"effort": "low"}}).ignored_fields == \
        ["metadata", "output_config.effort", "thinking"]


@pytest.mark.parametrize("body, field", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_responses_models_refuse_what_they_cannot_serve(body, field):
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})
    from fastapi.exceptions import RequestValidationError

    from specdec.serving.wire import field_errors
    assert field_errors(RequestValidationError(info.value.errors()))[1] == field
