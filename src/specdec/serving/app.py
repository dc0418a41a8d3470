"""An OpenAI-compatible HTTP server over a DecoderPool (FastAPI; the ``[serve]`` extra).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (``stream: true`` as server-sent
events), ``/health``, ``/metrics`` (Prometheus text). Requests are pydantic models that forbid unknown
fields; every error is OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for
bad input (each bad field named), 404 for an unknown model, 429 (queue full) / 503 (shutting down) with
``Retry-After``. Generation runs in the pool's worker threads; a client that goes away cancels its job.
Boundary: HTTP <-> pool jobs; decoding is the decoder's, chat rendering is chat.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.decoding.request import GenerationStats
from specdec.sampling.processors import SamplingConfig

from specdec.decoding.chat import ChatTemplateError, chat_prompt
from specdec.serving.protocol import (APIError, ChatCompletionRequest, ChatMessage, ClientGone, CompletionRequest,
                         error_response, field_errors)
from specdec.serving.metrics import Metrics
from specdec.serving.pool import END, DecoderPool, JobCancelled, PoolBusy, PoolClosed

DRAFT_ROOM = 64  # context slots kept free for one round's drafts when max_tokens is left to the server
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_SECONDS = 0.25


# ----------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class ServerOptions:
    model_name: str
    shutdown_grace: float = 10.0  # seconds running requests may take to finish at shutdown
    retry_after: int = 1  # seconds, sent with 429 / 503

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")


@dataclass
class _Prepared:
    prompt_ids: list
    max_new_tokens: int
    options: dict  # decoder.stream keyword arguments


@dataclass
class _Done:
    stats: GenerationStats
    queue_seconds: float
    finish: str = "length"  # the decoder's reason: "eos" | "stop" | "length"


def _finish_reason(done: _Done) -> str:
    """OpenAI's "stop" (EOS, end of turn, stop string) or "length"."""
    return "length" if done.finish == "length" else "stop"


def _specdec_fields(done: _Done) -> dict:
    stats = done.stats
    return {"acceptance_rate": round(stats.acceptance_rate, 4), "proposed_tokens": stats.proposed,
            "accepted_tokens": stats.accepted, "rounds": stats.rounds,
            "tokens_per_second": round(stats.tokens_per_s, 2), "prefill_seconds": round(stats.prefill_seconds, 4),
            "decode_seconds": round(stats.decode_seconds, 4), "queue_seconds": round(done.queue_seconds, 4)}


def _usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def _work(prepared: _Prepared):
    """The job a worker runs: the decoder's stream, then the request's stats."""

    def run(decoder):
        stats = GenerationStats()
        stream = decoder.stream(prepared.prompt_ids, stats=stats, max_new_tokens=prepared.max_new_tokens,
                                **prepared.options)
        yield from stream  # closing this job closes the stream: the request stops between rounds
        yield _Done(stats, 0.0, stream.finish_reason or "length")

    return run


def create_app(pool: DecoderPool, options: ServerOptions) -> FastAPI:
    """The FastAPI app serving ``pool`` under the OpenAI routes; closing the app closes the pool."""
    metrics = Metrics()
    decoder = pool.decoder
    codec = decoder.codec

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(pool.close, options.shutdown_grace)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = field_errors(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), kind=kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def client_gone(request, exc):
        return error_response(499, "client closed the request")

    @app.exception_handler(Exception)
    async def failure(request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    @app.get("/health")
    async def health():
        return {"status": "shutting_down" if pool.closed else "ok", "pid": os.getpid(), "workers": pool.options.workers,
                "busy": pool.busy, "queue_depth": pool.waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(pool), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(options.model_name)]}

    @app.get("/v1/models/{model}")
    async def model(model: str):
        _check_model(model)
        return _model_card(model)

    def _model_card(name):
        return {"id": name, "object": "model", "created": 0, "owned_by": "specdec"}

    def _check_model(name):
        if name != options.model_name:
            raise APIError(404, f"model {name!r} does not exist: this server serves {options.model_name!r}",
                           param="model", code="model_not_found")

    def _prepare(body, prompt_ids: list, stop_token_ids=(), default_max=None,
                 prompt_field="prompt") -> _Prepared:
        _check_model(body.model)
        vocab = decoder.manifest.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param=prompt_field)
        room = decoder.max_context - len(prompt_ids) - 1
        max_new = body.max_tokens if body.max_tokens is not None else default_max
        if max_new is None:
            max_new = room - DRAFT_ROOM
        if max_new < 1 or max_new > room:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens "
                                f"({body.max_tokens if body.max_tokens is not None else 'the rest'}) does not fit "
                                f"the context of {decoder.max_context} tokens: shorten the prompt or lower max_tokens",
                           param=prompt_field if body.max_tokens is None else "max_tokens",
                           code="context_length_exceeded")
        try:
            sampling = SamplingConfig(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                      min_p=body.min_p, repetition_penalty=body.repetition_penalty)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        tree = ",".join(map(str, body.tree)) if isinstance(body.tree, list) else body.tree
        return _Prepared(list(prompt_ids), max_new, dict(
            sampling=sampling, num_draft_tokens=body.num_draft_tokens, seed=body.seed, stop=stop,
            proposer=body.proposer, tree=tree, stop_token_ids=tuple(stop_token_ids)))

    async def _next(job, request: Request, checked: list):
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
                    metrics.disconnects += 1
                    raise ClientGone()
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def _start(prepared: _Prepared, request: Request):
        """Queue the job and wait for its first item (so bad requests still get a 400, not a broken stream)."""
        try:
            job = pool.submit(_work(prepared))
        except PoolBusy as exc:
            raise APIError(429, f"server busy: {exc}; retry later", code="queue_full", kind="rate_limit_error",
                           retry_after=options.retry_after) from None
        except PoolClosed as exc:
            raise APIError(503, str(exc), code="shutting_down", kind="server_error",
                           retry_after=options.retry_after) from None
        try:
            first = await _next(job, request, [time.monotonic()])
        except JobCancelled:
            raise APIError(503, "the server is shutting down: request cancelled", code="shutting_down",
                           kind="server_error", retry_after=options.retry_after) from None
        except ValueError as exc:  # GenerationError and other request validation by the decoder
            raise APIError(400, str(exc)) from None
        except BaseException:
            job.cancel()
            raise
        return job, first

    async def _collect(job, first, request):
        pieces, item, checked = [], first, [time.monotonic()]
        while item is not END:
            if isinstance(item, _Done):
                done = item
            else:
                pieces.append(item)
            item = await _next(job, request, checked)
        return "".join(pieces), done

    def _finished(done: _Done, job) -> _Done:
        done.queue_seconds = (job.started or job.submitted) - job.submitted
        metrics.add(done.stats)
        return done

    async def _events(job, first, request, chunk, max_new, include_usage):
        """SSE lines: one chunk per text piece, a last chunk with finish_reason, usage if asked, [DONE]."""
        item = first
        try:
            while item is not END:
                if isinstance(item, _Done):
                    done = _finished(item, job)
                    final = chunk(None, _finish_reason(done))
                    final["specdec"] = _specdec_fields(done)
                    yield _sse(final)
                    if include_usage:
                        yield _sse({**chunk(None, None), "choices": [], "usage": _usage(done.stats),
                                    "specdec": _specdec_fields(done)})
                else:
                    yield _sse(chunk(item, None))
                item = await job.get()
            yield "data: [DONE]\n\n"
        except JobCancelled:
            yield _sse({"error": {"message": "the server is shutting down: generation cancelled",
                                  "type": "server_error", "param": None, "code": "shutting_down"}})
        except Exception as exc:  # the stream has started: report in-band, as OpenAI does
            yield _sse({"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None,
                                  "code": None}})
        finally:
            job.cancel()  # no-op when finished; frees the worker when the client went away mid-stream

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        prompt_ids = codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prepared = _prepare(body, prompt_ids, default_max=COMPLETION_DEFAULT_MAX_TOKENS)
        job, first = await _start(prepared, request)
        ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, finish):
            return {"id": ident, "object": "text_completion", "created": created, "model": options.model_name,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(job, first, request, chunk, prepared.max_new_tokens, include),
                                     media_type="text/event-stream")
        text, done = await _collect(job, first, request)
        done = _finished(done, job)
        response = chunk(text, _finish_reason(done))
        return {**response, "usage": _usage(done.stats), "specdec": _specdec_fields(done)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model)
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ: give one", param="max_tokens")
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        messages = [_plain_message(m) for m in body.messages]
        try:
            prompt = chat_prompt(decoder, messages)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prepared = _prepare(body, prompt.ids, prompt.stop_token_ids, prompt_field="messages")
        job, first = await _start(prepared, request)
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, finish, role=False):
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": options.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)

            async def events():
                yield _sse(chunk("", None, role=True))
                async for line in _events(job, first, request, chunk, prepared.max_new_tokens, include):
                    yield line

            return StreamingResponse(events(), media_type="text/event-stream")
        text, done = await _collect(job, first, request)
        done = _finished(done, job)
        return {"id": ident, "object": "chat.completion", "created": created, "model": options.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": _finish_reason(done)}],
                "usage": _usage(done.stats), "specdec": _specdec_fields(done)}

    return app


class _CountRequests:
    """Counts responses by route and status. A plain ASGI middleware: Starlette's BaseHTTPMiddleware would
    wrap ``receive`` and hide a client's disconnect from the handlers."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.count_request(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def _plain_message(message: ChatMessage) -> dict:
    plain = message.model_dump(exclude_none=True)
    if plain["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
        plain["role"] = "system"
    return plain


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
