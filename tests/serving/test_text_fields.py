"""Every text field of every route: text that is not text (a lone surrogate, which valid JSON can carry as "\\ud800")
is a 400 naming the field, in the route's error shape, never a 500.

One table over routes x fields; the check is ``WireModel``'s (serving/wire.py), which every request model derives
from. A planted failure shows the table depends on it: without the check, /v1/completions' prompt was a 500
(the tokenizer's TypeError) and a grammar a 400 that named nothing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.integration

BAD = "\ud800"  # a lone surrogate: json.dumps writes it as the escape "\ud800"
MODEL = "m"
CHAT = {"model": MODEL, "max_tokens": 2}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (route, body, the field the answer must name)
TABLE = [
    ("/v1/completions", {**CHAT, "prompt": BAD}, "prompt"),
    ("/v1/completions", {**CHAT, "prompt": ["ok", BAD][1:]}, "prompt.0"),
    ("/v1/completions", {**CHAT, "prompt": "a", "suffix": BAD}, "suffix"),
    ("/v1/completions", {**CHAT, "prompt": "a", "stop": BAD}, "stop"),
    ("/v1/completions", {**CHAT, "prompt": "a", "stop": ["x", BAD]}, "stop.1"),
    ("/v1/completions", {**CHAT, "prompt": "a", "grammar": f'root ::= "{BAD}"'}, "grammar"),
    ("/v1/completions", {**CHAT, "prompt": "a", "json_schema": {"type": "string", "const": BAD}}, "json_schema.const"),
    ("/v1/completions", {**CHAT, "prompt": "a", "json_schema": {BAD: 1}}, "json_schema"),
    ("/v1/completions", {**CHAT, "prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": BAD, "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    ("/v1/completions", {**CHAT, "model": BAD, "prompt": "a"}, "model"),
    ("/v1/completions", {**CHAT, "prompt": "a", "user": BAD}, "user"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a", "name": BAD}]}, "messages.0.name"),
    ("/v1/chat/completions", {**CHAT, "messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": BAD}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {**CHAT, "messages": USER + [{"role": "tool", "content": "1", "tool_call_id": BAD}]},
     "messages.1.tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "description": BAD}}]}, "tools.0.function.description"),
    ("/v1/chat/completions", {**CHAT, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            BAD: {"type": "string"}}}}}]}, "tools.0.function.parameters.properties"),
    ("/v1/chat/completions", {**CHAT, "messages": USER, "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": {"name": BAD}}}, "tool_choice.function.name"),
    ("/v1/chat/completions", {**CHAT, "messages": USER, "stop": [BAD]}, "stop.0"),
    ("/chat/completions", {**CHAT, "messages": [{"role": "system", "content": BAD}]}, "messages.0.content"),
    ("/infill", {"input_prefix": BAD}, "input_prefix"),
    ("/infill", {"input_prefix": "a", "input_suffix": BAD}, "input_suffix"),
    ("/infill", {"input_prefix": "a", "prompt": BAD}, "prompt"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "a.py", "text": BAD}]}, "input_extra.0.text"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": BAD, "text": "x"}]}, "input_extra.0.filename"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"text": "x", "time": BAD}]}, "input_extra.0.time"),
    ("/infill", {"input_prefix": "a", "stop": [BAD]}, "stop.0"),
    ("/infill", {"input_prefix": "a", "samplers": [BAD]}, "samplers.0"),  # a field specdec ignores
    ("/infill", {"input_prefix": "a", BAD: 1}, "body"),  # an unknown field whose name is not text
    ("/completion", {"prompt": BAD}, "prompt"),
    ("/completion", {"prompt": [1, BAD]}, "prompt.1"),
    ("/completion", {"prompt": "a", "stop": BAD}, "stop"),
    ("/completion", {"prompt": "a", "grammar": BAD}, "grammar"),
    ("/completion", {"prompt": "a", "response_fields": [BAD]}, "response_fields.0"),
    ("/completions", {"prompt": "a", "model": BAD}, "model"),
    ("/tokenize", {"content": BAD}, "content"),
    ("/tokenize", {"content": [3, BAD]}, "content.1"),
    ("/detokenize", {"tokens": [BAD]}, "tokens.0"),
    ("/slots/0?action=save", {"filename": BAD + ".bin"}, "filename"),
]


@pytest.fixture(scope="module")
def client(fim_bundle, tmp_path_factory):
    from fastapi.testclient import TestClient

    from specdec.serving.app import ServerOptions, build_app

    folder = tmp_path_factory.mktemp("slots")
    app = build_app(fim_bundle, ServerOptions(model_name=MODEL, slot_save_path=str(folder)))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _post(client, route, body):
    return client.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("route, body, field", TABLE, ids=[f"{route} {field}" for route, _, field in TABLE])
def test_text_that_is_not_text_is_a_400_naming_the_field(client, route, body, field):
    assert "\\ud800" in json.dumps(body)  # the body really carries the lone surrogate
    response = _post(client, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"{field}: " in error["message"] and "not valid text" in error["message"], error
    assert "\n" not in error["message"] and error["param"] == field, error
    if route.startswith("/v1"):
        assert error["code"] is None  # OpenAI's shape
    else:  # llama-server's routes, and the un-prefixed /chat/completions its clients call
        assert error["code"] == 400 and error["type"] == "invalid_request_error"  # llama-server's shape


def test_the_table_fails_without_the_check(client, monkeypatch):
    """Planted failure: with WireModel's check removed, a lone surrogate in /v1/completions' prompt is a 500 (the
    tokenizer's TypeError) again, and a grammar's is a 400 naming nothing: the table above catches both."""
    import specdec.serving.wire as wire

    monkeypatch.setattr(wire, "first_bad_text", lambda value, path=(): None)
    prompt = _post(client, "/v1/completions", {**CHAT, "prompt": BAD})
    assert prompt.status_code == 500, prompt.text
    grammar = _post(client, "/v1/completions", {**CHAT, "prompt": "a", "grammar": f'root ::= "{BAD}"'})
    assert grammar.json()["error"]["param"] != "grammar", grammar.text


def test_valid_text_everywhere_still_serves(client):
    """The check lets real text through: astral characters (a surrogate pair in JSON), accents, emoji."""
    for route, body in (("/v1/completions", {**CHAT, "prompt": "naïve 😀 \U0001F600", "stop": ["é"]}),
                        ("/completion", {"prompt": "😀", "n_predict": 1}),
                        ("/tokenize", {"content": "😀"}),
                        ("/infill", {"input_prefix": "é", "input_extra": [{"filename": "ü.py", "text": "😀"}],
                                     "n_predict": 1})):
        response = _post(client, route, body)
        assert response.status_code == 200, (route, response.text)
