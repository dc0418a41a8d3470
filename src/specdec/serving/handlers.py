"""The route handlers: one class per route family, over a DecoderPool.

``Generation`` is what every generating route shares: a request body becomes decoder options, checked
once by the decoder's own ``validate`` (``make_request``: the same checks the worker's ``stream`` makes,
a ``GenerationError`` becoming a 400 naming the wire field); the job is queued on the pool; its items
come back as one JSON answer or as server-sent events, and a client that goes away cancels it.
``Completions`` and ``Chat`` are the two OpenAI routes on top; ``Info`` answers ``/v1/models``,
``/health`` and ``/metrics``. Boundary: HTTP <-> pool jobs; the wire shapes are protocol.py's, decoding
is the decoder's, chat rendering is chat.py's.
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

from specdec.decoding.chat import ChatTemplateError, chat_prompt
from specdec.decoding.request import GenerationStats
from specdec.sampling.processors import SamplingConfig
from specdec.serving.metrics import Metrics
from specdec.serving.pool import END, DecoderPool, JobCancelled, PoolBusy, PoolClosed
from specdec.serving.protocol import (APIError, ChatCompletionRequest, ChatMessage, ClientGone, CompletionRequest,
                                      decoder_error)

log = logging.getLogger(__name__)

DRAFT_ROOM = 64  # context slots kept free for one round's drafts when max_tokens is left to the server
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_SECONDS = 0.25

# decoder argument -> the OpenAI request field that carries it (for the decoder's error messages)
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


@dataclass
class Prepared:
    """A validated request: the prompt's token ids and the decoder's ``stream`` keyword arguments."""
    prompt_ids: list
    options: dict = field(default_factory=dict)

    @property
    def max_new_tokens(self) -> int:
        return self.options["max_new_tokens"]


@dataclass
class Done:
    """The last item of a job: the request's statistics and the decoder's finish reason."""
    stats: GenerationStats
    queue_seconds: float
    finish: str = "length"  # the decoder's reason: "eos" | "stop" | "length"


def finish_reason(done: Done) -> str:
    """OpenAI's "stop" (EOS, end of turn, stop string) or "length"."""
    return "length" if done.finish == "length" else "stop"


def specdec_fields(done: Done) -> dict:
    stats = done.stats
    return {"acceptance_rate": round(stats.acceptance_rate, 4), "proposed_tokens": stats.proposed,
            "accepted_tokens": stats.accepted, "rounds": stats.rounds,
            "tokens_per_second": round(stats.tokens_per_s, 2), "prefill_seconds": round(stats.prefill_seconds, 4),
            "decode_seconds": round(stats.decode_seconds, 4), "queue_seconds": round(done.queue_seconds, 4)}


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def stream_work(prepared: Prepared):
    """The job a worker runs: the decoder's stream, then the request's stats (a ``Done``)."""

    def run(decoder):
        stats = GenerationStats()
        stream = decoder.stream(prepared.prompt_ids, stats=stats, **prepared.options)
        yield from stream  # closing this job closes the stream: the request stops between rounds
        yield Done(stats, 0.0, stream.finish_reason or "length")

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
                wire_names=OPENAI_NAMES) -> Prepared:
        """An OpenAI body (completions or chat) as decoder options, validated by the decoder."""
        self.check_model(body.model)
        max_new = body.max_tokens
        if max_new is None:
            max_new = default_max if default_max is not None else max(
                1, self.decoder.max_context - len(prompt_ids) - 1 - DRAFT_ROOM)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        tree = ",".join(map(str, body.tree)) if isinstance(body.tree, list) else body.tree
        options = dict(max_new_tokens=max_new, sampling=sampling_config(body, wire_names),
                       num_draft_tokens=body.num_draft_tokens, seed=body.seed, stop=stop, proposer=body.proposer,
                       tree=tree, stop_token_ids=tuple(stop_token_ids))
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

    async def start(self, work, request: Request, wire_names=OPENAI_NAMES):
        """Queue the job and wait for its first item (so bad requests still get a 400, not a broken stream)."""
        retry = self.options.retry_after
        try:
            job = self.pool.submit(work)
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
        pieces, item, checked, done = [], first, [time.monotonic()], None
        while item is not END:
            if isinstance(item, Done):
                done = item
            else:
                pieces.append(item)
            item = await self.next_item(job, request, checked)
        return "".join(pieces), self.finished(done, job)

    def finished(self, done: Done, job) -> Done:
        done.queue_seconds = (job.started or job.submitted) - job.submitted
        self.metrics.add(done.stats)
        return done

    async def events(self, job, first, chunk, include_usage: bool):
        """SSE lines: one chunk per text piece, a last chunk with finish_reason, usage if asked, [DONE]."""
        item = first
        try:
            while item is not END:
                if isinstance(item, Done):
                    done = self.finished(item, job)
                    final = chunk(None, finish_reason(done))
                    final["specdec"] = specdec_fields(done)
                    yield sse(final)
                    if include_usage:
                        yield sse({**chunk(None, None), "choices": [], "usage": usage(done.stats),
                                   "specdec": specdec_fields(done)})
                else:
                    yield sse(chunk(item, None))
                item = await job.get()
            yield "data: [DONE]\n\n"
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
        prompt_ids = self.decoder.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prepared = self.prepare(body, prompt_ids, default_max=COMPLETION_DEFAULT_MAX_TOKENS)
        job, first = await self.start(stream_work(prepared), request)
        ident, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.options.model_name

        def chunk(text, finish):
            return {"id": ident, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return StreamingResponse(self.events(job, first, chunk, _include_usage(body)),
                                     media_type="text/event-stream")
        text, done = await self.collect(job, first, request)
        return {**chunk(text, finish_reason(done)), "usage": usage(done.stats), "specdec": specdec_fields(done)}


class Chat(Generation):
    """``POST /v1/chat/completions``: the bundle's chat template around the messages."""

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        wire_names = OPENAI_NAMES
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ: give one", param="max_tokens")
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
            wire_names = {"max_new_tokens": "max_completion_tokens"}
        try:
            prompt = chat_prompt(self.decoder, [plain_message(m) for m in body.messages])
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prepared = self.prepare(body, prompt.ids, prompt.stop_token_ids, prompt_field="messages",
                                wire_names=wire_names)
        job, first = await self.start(stream_work(prepared), request, wire_names)
        ident, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.options.model_name

        def chunk(text, finish, role=False):
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            async def events():
                yield sse(chunk("", None, role=True))
                async for line in self.events(job, first, chunk, _include_usage(body)):
                    yield line

            return StreamingResponse(events(), media_type="text/event-stream")
        text, done = await self.collect(job, first, request)
        return {"id": ident, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish_reason(done)}],
                "usage": usage(done.stats), "specdec": specdec_fields(done)}


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
