"""The OpenAI Responses API: ``POST /v1/responses`` and ``POST /v1/responses/input_tokens`` (each also without
``/v1``), what the ``openai`` SDK's ``client.responses`` and the OpenAI Agents SDK call.

A body's ``instructions`` and ``input`` items (messages, ``function_call``, ``function_call_output``), with the
stored conversation a ``previous_response_id`` names before them, become OpenAI-style chat messages
(``chat_messages``: an assistant's calls are merged into its message, results are ``role: "tool"``); its
function ``tools``, ``tool_choice`` and ``text.format`` a ``Conversation`` (serving/chat_run.py), the one path
every chat dialect shares. The answer is a Response object (``output``: a message item with ``output_text``, then
one ``function_call`` item per call; ``usage`` with cached and reasoning token details; ``status`` "incomplete"
when ``max_output_tokens`` cut it, as the API), or with ``stream: true`` the API's typed events
(``response.created`` ... ``response.completed`` / ``response.incomplete``, each with ``event:`` lines and a
``sequence_number``). Finished responses are kept, without their instructions, in a ``ResponseStore`` bounded by
count and bytes (the oldest dropped first) for ``previous_response_id``. Errors are OpenAI-shaped (wire.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.decoding.options import GenerationError
from specdec.decoding.text.tools import ToolCall
from specdec.serving.answers import prompt_progress, specdec_fields, timings, timings_of
from specdec.serving.chat_run import Conversation, render, start_chat
from specdec.serving.dialects.responses_models import (ConversationFields, FunctionCallItem, FunctionCallOutputItem,
                                                       InputMessage, InputTokensRequest, NamedFunction,
                                                       ResponsesRequest)
from specdec.serving.jobs import Done, Engine
from specdec.serving.turns import output_constraint
from specdec.serving.wire import APIError, generation_options, option_error, sse

RANK = 20  # where this dialect mounts among the others (serving/dialects/__init__.py)

# decoder option -> the Responses field that carries it
NAMES = {"max_new_tokens": "max_output_tokens", "prompt": "input", "messages": "input", "constraint": "text.format"}
STORE_ENTRIES = 1024  # responses kept for previous_response_id
STORE_BYTES = 64 * 2**20  # their conversations' JSON, in bytes


class ResponseStore:
    """Finished responses' conversations (OpenAI-style messages without the instructions, which the API does not
    carry over), by response id: at most ``max_entries`` of them and ``max_bytes`` of their JSON, the oldest
    dropped first. A conversation larger than ``max_bytes`` alone is not kept."""

    def __init__(self, max_entries: int = STORE_ENTRIES, max_bytes: int = STORE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict = OrderedDict()  # id -> the conversation's JSON text
        self.bytes = 0

    def put(self, ident: str, messages: list) -> None:
        text = json.dumps(messages, separators=(",", ":"))
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:
            return
        self.entries[ident] = text
        self.bytes += size
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= len(dropped.encode("utf-8"))

    def get(self, ident: str) -> list | None:
        text = self.entries.get(ident)
        return None if text is None else json.loads(text)


def chat_messages(items: list, history: list = ()) -> list:
    """``history`` (stored messages) then the input ``items`` as OpenAI-style chat messages: a message item keeps its
    role (``developer`` is the templates' ``system``) and content; a ``function_call`` joins the assistant message
    just before it (or opens one) as a ``tool_calls`` entry; a ``function_call_output`` is a ``role: "tool"``
    message answering its call."""
    messages = [dict(message) for message in history]
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", ()), call]
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
    return messages


def _text(content) -> str | list:
    """String content as it is; parts as chat text parts (the template's renderer joins them)."""
    return content if isinstance(content, str) else [{"type": "text", "text": part.text} for part in content]


def assistant_message(content: str | None, calls: list) -> dict:
    """An answer as the chat message a next turn renders (what the store keeps)."""
    message = {"role": "assistant"}
    if content is not None:
        message["content"] = content
    if calls:
        message["tool_calls"] = [call.as_openai() for call in calls]
    return message


def usage(done: Done) -> dict:
    stats = done.stats
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": stats.new_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(ident: str, text: str | None, status: str) -> dict:
    """A message output item (``text`` None: just opened, no content part yet)."""
    return {"id": ident, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(call: ToolCall, arguments: str | None = None, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call.id, "name": call.name, "arguments": call.arguments if arguments is None else arguments}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Responses:
    """``POST /v1/responses``, ``POST /v1/responses/input_tokens``."""

    def __init__(self, engine: Engine, server, store: ResponseStore | None = None):
        self.engine, self.server = engine, server
        self.store = store if store is not None else ResponseStore()

    def conversation(self, body: ConversationFields, names: dict) -> tuple[Conversation, list]:
        """(what the turn renders, the conversation to store: the same messages without the instructions)."""
        history = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id)
            if history is None:
                raise APIError(400, f"previous_response_id: no stored response {body.previous_response_id!r} "
                                    "(unknown, dropped from the bounded store, or created with store: false)",
                               param="previous_response_id")
        items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input or []
        messages = chat_messages(items, history)
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                 for tool in body.tools or []]
        choice = body.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        parallel = body.parallel_tool_calls is not False
        return Conversation(system + messages, tools, choice, parallel, None, self.text_format(body, names)), messages

    @staticmethod
    def text_format(body: ConversationFields, names: dict):
        form = body.text.format if body.text is not None else None
        if form is None or form.type == "text":
            return None
        try:
            return output_constraint(form.type, getattr(form, "schema_", None), field="text.format")
        except GenerationError as exc:
            raise option_error(exc, names) from None

    async def count(self, body: InputTokensRequest):
        if body.model is not None:
            self.server.known_model(body.model)
        names = dict(NAMES)
        conversation, _ = self.conversation(body, names)
        return {"object": "response.input_tokens", "input_tokens": len(render(self.engine, conversation, names).ids)}

    async def create(self, body: ResponsesRequest, request: Request):
        model = self.server.answer_model(body.model)
        engine, names = self.engine, dict(NAMES)
        conversation, messages = self.conversation(body, names)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        run = await start_chat(engine, request, names, conversation, body.max_output_tokens,
                               partial(generation_options, body, names, temperature=temperature, top_p=top_p),
                               progress=bool(body.stream) and body.return_progress)
        answer = Answer(body, model, temperature, top_p, conversation.parallel)

        def keep(content: str | None, calls: list) -> None:
            if body.store is not False:
                self.store.put(answer.ident, messages + [assistant_message(content, calls)])

        if body.stream:
            writer = ResponseEvents(answer, keep, run.prepared.stats if body.timings_per_token else None)
            return StreamingResponse(run.events(engine, writer, writer.start(), writer.progress),
                                     media_type="text/event-stream")
        content, calls, done = await run.whole(engine, request)
        keep(content, calls)
        status = "incomplete" if done.finish == "length" else "completed"
        output = [] if content is None else [message_item(new_id("msg"), content, status)]
        return answer.response(status, output + [call_item(call) for call in calls], done)


class Answer:
    """The Response object of one request, in any of its states."""

    def __init__(self, body: ResponsesRequest, model: str, temperature: float, top_p: float, parallel: bool):
        self.body, self.model, self.temperature, self.top_p, self.parallel = body, model, temperature, top_p, parallel
        self.ident, self.created = new_id("resp"), int(time.time())

    def response(self, status: str, output: list, done: Done | None = None, error: dict | None = None) -> dict:
        body = self.body
        form = body.text.format if body.text is not None and body.text.format is not None else None
        out = {"id": self.ident, "object": "response", "created_at": self.created, "status": status,
               "background": False, "error": error,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
               "metadata": body.metadata or {}, "model": self.model, "output": output,
               "parallel_tool_calls": self.parallel, "previous_response_id": body.previous_response_id,
               "reasoning": {"effort": None, "summary": None}, "store": body.store is not False,
               "temperature": self.temperature,
               "text": {"format": form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}},
               "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
                               else body.tool_choice or "auto"),
               "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []], "top_p": self.top_p,
               "truncation": body.truncation or "disabled", "usage": None, "user": body.user}
        if done is not None:
            out["usage"] = usage(done)
            out["specdec"] = {**specdec_fields(done), "ignored_fields": body.ignored_fields}
        return out


class ResponseEvents:
    """The Responses API's stream of one answer (a ``TurnWriter``): typed events with ``event:`` lines and a running
    ``sequence_number``; a message item opens at the first text, each call is its own item."""

    def __init__(self, answer: Answer, keep, stats=None):
        self.answer, self.keep = answer, keep
        self.stats = stats  # the request's running GenerationStats: each text delta carries its timings so far
        self.sequence = 0
        self.items: list = []  # finished output items
        self.message: dict | None = None  # the open message item: {"id", "index", "text"}
        self.calls: list = []

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(payload, event=kind)

    def start(self) -> list:
        opening = self.answer.response("in_progress", [])
        return [self.event("response.created", response=opening), self.event("response.in_progress", response=opening)]

    def progress(self, report) -> list:
        """llama-server's: the prompt's reading, as another ``response.in_progress`` event."""
        return [self.event("response.in_progress", response=self.answer.response("in_progress", []),
                           prompt_progress=prompt_progress(report))]

    def text(self, text: str) -> list:
        lines = [] if text == "" or self.message is not None else self.open_message()
        if text:
            self.message["text"] += text
            timing = {} if self.stats is None else {"timings": timings_of(self.stats)}
            lines.append(self.event("response.output_text.delta", item_id=self.message["id"], logprobs=[],
                                    output_index=self.message["index"], content_index=0, delta=text, **timing))
        return lines

    def open_message(self) -> list:
        self.message = {"id": new_id("msg"), "index": len(self.items), "text": ""}
        ident, index = self.message["id"], self.message["index"]
        return [self.event("response.output_item.added", output_index=index,
                           item=message_item(ident, None, "in_progress")),
                self.event("response.content_part.added", item_id=ident, output_index=index, content_index=0,
                           part=text_part(""))]

    def close_message(self, status: str = "completed") -> list:
        if self.message is None:
            return []
        ident, index, text = self.message["id"], self.message["index"], self.message["text"]
        item = message_item(ident, text, status)
        self.items.append(item)
        self.message = None
        return [self.event("response.output_text.done", item_id=ident, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=ident, output_index=index, content_index=0,
                           part=text_part(text)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: ToolCall) -> list:
        lines = self.close_message()
        index, item = len(self.items), call_item(call)
        self.items.append(item)
        self.calls.append(call)
        return lines + [
            self.event("response.output_item.added", output_index=index,
                       item=call_item(call, arguments="", status="in_progress")),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=call.arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item)]

    def end(self, done: Done) -> list:
        status = "incomplete" if done.finish == "length" else "completed"
        lines = [] if self.items or self.message is not None else self.open_message()  # an empty answer: one message
        lines += self.close_message(status)
        text = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")
        self.keep(text if text or not self.calls else None, self.calls)  # as a whole answer's (content, calls)
        return lines + [self.event(f"response.{status}", response=self.answer.response(status, self.items, done),
                                   timings=timings(done))]  # llama-server's, on its last event

    def failed(self, message: str, code: str | None) -> list:
        """A failure after the stream started: the API's ``error`` event, then ``response.failed``."""
        lines = self.close_message("incomplete")
        error = {"code": code or "server_error", "message": message}
        return lines + [self.event("error", code=code or "server_error", message=message, param=None),
                        self.event("response.failed", response=self.answer.response("failed", self.items, error=error))]


def mount(app, engine: Engine, server) -> None:
    responses = Responses(engine, server)
    for prefix in ("/v1", ""):  # as the chat routes: also without the prefix
        app.add_api_route(f"{prefix}/responses", responses.create, methods=["POST"])
        app.add_api_route(f"{prefix}/responses/input_tokens", responses.count, methods=["POST"])
