"""A chat turn as a running job: the one path from a chat dialect's request to its queued job, and from the job's
items to text and tool calls.

OpenAI's chat completions, the Responses API and Anthropic's Messages each turn their body into a ``Conversation``
(OpenAI-style message dicts and function specs, the tool choice, the output's constraint) and their sampling
fields into a ``GenerationOptions`` builder; from there the prompt is rendered (``render``: the count-tokens
routes stop here), the job is queued (``start_chat``) and its answer is split into text and calls, whole
(``ChatRun.whole``) or as it streams (``ChatRun.events`` through a dialect's ``TurnWriter``). One path: the same
conversation gives the same tokens on every route. Boundary: no wire shapes (the dialects write them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request

from specdec.decoding.constraint import Constraint
from specdec.decoding.options import GenerationError, GenerationOptions
from specdec.decoding.text.tools import ToolCall
from specdec.serving.jobs import Done, Engine, Prepared
from specdec.serving.turns import ChatTurn, TurnOutput, chat_turn
from specdec.serving.wire import option_error


@dataclass
class Conversation:
    """A chat request in the form ``chat_turn`` takes, whatever dialect it came in."""
    messages: list  # OpenAI-style message dicts
    tools: list = field(default_factory=list)  # OpenAI function specs ({"type": "function", "function": {...}})
    tool_choice: object = None  # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    parallel: bool = True  # a required call may be several calls
    constraint: Constraint | None = None  # a grammar on the whole output (a required call cannot take one)
    text_format: Constraint | None = None  # the format of a text answer (set aside when a call is required)
    tools_field: str = "tools"  # the client's field a required call's grammar is blamed on
    continue_final: bool | None = None  # continue a final assistant message (None: when there is one)
    add_generation_prompt: bool = True  # end with the assistant's header (a conversation not continued)


def render(engine: Engine, conversation: Conversation, names: dict) -> ChatTurn:
    """The rendered turn; a refusal is a 400 naming the client's field (``names``: the dialect's table, to which
    ``constraint`` -> ``tools_field`` is added when the constraint is a required call's)."""
    try:
        turn = chat_turn(engine.decoder, conversation.messages, conversation.tools, conversation.tool_choice,
                         conversation.parallel, conversation.constraint, conversation.text_format,
                         conversation.continue_final, conversation.add_generation_prompt)
    except GenerationError as exc:
        raise option_error(exc, names) from None
    if turn.constraint is not None and all(turn.constraint is not given
                                           for given in (conversation.constraint, conversation.text_format)):
        names["constraint"] = conversation.tools_field
    return turn


class TurnWriter(Protocol):
    """A dialect's stream of one answer: lines for text outside calls, for each call, for the end, for a failure."""

    def text(self, text: str) -> list: ...

    def call(self, call: ToolCall) -> list: ...

    def end(self, done: Done) -> list: ...

    def failed(self, message: str, code: str | None) -> list: ...


@dataclass
class ChatRun:
    turn: ChatTurn
    prepared: Prepared
    job: object
    first: object  # the job's first item (the prefill is done: ``prepared.stats`` holds its counts)
    output: TurnOutput
    spans: list = field(default_factory=list)  # after ``whole``: the answer's text by token source (with sources)

    async def whole(self, engine: Engine, request: Request) -> tuple[str | None, list, Done]:
        """(the text outside calls, or None when there is only calls; the calls; the job's ``Done``)."""
        text, done, self.spans = await engine.collect(self.job, self.first, request)
        content, calls = self.output.parse(text)
        return content, calls, done

    async def events(self, engine: Engine, writer: TurnWriter, opening: list = (), progress_lines=None):
        """``opening`` lines, then the answer as ``writer``'s lines as the job streams (a piece's text first, then the
        calls it completed); ``progress_lines(report)``: the prefill's reports (a run started with ``progress``)."""

        def lines(text: str, calls: list) -> list:
            return writer.text(text) + [line for call in calls for line in writer.call(call)]

        def piece_lines(piece) -> list:
            return lines(*self.output.push(piece.text))

        def last_lines(done: Done) -> list:
            return lines(*self.output.finish()) + writer.end(done)

        for line in opening:
            yield line
        async for line in engine.events(self.job, self.first, piece_lines, last_lines, writer.failed, progress_lines):
            yield line


async def start_chat(engine: Engine, request: Request, names: dict, conversation: Conversation, budget: int | None,
                     options_of: Callable[..., GenerationOptions], sources: bool = False,
                     worker: int | None = None, progress: bool = False) -> ChatRun:
    """Render, validate and queue the turn. ``budget``: the client's token budget (None: the rest of the context);
    ``options_of(max_new, **more)``: the dialect's fields as ``GenerationOptions`` (``more``: the turn's stop ids
    and constraint); ``worker``: the one worker that must run it (llama-server's ``id_slot``; None: the pool's
    choice); ``progress``: the prefill's reports come first (a streamed answer's ``prompt_progress``)."""
    turn = render(engine, conversation, names)
    max_new = budget if budget is not None else engine.open_budget(turn.ids)
    options = options_of(max_new, stop_token_ids=turn.stop_token_ids, constraint=turn.constraint)
    prepared = engine.prepare(turn.ids, options, names, budget is not None, sources=sources, worker=worker,
                              progress=progress)
    job, first = await engine.start(prepared, request, names)
    return ChatRun(turn, prepared, job, first, turn.output())
