"""A chat turn, whatever dialect asked for it: the rendered prompt, the tools it may call, the constraint a
required call puts on the output, and the split of the answer into text and tool calls.

Every chat dialect (OpenAI chat completions, the Responses API, Anthropic Messages) first turns its own
messages and tools into OpenAI-style dicts (what the chat template renders, decoding/text/chat.py); from there
``chat_turn`` is one code path. Failures are ``GenerationError``s naming the neutral field (``messages``,
``tools``, ``tool_choice``, ``constraint``) for the dialect to rename. Boundary: no HTTP, no wire shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.decoding.text.chat import ChatTemplateError, chat_prompt, chat_template_of
from specdec.decoding.constraint import Constraint, ConstraintError
from specdec.decoding.options import GenerationError
from specdec.decoding.text.tools import (TOOL_FORMATS, ToolCallStream, ToolError, chosen_tools, parse_tool_calls,
                                    tool_call_constraint, tool_format_of)


@dataclass(frozen=True)
class ChatTurn:
    ids: list  # the rendered conversation's token ids
    stop_token_ids: tuple  # the template's end of turn
    form: object = None  # the template's tool-call syntax (decoding/text/tools.py), when a tool may be called
    names: tuple = ()  # the callable tools' names
    constraint: Constraint | None = None  # the grammar of a required call

    def output(self) -> "TurnOutput":
        return TurnOutput(self.form, list(self.names))


def chat_turn(decoder, messages: list, tools: list | None = None, tool_choice=None, parallel: bool = True,
              constraint: Constraint | None = None, text_format: Constraint | None = None,
              continue_final: bool | None = None, add_generation_prompt: bool = True) -> ChatTurn:
    """Render ``messages`` (OpenAI-style dicts) and ``tools`` (OpenAI function specs) with the bundle's template;
    ``tool_choice``: "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}. A required
    call constrains the output to calls. ``text_format`` (an output format: OpenAI's ``response_format``, the
    Responses API's ``text.format``, Anthropic's ``output_config.format``) is the format of a text answer: a turn
    whose call is required has none, so it is set aside then (an agent sends its final answer's format on every
    turn). ``constraint`` (a grammar) constrains the whole output: a required call cannot be combined with it.
    At most one of the two is given. ``continue_final``: continue a final assistant message (None: when there is
    one, as llama-server and Anthropic's API do; decoding/text/chat.py's ``chat_prompt``)."""
    tools = list(tools or [])
    try:
        usable, required = chosen_tools(tools, tool_choice)
    except ToolError as exc:
        raise GenerationError(str(exc), "tool_choice", _after_name(str(exc), "tool_choice")) from None
    try:
        prompt = chat_prompt(decoder, messages, add_generation_prompt, tools=tools or None,
                             continue_final_message=continue_final)
        form = tool_format_of(chat_template_of(decoder).source) if usable else None
    except ChatTemplateError as exc:
        raise GenerationError(str(exc), "messages", f"cannot be rendered: {exc}") from None
    if required:
        if form is None:
            known = ", ".join(row.family for row in TOOL_FORMATS)
            raise GenerationError.bad("tool_choice", f"cannot require a call: this model's chat template has no "
                                                     f"tool-call syntax specdec knows (known: {known})")
        if constraint is not None:
            raise GenerationError.bad("tool_choice", "cannot require a call together with a grammar")
        constraint = tool_call_constraint(usable, form, parallel, decoder.codec)
    elif text_format is not None:
        constraint = text_format
    names = tuple(tool["function"]["name"] for tool in usable)
    return ChatTurn(prompt.ids, tuple(prompt.stop_token_ids), form, names, constraint)


def _after_name(message: str, name: str) -> str:
    return message[len(name):].lstrip(": ") if message.startswith(name) else message


class TurnOutput:
    """The answer split into text and tool calls: as it streams (``push`` / ``finish``) or whole (``parse``)."""

    def __init__(self, form, names: list):
        self.form, self.names = form, names
        self.stream = ToolCallStream(form, names) if form is not None else None

    @property
    def calls(self) -> list:
        return self.stream.calls if self.stream is not None else []

    def push(self, text: str) -> tuple[str, list]:
        """(text to show now, calls completed by this piece)."""
        return self.stream.push(text) if self.stream is not None else (text, [])

    def finish(self) -> tuple[str, list]:
        return self.stream.finish() if self.stream is not None else ("", [])

    def parse(self, text: str) -> tuple[str | None, list]:
        """(content, calls) of a whole answer."""
        return parse_tool_calls(text, self.form, self.names) if self.form is not None else (text, [])


def output_constraint(kind: str, schema=None, grammar: str | None = None, field: str = "response_format"):
    """The constraint of an output format: "json_object" (any object, or ``schema`` when given), "json_schema"
    (``schema``), "grammar" (GBNF); "text" / None: none. A schema or grammar that does not compile is a
    GenerationError naming ``field``."""
    try:
        if kind in (None, "text"):
            return None
        if kind == "grammar":
            return Constraint.gbnf(grammar)
        if kind == "json_object" and schema is None:
            return Constraint.json_object()
        return Constraint.json_schema(schema if schema is not None else {})
    except ConstraintError as exc:
        raise GenerationError(f"{field}: {exc}", field, f"is not usable: {exc}") from None
