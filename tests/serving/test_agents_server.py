"""Agents through the official OpenAI client against the server (127.0.0.1, in-process): tool calls, JSON schemas,
grammars, logprobs, and a 400 naming the field for every bad spec. The model is scripted (a random bigram table over
the tiny character tokenizer): what it says is noise, but a required call or a schema is guaranteed by the grammar."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from paths import DATA

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "agent"
TEMPLATE = (DATA / "qwen2.5_chat_template.jinja").read_text()
# the tiny tokenizer's filler ids as the template's control tokens
TEMPLATE = TEMPLATE.replace("<|im_start|>", "<extra_121>").replace("<|im_end|>", "<extra_120>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def scripted_chat_decoder():
    from tokenizers import AddedToken

    from scripted import scripted_decoder
    from specdec.decoding.text import chat
    from specdec.decoding.text.codec import TextCodec
    from tiny_models import VOCAB, tiny_tokenizer

    backend = tiny_tokenizer().backend_tokenizer
    backend.add_special_tokens([AddedToken("<extra_120>", special=True), AddedToken("<extra_121>", special=True)])
    codec = TextCodec.__new__(TextCodec)
    codec.tokenizer = backend
    decoder = scripted_decoder(vocab=VOCAB, eos=1, draft_noise=0.3, seed=2, max_context=2048)
    decoder.codec = codec
    decoder.bundle_dir, decoder.manifest.files = "scripted-agent", {}
    chat._TEMPLATES[(str(decoder.bundle_dir), ())] = chat.ChatTemplate(TEMPLATE, "<test>", {})
    return decoder


@pytest.fixture(scope="module")
def client():
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions
    from served_app import served_app

    pool = DecoderPool(scripted_chat_decoder(), PoolOptions(workers=1, max_queue=4))
    with served_app(create_app(pool, ServerOptions(model_name=MODEL, shutdown_grace=1.0))) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _check_call(call, tools):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in spec
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=str)
@pytest.mark.integration
def test_tool_call_round_trip(client, choice):
    tools = [WEATHER, TIME]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                           max_tokens=120, temperature=0, parallel_tool_calls=False)
    answer = first.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    assert len(answer.message.tool_calls) == 1
    call = answer.message.tool_calls[0]
    _check_call(call, tools)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    followup = ASK + [answer.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    final = client.chat.completions.create(model=MODEL, messages=followup, tools=tools, max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered back


@pytest.mark.integration
def test_streamed_tool_call_equals_the_one_shot_call(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]


@pytest.mark.parametrize("proposal", [dict(num_draft_tokens=0), dict(num_draft_tokens=3, proposer="draft"),
                                      dict(proposer="lookup"), dict(proposer="suffix"), dict(tree="2,2,1")],
                         ids=str)
@pytest.mark.integration
def test_json_schema_response_is_valid_and_the_same_under_speculation(client, proposal):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answer = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format,
                                            max_tokens=80, temperature=0, extra_body=proposal, logprobs=True,
                                            top_logprobs=2)
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    base = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, max_tokens=80,
                                          temperature=0, extra_body=dict(num_draft_tokens=0), logprobs=True,
                                          top_logprobs=2)
    assert base.choices[0].message.content == text
    ours = [(t.token, round(t.logprob, 9)) for t in answer.choices[0].logprobs.content]
    assert ours == [(t.token, round(t.logprob, 9)) for t in base.choices[0].logprobs.content]
    assert "".join(t.token for t in answer.choices[0].logprobs.content) == text


@pytest.mark.integration
def test_json_object_grammar_and_completion_logprobs(client):
    obj = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0.8, seed=3)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    digits = client.completions.create(model=MODEL, prompt="n=", max_tokens=6, temperature=0,
                                       extra_body={"grammar": 'root ::= [0-9]+ "."'}, logprobs=2)
    choice = digits.choices[0]
    assert choice.text.rstrip(".").isdigit() and choice.logprobs.tokens
    assert len(choice.logprobs.top_logprobs[0]) == 2 and choice.logprobs.token_logprobs[0] <= 0


@pytest.mark.parametrize("body, field", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}),
     "response_format"),
    (dict(extra_body={"grammar": "root ::= ("}), "grammar"),
    (dict(extra_body={"json_schema": {"type": 3}}), "json_schema"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools.0.function.name"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(response_format={"type": "json_object"}, extra_body={"grammar": 'root ::= "a"'}), "grammar"),
])
@pytest.mark.integration
def test_bad_specs_are_400_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **body)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == field, error
    assert "Traceback" not in error["message"] and "\n" not in error["message"]


def test_python_api_chat_with_a_required_tool():
    from specdec.decoding.text.tools import TOOL_FORMATS, parse_tool_calls

    decoder = scripted_chat_decoder()
    result = decoder.chat(ASK, tools=[WEATHER], tool_choice="required", max_new_tokens=120, logprobs=1)
    content, calls = parse_tool_calls(result.text, TOOL_FORMATS[0])
    assert content is None and calls[0].name == "get_weather" and len(result.logprobs) == len(result.token_ids)
    _check_call(SimpleNamespace(type="function", id=calls[0].id, function=calls[0]), [WEATHER])
