"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, what the ``anthropic`` SDK
and Claude-Code-style agents call (their base URL is the server's root: the SDK appends ``/v1/messages``).

The ``system`` prompt and ``messages`` become OpenAI-style chat messages (``chat_messages``: ``tool_use`` blocks an
assistant message's ``tool_calls``, ``tool_result`` blocks ``role: "tool"`` messages), ``tools`` function specs
(``input_schema`` their parameters), ``tool_choice`` OpenAI's (any: required, tool: a named function); from there
the turn runs on the path every chat dialect shares (serving/chat_run.py). The answer is a ``message`` with
``text`` and ``tool_use`` blocks, ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with the
sequence that matched, ``tool_use``) and ``usage`` (``input_tokens``: prompt tokens not read from the cache,
``cache_read_input_tokens``: those read from it); with ``stream: true``, the API's named events (``message_start``
... ``message_stop``; a failure after the start is an ``error`` event). Every error on these paths, validation
errors included, has Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, ``owns_errors``).
The headers the SDK sends (``x-api-key``, ``Authorization``, ``anthropic-version``, ``anthropic-beta``) are
accepted and not checked: the server has no authentication.
"""

from __future__ import annotations

import json
import uuid
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from specdec.decoding.options import GenerationError
from specdec.decoding.text.tools import ToolCall
from specdec.serving.answers import specdec_fields
from specdec.serving.chat_run import Conversation, render, start_chat
from specdec.serving.dialects.anthropic_models import (ChooseAny, ChooseAuto, ChooseNone, CountTokensRequest,
                                                       MessagesRequest, RedactedThinkingBlock, TextBlock,
                                                       ThinkingBlock, ToolResultBlock, ToolUseBlock)
from specdec.serving.jobs import Done, Engine
from specdec.serving.turns import output_constraint
from specdec.serving.wire import APIError, generation_options, option_error, sse

RANK = 30  # where this dialect mounts among the others (serving/dialects/__init__.py)

PATH = "/v1/messages"
# decoder option -> the Messages field that carries it
NAMES = {"max_new_tokens": "max_tokens", "prompt": "messages", "messages": "messages", "stop": "stop_sequences",
         "constraint": "output_config.format"}
# HTTP status -> Anthropic's error type (any other 4xx: invalid_request_error; 5xx: api_error)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def owns_errors(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None, extra=None):
    """Anthropic's error shape; the field at fault is named in the message (the shape has no ``param``, nor room for
    ``extra``)."""
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _parts(content) -> str | list:
    """String content as it is; text blocks as chat text parts (the template's renderer joins them)."""
    return content if isinstance(content, str) else [{"type": "text", "text": block.text} for block in content]


def chat_messages(system, messages: list) -> list:
    """``system`` and ``messages`` as OpenAI-style chat messages: an assistant's ``tool_use`` blocks are its message's
    ``tool_calls`` (the input as JSON text); each ``tool_result`` block is a ``role: "tool"`` message answering its
    call, in the order the blocks come (text blocks around them stay the user's messages, in order). A conversation
    ending with an assistant message asks the model to continue it (prefill): the answer continues that text."""
    out = [] if system is None else [{"role": "system", "content": _parts(system)}]
    for position, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        thinking = (ThinkingBlock, RedactedThinkingBlock)
        misplaced = {"assistant": ToolResultBlock, "user": (ToolUseBlock, *thinking)}.get(
            message.role, (ToolUseBlock, ToolResultBlock, *thinking))
        for index, block in enumerate(message.content):
            if isinstance(block, misplaced):
                field = f"messages.{position}.content.{index}"
                raise APIError(400, f"{field}: a {block.type} block cannot be in a {message.role} message",
                               param=field)
        if message.role == "assistant":
            out.append(_assistant(message.content))
            continue
        texts: list = []
        for block in message.content:
            if isinstance(block, TextBlock):
                texts.append({"type": "text", "text": block.text})
                continue
            if texts:
                out.append({"role": message.role, "content": texts})
                texts = []
            result = [] if block.content is None else _parts(block.content)
            result = [{"type": "text", "text": result}] if isinstance(result, str) else result
            if block.is_error:  # the template has no flag for it: the model reads it
                result = [{"type": "text", "text": "Error: "}, *result]
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        if texts or not message.content:
            out.append({"role": message.role, "content": texts})
    return out


def _assistant(blocks: list) -> dict:
    message = {"role": "assistant"}
    texts = [{"type": "text", "text": block.text} for block in blocks if isinstance(block, TextBlock)]
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    reasoning = "\n\n".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    message["content"] = texts  # [] with calls only: "" to templates that read it unchecked (Qwen3's)
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def tool_choice_of(choice) -> tuple[object, bool]:
    """(OpenAI's tool_choice, whether a required call may be several) for Anthropic's ``tool_choice``."""
    if choice is None:
        return None, True
    if isinstance(choice, ChooseNone):
        return "none", True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ChooseAuto):
        return "auto", parallel
    if isinstance(choice, ChooseAny):
        return "required", parallel
    return {"type": "function", "function": {"name": choice.name}}, parallel


def usage(stats) -> dict:
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "output_tokens": stats.new_tokens,
            "cache_read_input_tokens": stats.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(done: Done, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if done.finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    return "end_turn", None


def tool_use_block(call: ToolCall, streamed: bool = False) -> dict:
    """A call as a ``tool_use`` block (``streamed``: the opening block, whose input comes as JSON deltas)."""
    if streamed:
        arguments = {}
    else:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:  # a model's own string, kept as it wrote it
            arguments = call.arguments
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": arguments}


class Messages:
    """``POST /v1/messages``, ``POST /v1/messages/count_tokens``."""

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    def conversation(self, body: CountTokensRequest, names: dict) -> Conversation:
        tools = [{"type": "function", "function": {"name": tool.name, **({"description": tool.description}
                                                                         if tool.description is not None else {}),
                                                   "parameters": tool.input_schema}} for tool in body.tools or []]
        choice, parallel = tool_choice_of(body.tool_choice)
        text_format = None
        if body.output_config is not None and body.output_config.format is not None:
            try:
                text_format = output_constraint("json_schema", body.output_config.format.schema_,
                                                field="output_config.format")
            except GenerationError as exc:
                raise option_error(exc, names) from None
        return Conversation(chat_messages(body.system, body.messages), tools, choice, parallel, None, text_format)

    async def count(self, body: CountTokensRequest):
        self.server.answer_model(body.model)
        names = dict(NAMES)
        return {"input_tokens": len(render(self.engine, self.conversation(body, names), names).ids)}

    async def create(self, body: MessagesRequest, request: Request):
        model = self.server.answer_model(body.model)
        engine, names = self.engine, dict(NAMES)
        options_of = partial(generation_options, body, names, temperature=1.0 if body.temperature is None else
                             body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
                             top_k=body.top_k or 0, stop=body.stop_sequences or ())
        run = await start_chat(engine, request, names, self.conversation(body, names), body.max_tokens, options_of)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "stop_sequence": None}
        if body.stream:
            writer = MessageEvents(message, usage(run.prepared.stats), body.ignored_fields)
            return StreamingResponse(run.events(engine, writer, writer.start()), media_type="text/event-stream")
        content, calls, done = await run.whole(engine, request)
        reason, sequence = stop_reason(done, bool(calls))
        blocks = [{"type": "text", "text": content}] if content else []
        return {**message, "content": blocks + [tool_use_block(call) for call in calls], "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage(done.stats),
                "specdec": {**specdec_fields(done), "ignored_fields": body.ignored_fields}}


class MessageEvents:
    """Anthropic's stream of one answer (a ``TurnWriter``): named events; a text block opens at the first text, each
    call is a ``tool_use`` block whose input comes as one ``input_json_delta``."""

    def __init__(self, message: dict, opening_usage: dict, ignored: list):
        self.message, self.opening_usage, self.ignored = message, opening_usage, ignored
        self.blocks = 0  # blocks opened so far (the next one's index)
        self.open = False  # a text block is open
        self.called = False

    @staticmethod
    def event(kind: str, **fields) -> str:
        return sse({"type": kind, **fields}, event=kind)

    def start(self) -> list:
        opening = {**self.message, "usage": {**self.opening_usage, "output_tokens": 0}}
        return [self.event("message_start", message=opening), self.event("ping")]

    def close(self) -> list:
        if not self.open:
            return []
        self.open = False
        return [self.event("content_block_stop", index=self.blocks - 1)]

    def text(self, text: str) -> list:
        if not text:
            return []
        lines = []
        if not self.open:
            lines.append(self.event("content_block_start", index=self.blocks, content_block={"type": "text",
                                                                                            "text": ""}))
            self.blocks, self.open = self.blocks + 1, True
        return lines + [self.event("content_block_delta", index=self.blocks - 1,
                                   delta={"type": "text_delta", "text": text})]

    def call(self, call: ToolCall) -> list:
        lines, index = self.close(), self.blocks
        self.blocks, self.called = self.blocks + 1, True
        return lines + [
            self.event("content_block_start", index=index, content_block=tool_use_block(call, streamed=True)),
            self.event("content_block_delta", index=index,
                       delta={"type": "input_json_delta", "partial_json": call.arguments}),
            self.event("content_block_stop", index=index)]

    def end(self, done: Done) -> list:
        reason, sequence = stop_reason(done, self.called)
        return self.close() + [
            self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                       usage=usage(done.stats), specdec={**specdec_fields(done), "ignored_fields": self.ignored}),
            self.event("message_stop")]

    def failed(self, message: str, code: str | None) -> list:
        kind = "overloaded_error" if code == "shutting_down" else "api_error"
        return [sse({"type": "error", "error": {"type": kind, "message": message}}, event="error")]


def mount(app, engine: Engine, server) -> None:
    messages = Messages(engine, server)
    app.add_api_route(PATH, messages.create, methods=["POST"])
    app.add_api_route(f"{PATH}/count_tokens", messages.count, methods=["POST"])
