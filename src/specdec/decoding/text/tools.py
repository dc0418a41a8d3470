"""Tool calls: the model family's call syntax as data, the grammar that forces a call, and the parsers.

A chat template with a tools section (rendered by chat.py exactly as transformers'
``apply_chat_template(..., tools=...)``) tells the model how to call a function; the model answers in
its family's syntax. ``TOOL_FORMATS`` holds one row per syntax: the markers around one call and the
JSON keys of the name and the arguments. A template is matched to the first row whose start marker it
contains. With ``tool_choice`` "required" or a named function, the output is constrained (decoding/
constraint.py) to one or more calls in that syntax whose arguments match the function's JSON schema.
``parse_tool_calls`` turns a finished answer into (content, calls); ``ToolCallStream`` does it for a
stream of text pieces (content deltas as they come, each call when its end marker arrives).
Boundary: text and JSON in, text and JSON out; no decoding here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specdec.decoding.constraint import Constraint

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class ToolFormat:
    family: str
    start: str  # the marker before one call
    end: str  # the marker after it
    name_key: str = "name"
    arguments_key: str = "arguments"
    separator: str = "\n"  # between consecutive calls, and inside the markers around the JSON
    # the family's models also answer a call without the markers: the whole answer one JSON object
    # {name, arguments} (or a list of them), bare or in a ```json fence, naming a given tool
    bare_json: bool = False


# One row per call syntax; a template uses the first row whose start marker it contains.
TOOL_FORMATS = (
    # Qwen2.5 / Qwen3 / Hermes-style: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    # (Qwen2.5-Coder often writes the call as a ```json block instead: bare_json)
    ToolFormat("qwen", "<tool_call>", "</tool_call>", bare_json=True),
)
_FENCE = re.compile(r"^```(?:json)?[ \t]*\n(.*)\n?```$", re.DOTALL)


class ToolError(ValueError):
    """A malformed tools / tool_choice specification (one line, naming the field)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_format_of(template_source: str) -> ToolFormat | None:
    """The call syntax the chat template teaches, or None (a template without tool calls)."""
    return next((row for row in TOOL_FORMATS if row.start in template_source), None)


def check_tools(tools) -> list:
    """OpenAI's ``tools``: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise ToolError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object")
    return tools


def chosen_tools(tools: list, tool_choice) -> tuple[list, bool]:
    """(the tools a call may use, whether a call is required) for OpenAI's ``tool_choice``:
    "auto" (default with tools), "none", "required", or {"type": "function", "function": {"name": ...}}."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("auto", "none"):
        return (tools if tool_choice == "auto" else []), False
    if not tools:
        raise ToolError("tool_choice needs tools: give the functions the model may call")
    if tool_choice == "required":
        return tools, True
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = [tool for tool in tools if tool["function"]["name"] == name]
        if not named:
            raise ToolError(f"tool_choice names function {name!r}, which is not in tools")
        return named, True
    raise ToolError("tool_choice must be \"auto\", \"none\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def call_schema(tool: dict, form: ToolFormat) -> dict:
    """The JSON schema of one call to ``tool`` in ``form``'s syntax (name first, then the arguments)."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object",
            "properties": {form.name_key: {"const": function["name"]}, form.arguments_key: parameters},
            "required": [form.name_key, form.arguments_key], "additionalProperties": False}


def tool_call_constraint(tools: list, form: ToolFormat, parallel: bool = True, codec=None) -> Constraint:
    """The output: one call (or several, ``parallel``) to one of ``tools``, arguments valid against its schema.
    A marker that is one token of the codec's vocabulary is required as that token (as the model writes it)."""
    from specdec.decoding.constraint import _JSON_OPTIONS

    schemas = [call_schema(tool, form) for tool in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": dict(_JSON_OPTIONS)}

    def marker(text):
        token_id = getattr(codec, "token_id", None)
        if token_id is not None and token_id(text) is not None:
            return text if text.startswith("<") and text.endswith(">") else json.dumps(text)
        return json.dumps(text)

    sep = json.dumps(form.separator)
    repeat = f' ({sep} call)*' if parallel else ""
    # a separator may follow the last call (a model writes it before deciding to stop or call again)
    lark = (f"start: call{repeat} {sep}?\n"
            f"call: {marker(form.start)} {sep} body {sep} {marker(form.end)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return Constraint.lark(lark)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_from_json(body, form: ToolFormat, names=None) -> ToolCall | None:
    if isinstance(body, str):
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
    else:
        value = body
    if not isinstance(value, dict) or not isinstance(value.get(form.name_key), str):
        return None
    if names is not None and (value[form.name_key] not in names or set(value) - {form.name_key, form.arguments_key}
                              or not isinstance(value.get(form.arguments_key, {}), (dict, str))):
        return None
    arguments = value.get(form.arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        text = arguments
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), value[form.name_key], text)


def bare_calls(text: str, form: ToolFormat, names) -> list:
    """The calls of an answer that is only JSON naming given tools (``form.bare_json``), else []."""
    if not form.bare_json or not names:
        return []
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1).strip() if fenced else body
    if not body.startswith(("{", "[")):
        return []
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_json(item, form, set(names)) for item in items]
    return calls if calls and all(calls) else []


def parse_tool_calls(text: str, form: ToolFormat, names=None) -> tuple[str | None, list]:
    """(the content outside the calls or None, the calls) of a finished answer. A block whose JSON does not
    parse stays in the content, as text. ``names``: the tools offered (for ``form.bare_json`` answers)."""
    bare = bare_calls(text, form, names) if form.start not in text else []
    if bare:
        return None, bare
    calls, content, rest = [], [], text
    while True:
        start = rest.find(form.start)
        if start < 0:
            content.append(rest)
            break
        end = rest.find(form.end, start + len(form.start))
        if end < 0:
            content.append(rest)
            break
        call = _call_from_json(rest[start + len(form.start):end].strip(), form)
        if call is None:
            content.append(rest[: end + len(form.end)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(form.end):]
    joined = "".join(content)
    if calls:
        joined = joined.strip()
    return (joined or None), calls


class ToolCallStream:
    """Text pieces in; (content delta, finished calls) out. Text that may begin a start marker is held back
    until it cannot; a call is reported when its end marker arrives."""

    def __init__(self, form: ToolFormat, names=None):
        self.form = form
        self.names = set(names) if names else None
        self.buffer = ""
        self.inside = False
        self.calls: list = []
        self._emitted_content = False
        # an answer that opens like JSON may be a bare call (form.bare_json): held whole until the end
        self._maybe_bare = bool(form.bare_json and self.names)

    def push(self, piece: str) -> tuple[str, list]:
        self.buffer += piece
        if self._maybe_bare:
            head = self.buffer.lstrip()
            if not head or any(opening.startswith(head[: len(opening)]) for opening in ("```json", "```\n", "{", "[")):
                return "", []  # still undecided, or JSON: the whole answer decides at the end
            self._maybe_bare = False
        content, finished = [], []
        while True:
            if self.inside:
                end = self.buffer.find(self.form.end)
                if end < 0:
                    break
                body = self.buffer[:end]
                self.buffer = self.buffer[end + len(self.form.end):]
                self.inside = False
                call = _call_from_json(body.strip(), self.form)
                if call is None:  # not a call after all: the text goes out as content
                    content.append(self.form.start + body + self.form.end)
                else:
                    self.calls.append(call)
                    finished.append(call)
                continue
            start = self.buffer.find(self.form.start)
            if start >= 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(self.form.start):]
                self.inside = True
                continue
            keep = _partial_marker(self.buffer, self.form.start)
            content.append(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return self._content("".join(content)), finished

    def finish(self) -> tuple[str, list]:
        """(the text still held as content: an unfinished call, a partial marker; the calls found now). A held
        answer that is a bare call (``form.bare_json``) is reported here."""
        content, finished = "", []
        if self._maybe_bare:
            self._maybe_bare = False
            held, self.buffer = self.buffer, ""
            calls = bare_calls(held, self.form, self.names) if self.form.start not in held else []
            if calls:
                self.calls.extend(calls)
                return "", calls
            content, finished = self.push(held)
        rest = (self.form.start if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return content + self._content(rest), finished

    def _content(self, text: str) -> str:
        if self.calls and not text.strip():  # whitespace between or after calls is not content
            return ""
        if not self._emitted_content:
            text = text.lstrip("\n") if self.calls else text
        if text:
            self._emitted_content = True
        return text


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def tool_messages(messages: list) -> list:
    """Messages as chat templates expect them: an assistant's ``tool_calls[i].function.arguments`` as an object
    (OpenAI carries it as JSON text; templates write it with ``tojson``), as vLLM passes them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    function = dict(call["function"])
                    if isinstance(function.get("arguments"), str):
                        try:
                            function["arguments"] = json.loads(function["arguments"])
                        except json.JSONDecodeError:
                            pass
                    call = {**call, "function": function}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
