"""Tool calls: template rendering (== transformers), the call syntax table, parsing finished and streamed answers."""

import json

import pytest

from specdec.decoding.text.chat import render_chat
from specdec.decoding.text.tools import (TOOL_FORMATS, ToolCallStream, ToolError, check_tools, chosen_tools,
                                    parse_tool_calls, tool_format_of, tool_messages)
from paths import DATA

QWEN_TEMPLATE = (DATA / "qwen2.5_chat_template.jinja").read_text()
QWEN = TOOL_FORMATS[0]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


@pytest.mark.parametrize("messages", [CONVERSATION[:2], CONVERSATION, CONVERSATION[1:]], ids=["ask", "round-trip", "no-system"])
@pytest.mark.parametrize("tools", [[WEATHER], [WEATHER, TIME], None], ids=["one", "two", "none"])
def test_rendering_with_tools_equals_transformers(messages, tools):
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    # transformers expects arguments as objects; OpenAI clients send JSON text (converted as vLLM does)
    expected = tokenizer.apply_chat_template(tool_messages(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    assert render_chat(QWEN_TEMPLATE, messages, tools=tools) == expected
    if tools:
        assert "<tools>" in expected and json.dumps(tools[0], ensure_ascii=False) in expected


def test_template_selects_the_call_syntax():
    assert tool_format_of(QWEN_TEMPLATE) is QWEN
    assert tool_format_of("{{ messages }}") is None


def test_parse_finished_answers():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, QWEN)
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].as_openai()["type"] == "function" and calls[0].id.startswith("call_")
    two = "Checking.\n" + text + "\n" + text.replace("Paris", "Rome")
    content, calls = parse_tool_calls(two, QWEN)
    assert content == "Checking." and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken, QWEN) == (broken, [])
    assert parse_tool_calls("plain answer", QWEN) == ("plain answer", [])
    assert parse_tool_calls("<tool_call>\n{\"name\": \"f\"", QWEN)[1] == []  # unfinished: content


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 13])
def test_streamed_calls_equal_parsed_calls_at_any_piece_boundary(cut):
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    stream = ToolCallStream(QWEN)
    content, calls = "", []
    for start in range(0, len(text), cut):
        piece, finished = stream.push(text[start:start + cut])
        assert "<" not in piece  # no marker text leaks into content
        content += piece
        calls += finished
    rest, finished = stream.finish()
    content += rest
    calls += finished
    expected_content, expected_calls = parse_tool_calls(text, QWEN)
    assert content.strip() == expected_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]


def test_stream_without_calls_is_the_text():
    stream = ToolCallStream(QWEN)
    out = "".join(stream.push(p)[0] for p in ["a <", "tool", " b", " <tool_c", "x"]) + stream.finish()[0]
    assert out == "a <tool b <tool_cx"


BARE = ['```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]\n```']


@pytest.mark.parametrize("text", BARE)
def test_a_bare_json_call_naming_a_given_tool_is_a_call(text):
    names = ["get_weather", "get_time"]
    content, calls = parse_tool_calls(text, QWEN, names)
    assert content is None and calls and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    stream = ToolCallStream(QWEN, names)
    assert all(stream.push(text[i:i + 4]) == ("", []) for i in range(0, len(text), 4))  # held: JSON may be a call
    rest, finished = stream.finish()
    assert rest == "" and [(c.name, c.arguments) for c in finished] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text, names", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None),  # no tools offered
    ('{"name": "other", "arguments": {}}', ["get_weather"]),  # not a given tool
    ('{"name": "get_weather", "arguments": {}, "x": 1}', ["get_weather"]),  # not the call shape
    ('Here: {"name": "get_weather", "arguments": {}}', ["get_weather"]),  # not the whole answer
    ('```python\nprint(1)\n```', ["get_weather"]),
])
def test_other_json_is_content(text, names):
    assert parse_tool_calls(text, QWEN, names) == (text, [])
    stream = ToolCallStream(QWEN, names)
    streamed = "".join(stream.push(text[i:i + 3])[0] for i in range(0, len(text), 3))
    rest, finished = stream.finish()
    assert streamed + rest == text and finished == []


def test_tool_specs_and_choices_are_checked():
    assert check_tools([WEATHER]) == [WEATHER]
    for bad, match in [([{"type": "function"}], r"tools\[0\] must be"),
                       ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name"),
                       ([WEATHER, WEATHER], "given twice"),
                       ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters")]:
        with pytest.raises(ToolError, match=match):
            check_tools(bad)
    assert chosen_tools([WEATHER], None) == ([WEATHER], False)
    assert chosen_tools([WEATHER], "none") == ([], False)
    assert chosen_tools([WEATHER, TIME], "required") == ([WEATHER, TIME], True)
    assert chosen_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}) == ([TIME], True)
    with pytest.raises(ToolError, match="not in tools"):
        chosen_tools([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolError, match="needs tools"):
        chosen_tools([], "required")
