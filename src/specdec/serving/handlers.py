"""The route handlers: one class per route family, over a DecoderPool.

``Generation`` is what every generating route shares: a request body becomes decoder options, checked
once by the decoder's own ``validate`` (``make_request``: the same checks the worker's ``stream`` makes,
a ``GenerationError`` becoming a 400 naming the wire field); the job is queued on the pool; its items
come back as one JSON answer or as server-sent events, and a client that goes away cancels it.
``Completions`` and ``Chat`` are the two OpenAI routes on top; ``Infill`` is llama-server's ``/infill``
(fill-in-the-middle, which ``/v1/completions`` with a ``suffix`` also reaches); ``Info`` answers
``/v1/models``, ``/health`` and ``/metrics``. Every job names its prompt's token ids, so the pool gives it to
the worker whose KV cache holds the most of them; ``usage.prompt_tokens_details.cached_tokens`` says how many
were reused. Boundary: HTTP <-> pool jobs; the wire shapes are protocol.py's, decoding is the decoder's,
chat rendering is chat.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from specdec.decoding.chat import ChatTemplateError, chat_prompt, chat_template_of
from specdec.decoding.constraint import Constraint, ConstraintError
from specdec.decoding.infill import fim_stop_ids, fim_tokens
from specdec.decoding.request import GenerationStats
from specdec.sampling.processors import SamplingConfig
from specdec.serving.metrics import Metrics
from specdec.serving.pool import END, DecoderPool, JobCancelled, PoolBusy, PoolClosed
from specdec.decoding.tools import (TOOL_FORMATS, ToolCallStream, ToolError, chosen_tools, parse_tool_calls,
                                    tool_call_constraint, tool_format_of)
from specdec.serving.protocol import (APIError, ChatCompletionRequest, ChatMessage, ClientGone, CompletionRequest,
                                      InfillRequest, NamedToolChoice, decoder_error)

log = logging.getLogger(__name__)

DRAFT_ROOM = 64  # context slots kept free for one round's drafts when max_tokens is left to the server
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_SECONDS = 0.25

INFILL_RESERVE = 256  # tokens an /infill with n_predict=-1 keeps free for the middle (at most a quarter of the context)

# decoder argument -> the request field that carries it (for the decoder's error messages)
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}
OPENAI_INFILL_NAMES = {"max_new_tokens": "max_tokens", "prefix": "prompt"}  # /v1/completions with a suffix
LLAMA_NAMES = {"max_new_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "prefix": "input_prefix",
               "suffix": "input_suffix", "extra": "input_extra"}


@dataclass
class Prepared:
    """A validated request: the prompt's token ids and the decoder's ``stream`` keyword arguments."""
    prompt_ids: list
    options: dict = field(default_factory=dict)
    time_limit: float = 0.0  # seconds after the first token; stops at the next newline past it (0: none)


@dataclass
class Piece:
    """A text piece with the logprobs of the tokens committed since the previous piece (with logprobs)."""
    text: str
    logprobs: list


@dataclass
class Done:
    """The last item of a job: the request's statistics and the decoder's finish reason."""
    stats: GenerationStats
    queue_seconds: float
    finish: str = "length"  # the decoder's reason: "eos" | "stop" | "length"; or "time" (the time limit)
    last_token: int | None = None
    logprobs: list | None = None  # with logprobs: the entries no Piece carried (the end token's excluded)


def piece_text(item) -> str:
    return item.text if isinstance(item, Piece) else item


def finish_reason(done: Done) -> str:
    """OpenAI's "stop" (EOS, end of turn, stop string) or "length"."""
    return "length" if done.finish == "length" else "stop"


def specdec_fields(done: Done) -> dict:
    stats = done.stats
    return {"cached_tokens": cached_tokens(stats), "acceptance_rate": round(stats.acceptance_rate, 4),
            "proposed_tokens": stats.proposed,
            "accepted_tokens": stats.accepted, "rounds": stats.rounds,
            "tokens_per_second": round(stats.tokens_per_s, 2), "prefill_seconds": round(stats.prefill_seconds, 4),
            "decode_seconds": round(stats.decode_seconds, 4), "queue_seconds": round(done.queue_seconds, 4)}


def cached_tokens(stats: GenerationStats) -> int:
    """Prompt tokens whose keys/values the target's cache already held (reused, not computed)."""
    return getattr(stats, "cached_tokens", 0)


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(stats)}}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def stream_work(prepared: Prepared):
    """The job a worker runs: the decoder's stream, then the request's stats (a ``Done``)."""

    def run(decoder):
        stats = GenerationStats()
        stream = decoder.stream(prepared.prompt_ids, stats=stats, **prepared.options)
        finish, first_piece, newline = None, None, False
        with_logprobs = prepared.options.get("logprobs") is not None
        sent = 0

        def answer_logprobs() -> list:
            """The logprobs so far, without a final end-of-turn token (not part of the answer)."""
            entries, ids = stream.logprobs, stream.token_ids
            ends = set(decoder.eos_ids) | set(prepared.options.get("stop_token_ids", ()))
            if stream.finish_reason in ("eos", "stop") and ids and ids[-1] in ends:
                entries = entries[:-1]
            return entries

        try:
            for piece in stream:
                if with_logprobs:
                    entries = answer_logprobs()
                    yield Piece(piece, entries[sent:])
                    sent = len(entries)
                else:
                    yield piece  # closing this job closes the stream (finally): the request stops between rounds
                if prepared.time_limit:  # llama.cpp's t_max_predict_ms: past the limit, end at a newline
                    first_piece = first_piece or time.monotonic()
                    newline = newline or "\n" in piece
                    if newline and time.monotonic() - first_piece >= prepared.time_limit:
                        finish = "time"
                        break
        finally:
            stream.close()
        ids = stream.token_ids
        rest = answer_logprobs()[sent:] if with_logprobs else None
        yield Done(stats, 0.0, finish or stream.finish_reason or "length", ids[-1] if ids else None, rest)

    return run


def sampling_config(body, wire_names: dict) -> SamplingConfig:
    try:
        return SamplingConfig(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                              repetition_penalty=body.repetition_penalty)
    except ValueError as exc:
        raise decoder_error(exc, wire_names) from None


def check_model(options, name: str) -> None:
    """404 unless ``name`` is the served model."""
    if name != options.model_name:
        raise APIError(404, f"model {name!r} does not exist: this server serves {options.model_name!r}",
                       param="model", code="model_not_found")


def openai_options(body, max_new: int, stop_token_ids, wire_names: dict) -> dict:
    """An OpenAI body's generation fields as the decoder's ``stream`` keyword arguments."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    tree = ",".join(map(str, body.tree)) if isinstance(body.tree, list) else body.tree
    return dict(max_new_tokens=max_new, sampling=sampling_config(body, wire_names),
                num_draft_tokens=body.num_draft_tokens, seed=body.seed, stop=stop, proposer=body.proposer,
                tree=tree, stop_token_ids=tuple(stop_token_ids))


def body_constraint(body, wire_names: dict) -> Constraint | None:
    """The output constraint an OpenAI body asks for: ``response_format`` (json_object / json_schema), or
    llama-server's ``grammar`` (GBNF) / ``json_schema``; at most one of them. Records the field in
    ``wire_names`` so the decoder's compile errors name it."""
    given = [name for name in ("response_format", "grammar", "json_schema")
             if name in type(body).model_fields and getattr(body, name) is not None and not (
                 name == "response_format" and body.response_format.type == "text")]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: give one of response_format, grammar, json_schema", param=given[1])
    if not given:
        return None
    name = given[0]
    wire_names["constraint"] = name
    try:
        if name == "grammar":
            return Constraint.gbnf(body.grammar)
        if name == "json_schema":
            return Constraint.json_schema(body.json_schema)
        form = body.response_format
        if form.type == "json_object":
            return Constraint.json_schema(form.schema_) if form.schema_ is not None else Constraint.json_object()
        if form.json_schema is None:
            raise APIError(400, "response_format.json_schema: required with type json_schema",
                           param="response_format")
        schema = form.json_schema.schema_
        return Constraint.json_schema(schema if schema is not None else {})
    except ConstraintError as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from None


def logprob_entry(codec, entry, top: bool = True) -> dict:
    """One token's OpenAI chat logprobs item (token text, logprob, UTF-8 bytes, alternatives)."""

    def item(token_id, logprob):
        data = codec.piece_bytes(token_id) if hasattr(codec, "piece_bytes") else codec.decode([token_id]).encode()
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}

    out = item(entry.token, entry.logprob)
    if top:
        out["top_logprobs"] = [item(t, lp) for t, lp in entry.top]
    return out


def chat_logprobs(codec, entries) -> dict | None:
    return None if entries is None else {"content": [logprob_entry(codec, e) for e in entries], "refusal": None}


def completion_logprobs(codec, entries, offset: int = 0) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    if entries is None:
        return None
    tokens, offsets, tops = [], [], []
    for entry in entries:
        item = logprob_entry(codec, entry)
        tokens.append(item["token"])
        offsets.append(offset)
        offset += len(item["token"])
        tops.append({alt["token"]: alt["logprob"] for alt in item["top_logprobs"]})
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


class Generation:
    """What the generating routes share: validation through the decoder, the pool, the response forms."""

    def __init__(self, pool: DecoderPool, options, metrics: Metrics):
        self.pool, self.options, self.metrics = pool, options, metrics
        self.decoder = pool.decoder

    # ------------------------------------------------------------------ request -> decoder options
    def check_model(self, name: str) -> None:
        check_model(self.options, name)

    def validate(self, prompt_ids: list, options: dict, wire_names: dict, prompt_field: str,
                 budget_given: bool) -> Prepared:
        """The decoder's own checks (``make_request``) on these options; a GenerationError is a 400."""
        try:
            self.decoder.validate(prompt_ids, **options)
        except ValueError as exc:
            raise decoder_error(exc, wire_names, prompt_field, budget_given) from None
        return Prepared(list(prompt_ids), options)

    def prepare(self, body, prompt_ids: list, stop_token_ids=(), default_max=None, prompt_field="prompt",
                wire_names=OPENAI_NAMES, constraint=None, logprobs=None) -> Prepared:
        """An OpenAI body (completions or chat) as decoder options, validated by the decoder."""
        self.check_model(body.model)
        max_new = body.max_tokens
        if max_new is None:
            max_new = default_max if default_max is not None else max(
                1, self.decoder.max_context - len(prompt_ids) - 1 - DRAFT_ROOM)
        wire_names = dict(wire_names)
        if constraint is None:
            constraint = body_constraint(body, wire_names)
        options = openai_options(body, max_new, stop_token_ids, wire_names)
        if constraint is not None:
            options["constraint"] = constraint
        if logprobs is not None:
            options["logprobs"] = logprobs
        return self.validate(prompt_ids, options, wire_names, prompt_field, body.max_tokens is not None)

    # ------------------------------------------------------------------ the pool
    async def next_item(self, job, request: Request, checked: list):
        """The job's next item; a client gone meanwhile cancels the job (checked at most every poll period,
        whether items flow or not; ``checked`` holds the time of the last check)."""
        getter = asyncio.ensure_future(job.get())
        try:
            while True:
                wait = max(0.0, checked[0] + DISCONNECT_POLL_SECONDS - time.monotonic())
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if done and time.monotonic() < checked[0] + DISCONNECT_POLL_SECONDS:
                    return getter.result()
                checked[0] = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
                    self.metrics.disconnects += 1
                    raise ClientGone()
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    def infill_ids(self, prefix, suffix, extra, prompt, max_new: int | None, wire_names: dict) -> tuple[list, int]:
        """The FIM prompt (llama.cpp's layout, fitted to the context) and the token budget: ``max_new``, or
        with None what the context leaves after the prompt (keeping room for the middle: INFILL_RESERVE)."""
        decoder = self.decoder
        try:
            if max_new is not None:
                ids = decoder.infill_prompt(prefix, suffix, extra=extra, prompt=prompt, max_new_tokens=max_new)
                return ids, max_new
            reserve = min(INFILL_RESERVE, decoder.max_context // 4)
            ids = decoder.infill_prompt(prefix, suffix, extra=extra, prompt=prompt, max_new_tokens=reserve)
        except ValueError as exc:  # GenerationError: no FIM tokens, text that is not text, no room
            raise decoder_error(exc, wire_names, budget_given=max_new is not None) from None
        return ids, max(1, decoder.max_context - len(ids) - 1 - DRAFT_ROOM)

    def fim_stop_ids(self) -> tuple:
        return fim_stop_ids(fim_tokens(self.decoder.manifest, self.decoder.codec))

    async def start(self, prepared: Prepared, request: Request, wire_names=OPENAI_NAMES):
        """Queue the job on the worker whose cache shares the most of its prompt, and wait for its first item
        (so bad requests still get a 400, not a broken stream)."""
        retry = self.options.retry_after
        try:
            job = self.pool.submit(stream_work(prepared), prompt_ids=prepared.prompt_ids)
        except PoolBusy as exc:
            raise APIError(429, f"server busy: {exc}; retry later", code="queue_full", kind="rate_limit_error",
                           retry_after=retry) from None
        except PoolClosed as exc:
            raise APIError(503, str(exc), code="shutting_down", kind="server_error", retry_after=retry) from None
        try:
            first = await self.next_item(job, request, [time.monotonic()])
        except JobCancelled:
            raise APIError(503, "the server is shutting down: request cancelled", code="shutting_down",
                           kind="server_error", retry_after=retry) from None
        except ValueError as exc:  # the decoder's checks, made again by its stream (validated before: rare)
            raise decoder_error(exc, wire_names) from None
        except BaseException:
            job.cancel()
            raise
        return job, first

    async def collect(self, job, first, request):
        """Every text piece of the job, joined, and its ``Done``."""
        pieces, item, checked, done, logprobs = [], first, [time.monotonic()], None, []
        while item is not END:
            if isinstance(item, Done):
                done = item
            else:
                pieces.append(piece_text(item))
                if isinstance(item, Piece):
                    logprobs.extend(item.logprobs)
            item = await self.next_item(job, request, checked)
        if done is not None and done.logprobs is not None:
            done.logprobs = logprobs + done.logprobs  # the whole answer's, for a one-shot response
        return "".join(pieces), self.finished(done, job)

    def finished(self, done: Done, job) -> Done:
        done.queue_seconds = (job.started or job.submitted) - job.submitted
        self.metrics.add(done.stats)
        return done

    async def events(self, job, first, piece_line, last_lines):
        """SSE lines: ``piece_line(text)`` per text piece, then ``last_lines(done)``; errors in-band.

        The last lines (``[DONE]``) wait for the job's END, which the pool sends once the worker is free: a client
        that sends its next turn on ``[DONE]`` is then routed to the worker holding its cache."""
        item, last = first, []
        try:
            while item is not END:
                if isinstance(item, Done):
                    last = list(last_lines(self.finished(item, job)))
                else:
                    line = piece_line(item)
                    if line:
                        yield line
                item = await job.get()
            for line in last:
                yield line
        except JobCancelled:
            yield sse({"error": {"message": "the server is shutting down: generation cancelled",
                                 "type": "server_error", "param": None, "code": "shutting_down"}})
        except Exception as exc:  # the stream has started: report in-band, as OpenAI does
            log.exception("generation failed mid-stream")
            yield sse({"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None,
                                 "code": None}})
        finally:
            job.cancel()  # no-op when finished; frees the worker when the client went away mid-stream


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


class Completions(Generation):
    """``POST /v1/completions``."""

    async def create(self, body: CompletionRequest, request: Request):
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        if body.suffix is not None:  # OpenAI's legacy insert mode / Ollama's suffix: fill in the middle
            prepared, wire_names = self.prepare_insert(body, prompt), OPENAI_INFILL_NAMES
        else:
            prompt_ids = self.decoder.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
            prepared = self.prepare(body, prompt_ids, default_max=COMPLETION_DEFAULT_MAX_TOKENS,
                                    logprobs=body.logprobs)
            wire_names = OPENAI_NAMES
        job, first = await self.start(prepared, request, wire_names)
        ident, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.options.model_name
        codec, offset = self.decoder.codec, [0]

        def chunk(text, finish, entries=None):
            logprobs = completion_logprobs(codec, entries, offset[0]) if entries is not None else None
            offset[0] += len(text or "")
            return {"id": ident, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]}

        if body.stream:
            def piece_line(item):
                return sse(chunk(piece_text(item), None, item.logprobs if isinstance(item, Piece) else None))

            def last(done: Done) -> list:
                lines = []
                if done.logprobs:  # tokens no piece carried (text held back, e.g. an incomplete character)
                    lines.append(sse(chunk("", None, done.logprobs)))
                final = chunk(None, finish_reason(done))
                final["specdec"] = specdec_fields(done)
                lines.append(sse(final))
                if _include_usage(body):
                    lines.append(sse({**chunk(None, None), "choices": [], "usage": usage(done.stats),
                                      "specdec": specdec_fields(done)}))
                return lines + ["data: [DONE]\n\n"]

            return StreamingResponse(self.events(job, first, piece_line, last), media_type="text/event-stream")
        text, done = await self.collect(job, first, request)
        return {**chunk(text, finish_reason(done), done.logprobs), "usage": usage(done.stats),
                "specdec": specdec_fields(done)}

    def prepare_insert(self, body: CompletionRequest, prompt) -> Prepared:
        """``prompt`` + ``suffix``: the text between them, through the bundle's fill-in-the-middle tokens."""
        self.check_model(body.model)
        if not isinstance(prompt, str):
            raise APIError(400, "suffix: fill-in-the-middle needs a text prompt, not token ids", param="suffix")
        max_new = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        ids, max_new = self.infill_ids(prompt, body.suffix, (), "", max_new, OPENAI_INFILL_NAMES)
        wire_names = dict(OPENAI_INFILL_NAMES)
        constraint = body_constraint(body, wire_names)
        options = openai_options(body, max_new, self.fim_stop_ids(), wire_names)
        if constraint is not None:
            options["constraint"] = constraint
        if body.logprobs is not None:
            options["logprobs"] = body.logprobs
        return self.validate(ids, options, wire_names, "prompt", True)


class Chat(Generation):
    """``POST /v1/chat/completions``: the bundle's chat template around the messages; ``tools`` rendered by the
    template, the model's calls parsed (decoding/tools.py) into ``tool_calls``."""

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        wire_names = OPENAI_NAMES
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ: give one", param="max_tokens")
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
            wire_names = {"max_new_tokens": "max_completion_tokens"}
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        try:
            usable, required = chosen_tools(tools, choice)
        except ToolError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None
        try:
            prompt = chat_prompt(self.decoder, [plain_message(m) for m in body.messages], tools=tools or None)
            form = tool_format_of(chat_template_of(self.decoder).source) if usable else None
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        constraint, wire_names = None, dict(wire_names)
        if required:
            if form is None:
                raise APIError(400, "tool_choice: this model's chat template has no tool-call syntax specdec knows "
                               f"(known: {', '.join(row.family for row in TOOL_FORMATS)})", param="tool_choice")
            if body_constraint(body, {}) is not None:
                raise APIError(400, "tool_choice: a required tool call and response_format / grammar / json_schema "
                               "cannot both apply", param="tool_choice")
            constraint = tool_call_constraint(usable, form, body.parallel_tool_calls, self.decoder.codec)
            wire_names["constraint"] = "tools"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prepared = self.prepare(body, prompt.ids, prompt.stop_token_ids, prompt_field="messages",
                                wire_names=wire_names, constraint=constraint, logprobs=logprobs)
        job, first = await self.start(prepared, request, wire_names)
        ident, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.options.model_name
        codec = self.decoder.codec

        def chunk(delta, finish, entries=None):
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(codec, entries),
                                 "finish_reason": finish}]}

        if body.stream:
            names = [tool["function"]["name"] for tool in usable]
            calls = ToolCallStream(form, names) if form is not None else None

            def piece_line(item) -> str:
                text, entries = piece_text(item), (item.logprobs if isinstance(item, Piece) else None)
                if calls is None:
                    return sse(chunk({"content": text}, None, entries))
                content, finished = calls.push(text)
                lines = [sse(chunk({"content": content}, None, entries))] if content or entries else []
                return "".join(lines + call_lines(finished))

            def call_lines(finished) -> list:
                if not finished:
                    return []
                first = len(calls.calls) - len(finished)
                return [sse(chunk({"tool_calls": [call.as_openai(first + i)]}, None)) for i, call in enumerate(finished)]

            def last(done: Done) -> list:
                lines = []
                rest, finished = calls.finish() if calls is not None else ("", [])
                if rest or done.logprobs:
                    lines.append(sse(chunk({"content": rest} if rest else {}, None, done.logprobs or None)))
                lines += call_lines(finished)
                called = calls is not None and calls.calls
                final = chunk({}, "tool_calls" if called and done.finish != "length" else finish_reason(done))
                final["specdec"] = specdec_fields(done)
                lines.append(sse(final))
                if _include_usage(body):
                    lines.append(sse({**chunk({}, None), "choices": [], "usage": usage(done.stats),
                                      "specdec": specdec_fields(done)}))
                return lines + ["data: [DONE]\n\n"]

            async def events():
                yield sse(chunk({"role": "assistant", "content": ""}, None))
                async for line in self.events(job, first, piece_line, last):
                    yield line

            return StreamingResponse(events(), media_type="text/event-stream")
        text, done = await self.collect(job, first, request)
        names = [tool["function"]["name"] for tool in usable]
        content, calls = parse_tool_calls(text, form, names) if form is not None else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        finish = "tool_calls" if calls and done.finish != "length" else finish_reason(done)
        return {"id": ident, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(codec, done.logprobs),
                             "finish_reason": finish}],
                "usage": usage(done.stats), "specdec": specdec_fields(done)}


class Infill(Generation):
    """llama-server's ``POST /infill``: its request fields, its answer (``content``, ``stop``, ``timings`` ...),
    its stream (``data: {"content": ...}`` lines, the last with ``"stop": true``; no ``[DONE]``)."""

    async def create(self, body: InfillRequest, request: Request):
        prepared, ignored = self.prepare_infill(body)
        job, first = await self.start(prepared, request, LLAMA_NAMES)
        stop_ids = set(prepared.options["stop_token_ids"])

        codec = self.decoder.codec

        def answer(text: str, done: Done) -> dict:
            out = llama_answer(text, done, stop_ids, self.options.model_name, ignored)
            if done.logprobs is not None:
                out["completion_probabilities"] = llama_probs(codec, done.logprobs)
            return out

        def piece_line(item) -> str:
            line = {"index": 0, "content": piece_text(item), "stop": False}
            if isinstance(item, Piece):
                line["completion_probabilities"] = llama_probs(codec, item.logprobs)
            return sse(line)

        if body.stream:
            return StreamingResponse(self.events(job, first, piece_line, lambda done: [sse(answer("", done))]),
                                     media_type="text/event-stream")
        text, done = await self.collect(job, first, request)
        return answer(text, done)

    def prepare_infill(self, body: InfillRequest) -> tuple[Prepared, list]:
        """The body as decoder options on the FIM prompt; the llama.cpp fields specdec does not use."""
        ignored = body.ignored_fields + ([] if body.cache_prompt else ["cache_prompt"])  # reuse is exact: always on
        extra = [chunk.model_dump() for chunk in body.input_extra]
        max_new = None if body.n_predict < 0 else body.n_predict
        ids, max_new = self.infill_ids(body.input_prefix, body.input_suffix, extra, body.prompt, max_new, LLAMA_NAMES)
        try:
            sampling = SamplingConfig(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                      min_p=body.min_p, repetition_penalty=body.repeat_penalty)
        except ValueError as exc:
            raise decoder_error(exc, LLAMA_NAMES) from None
        options = dict(max_new_tokens=max_new, sampling=sampling, num_draft_tokens=body.num_draft_tokens,
                       seed=None if body.seed == -1 else body.seed,
                       stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
                       proposer=body.proposer, stop_token_ids=self.fim_stop_ids())
        wire_names = dict(LLAMA_NAMES)
        constraint = body_constraint(body, wire_names)
        if constraint is not None:
            options["constraint"] = constraint
        if body.n_probs:
            options["logprobs"] = body.n_probs
        prepared = self.validate(ids, options, wire_names, "input_prefix", body.n_predict >= 0)
        prepared.time_limit = body.t_max_predict_ms / 1000.0
        return prepared, ignored


def llama_answer(text: str, done: Done, stop_ids: set, model: str, ignored: list) -> dict:
    """llama-server's completion answer (its /infill and /completion shape) for a finished request."""
    stats = done.stats
    cached = cached_tokens(stats)
    computed = stats.prompt_tokens - cached
    prompt_ms, predicted_ms = stats.prefill_seconds * 1000.0, stats.decode_seconds * 1000.0
    if done.finish == "eos" or (done.finish == "stop" and done.last_token in stop_ids):
        stop_type = "eos"
    else:
        stop_type = "word" if done.finish == "stop" else "limit"
    timings = {"prompt_n": computed, "prompt_ms": round(prompt_ms, 3),
               "prompt_per_token_ms": round(prompt_ms / computed, 3) if computed else 0.0,
               "prompt_per_second": round(computed / stats.prefill_seconds, 2) if stats.prefill_seconds else 0.0,
               "predicted_n": stats.new_tokens, "predicted_ms": round(predicted_ms, 3),
               "predicted_per_token_ms": round(predicted_ms / stats.new_tokens, 3) if stats.new_tokens else 0.0,
               "predicted_per_second": round(stats.tokens_per_s, 2)}
    return {"index": 0, "content": text, "stop": True, "model": model, "tokens_predicted": stats.new_tokens,
            "tokens_evaluated": stats.prompt_tokens, "tokens_cached": cached, "stop_type": stop_type,
            "timings": timings, "specdec": {**specdec_fields(done), "ignored_fields": ignored}}


def llama_probs(codec, entries) -> list:
    """llama-server's ``completion_probabilities`` (its n_probs answer): id, token, logprob, bytes, top_logprobs."""
    out = []
    for entry in entries:
        item = logprob_entry(codec, entry)
        out.append({"id": entry.token, "token": item["token"], "logprob": item["logprob"], "bytes": item["bytes"],
                    "top_logprobs": [{"id": t, **alt} for (t, _), alt in zip(entry.top, item["top_logprobs"])]})
    return out


def plain_message(message: ChatMessage) -> dict:
    plain = message.model_dump(exclude_none=True)
    if plain["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
        plain["role"] = "system"
    return plain


class Info:
    """``/v1/models``, ``/v1/models/{model}``, ``/health``, ``/metrics``."""

    def __init__(self, pool: DecoderPool, options, metrics: Metrics):
        self.pool, self.options, self.metrics = pool, options, metrics

    async def health(self):
        pool = self.pool
        return {"status": "shutting_down" if pool.closed else "ok", "pid": os.getpid(),
                "workers": pool.options.workers, "busy": pool.busy, "queue_depth": pool.waiting}

    async def prometheus(self):
        return PlainTextResponse(self.metrics.render(self.pool), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self):
        return {"object": "list", "data": [self._card(self.options.model_name)]}

    async def model(self, model: str):
        check_model(self.options, model)
        return self._card(model)

    @staticmethod
    def _card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "specdec"}
