"""The HTTP server over a DecoderPool (FastAPI; the ``[serve]`` extra): the wiring of its dialects.

Each wire dialect is one module of ``serving/dialects`` that mounts its routes over the shared ``Engine``
(serving/jobs.py): OpenAI's chat completions, completions and models (``dialects/openai.py``, also without the
``/v1`` prefix), the Responses API (``dialects/responses.py``), Anthropic's Messages API
(``dialects/anthropic.py``), llama-server's native routes (``dialects/llama.py``). Besides them: ``/health`` and
``/metrics`` (Prometheus text), the chat page at ``/`` (``serving/webui``, unless
``ServerOptions.webui`` is off). Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param",
"code"}}``) unless a dialect owns the path (Anthropic's: ``{"type": "error", "error": {...}}``; llama-server's
routes: its shape, whose ``code`` is the HTTP status, with OpenAI's ``param``): 400 for bad input (each bad field
named), 404 for an unknown route (or model, with ``strict_model``), 429 (queue full) / 503 (shutting down) with
``Retry-After``, 499 when the client went away before its answer, 500 for a failure of the server itself.
Generation runs in the pool's worker threads; a client that goes away cancels
its job.

``build_app`` is the one load -> pool -> app path (``specdec serve`` and each Ray Serve replica);
``create_app`` mounts the dialects over a pool, or over none yet (503 "Loading model", as llama-server answers
while it loads), and ``attach_loaded`` gives it the loaded bundle's pool.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.contract.manifest import Manifest
from specdec.decoding.load_options import BackgroundLoad, LoadOptions
from specdec.decoding.text.chat import template_from_file
from specdec.serving import webui
from specdec.serving.dialects import dialects
from specdec.serving.jobs import Engine
from specdec.serving.metrics import Metrics
from specdec.serving.pool import DecoderPool, PoolOptions
from specdec.serving.wire import APIError, ClientGone, error_response, field_errors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    model_name: str  # the served model's id: what /v1/models lists first and every reply names
    aliases: tuple = ()  # other names the server lists and answers to
    # True: a request naming another model is a 404 (OpenAI's behaviour); False (default, llama-server's): with one
    # model served, any name is that model (agents send the name they were configured with)
    strict_model: bool = False
    shutdown_grace: float = 10.0  # seconds running requests may take to finish at shutdown
    retry_after: int = 1  # seconds, sent with 429 / 503
    slot_save_path: str | None = None  # the folder llama-server's slot save / restore use (None: those are 501)
    webui: bool = True  # the chat page at / (serving/webui); False: / is a 404
    webui_dir: str | None = None  # a folder to serve the page's files from instead of the packaged ones
    # llama-server's --api-key: requests must carry one of these as "Authorization: Bearer KEY" (or Anthropic's
    # "x-api-key: KEY") or get a 401, on every route but /health, /v1/health and the chat page's files; empty: no key asked
    api_keys: tuple = ()
    # which web pages' scripts may read answers (CORS, as llama-server's --cors-origins): "localhost" (default:
    # pages served from localhost, 127.0.0.1 or [::1] only), "*" (any page: llama-server's default), or a comma
    # list of origins; "" sends no CORS header (browsers then let no other origin read an answer)
    cors_origins: str = "localhost"
    seed: int | None = None  # llama-server's --seed: the seed of a request that gives none (None: fresh randomness)
    slots_endpoint: bool = True  # GET /slots answers (llama-server's --slots / --no-slots; False: a 501)
    chat_template_file: str | None = None  # llama-server's --chat-template-file: used instead of the bundle's template
    verbose: bool = False  # llama-server's --verbose: chat answers carry __verbose (the rendered prompt) unless asked not to

    def __post_init__(self):
        from specdec.contract.field_checks import int_in
        from specdec.contract.limits import MAX_SEED

        if self.seed is not None:
            int_in(0, MAX_SEED)(self.seed, "seed")
        if self.chat_template_file is not None and not os.path.isfile(self.chat_template_file):
            raise ValueError(f"chat_template_file {self.chat_template_file!r} is not a file")
        if not self.model_name or not all(isinstance(name, str) and name for name in self.aliases):
            raise ValueError("model names must be non-empty")
        if self.slot_save_path is not None and not os.path.isdir(self.slot_save_path):
            raise ValueError(f"the slot save path {self.slot_save_path} is not a directory")
        object.__setattr__(self, "aliases", tuple(dict.fromkeys(a for a in self.aliases if a != self.model_name)))
        if not all(isinstance(key, str) and key and key.strip() == key for key in self.api_keys):
            raise ValueError("API keys must be non-empty strings without surrounding spaces")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")

    @property
    def model_names(self) -> tuple:
        return (self.model_name, *self.aliases)

    def known_model(self, name: str) -> None:
        """404 for a name the server does not answer to (only with ``strict_model``)."""
        if self.strict_model and name not in self.model_names:
            served = ", ".join(map(repr, self.model_names))
            raise APIError(404, f"model {name!r} does not exist: this server serves {served}", param="model",
                           code="model_not_found")

    def answer_model(self, name: str | None) -> str:
        """The id a reply names for a request that asked for ``name``."""
        if name is not None:
            self.known_model(name)
        return self.model_name


def build_app(bundle, server: ServerOptions, pool: PoolOptions | None = None,
              load: LoadOptions | None = None, loading=None) -> FastAPI:
    """Load ``bundle``, fork a pool of its decoders, and the app serving it: ``specdec serve``'s and each Ray
    replica's one path from a bundle to an app. ``loading``: the same load already under way
    (``load_options.BackgroundLoad``, started with ``load`` and ``pool.workers``), whose decoder this waits for.
    The app is built while the bundle loads; ``specdec serve`` serves it meanwhile (``create_app`` without a pool,
    then ``attach_loaded``)."""
    load, pool = load or LoadOptions(), pool or PoolOptions()
    template = server_template(bundle, server)
    loading = loading or BackgroundLoad(bundle, load, pool.workers)
    app = create_app(None, server)
    attach_loaded(app, bundle, server, pool, load, loading, template)
    return app


def server_template(bundle, server: ServerOptions):
    """``--chat-template-file``'s template for ``bundle`` (None without one), read and compiled without loading the
    bundle's weights: a file jinja2 cannot parse is a ChatTemplateError in one line before the server starts."""
    if server.chat_template_file is None:
        return None
    root = Path(bundle)
    return template_from_file(root, Manifest.read(root), server.chat_template_file)


def attach_loaded(app: FastAPI, bundle, server: ServerOptions, pool: PoolOptions, load: LoadOptions,
                  loading, template=None) -> None:
    """Wait for ``loading``'s decoder, measure or read this machine's pass costs, and give ``app`` (made by
    ``create_app(None, ...)``) its pool: from then on it answers. ``template``: ``server_template``'s, when the
    caller read it already. Raises what the load raised."""
    decoder = loading.result()
    log.info("loaded %s on %s: max_context %d", bundle, load.provider, decoder.max_context)  # load logged why
    started = time.perf_counter()
    # this machine's pass costs now, not in the first request: stored after the first time; a first start answers
    # on coarse ones and the idle pool measures them in full (pool.py)
    decoder.costs(provisional=True)
    log.info("pass costs ready in %.1f s%s", time.perf_counter() - started,
             " (provisional)" if decoder.costs_provisional else "")
    if server.chat_template_file is not None:  # before the pool forks the decoder: every worker renders with it
        decoder.chat_template = template or template_from_file(decoder.bundle_dir, decoder.manifest,
                                                               server.chat_template_file)
        log.info("chat template: %s (instead of the bundle's)", server.chat_template_file)
    app.state.engine.attach(DecoderPool(decoder, pool))


def create_app(pool: DecoderPool | None, options: ServerOptions) -> FastAPI:
    """The FastAPI app serving ``pool`` in every dialect; closing the app closes the pool. ``pool`` None: the app
    answers every route but the chat page's files with llama-server's 503 "Loading model" until
    ``app.state.engine.attach(pool)`` (``attach_loaded``)."""
    metrics = Metrics()
    engine = Engine(pool, options, metrics)

    @asynccontextmanager
    async def lifespan(app):
        yield
        if engine.pool is not None:
            await asyncio.to_thread(engine.pool.close, options.shutdown_grace)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine = engine
    pages = webui.page_paths() if options.webui else frozenset()
    app.add_middleware(_WhileLoading, engine=engine, open_paths=pages)
    if options.api_keys:  # added after the loading gate, so it runs before it (as llama-server's key check does)
        app.add_middleware(_RequireApiKey, keys=options.api_keys, public=PUBLIC_PATHS | pages)
    if options.cors_origins:  # outside the key check: a preflight carries no credentials
        app.add_middleware(_Cors, origins=options.cors_origins)
    app.add_middleware(_CountRequests, metrics=metrics)
    _add_error_handlers(app)

    async def health():
        pool = engine.pool
        return {"status": "shutting_down" if pool.closed else "ok", "pid": os.getpid(),
                "workers": pool.options.workers, "busy": pool.busy, "queue_depth": pool.waiting}

    async def prometheus():
        return PlainTextResponse(metrics.render(engine.pool), media_type="text/plain; version=0.0.4; charset=utf-8")

    for path in ("/health", "/v1/health"):
        app.add_api_route(path, health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    for dialect in dialects():
        dialect.mount(app, engine, options)
    if options.webui:
        webui.mount(app, options.webui_dir)
    return app


class _WhileLoading:
    """llama-server's answer while its model loads: every request but the chat page's files gets 503 with
    ``{"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}`` until the engine has its
    pool. The port answers from the server's first moment, so a client polling /health sees the load under way."""

    def __init__(self, app, engine: Engine, open_paths: frozenset):
        self.app, self.engine, self.open_paths = app, engine, open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.engine.ready or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        await send_llama_error(send, 503, "Loading model", "unavailable_error", [(b"retry-after", b"1")])


def _error_shape(path: str):
    """The error writer of the dialect that owns ``path`` (OpenAI's shape unless a dialect claims the path)."""
    for dialect in dialects():
        owns = getattr(dialect, "owns_errors", None)
        if owns is not None and owns(path):
            return dialect.error_response
    return error_response


def _add_error_handlers(app: FastAPI) -> None:
    """Bad fields 400 (each named), HTTP errors as themselves, anything else 500: in the route's dialect."""

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_shape(request.url.path)(exc.status, exc.message, exc.param, exc.code, exc.kind, exc.headers(),
                                              extra=exc.extra)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = field_errors(exc)
        return _error_shape(request.url.path)(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_shape(request.url.path)(exc.status_code, str(exc.detail), kind=kind,
                                              headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def client_gone(request, exc):
        return _error_shape(request.url.path)(499, "client closed the request")

    @app.exception_handler(Exception)
    async def failure(request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error_shape(request.url.path)(500, f"internal error: {type(exc).__name__}: {exc}",
                                              kind="server_error")


PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # answered without an API key (llama-server's public endpoints)


async def send_llama_error(send, status: int, message: str, kind: str, headers: list) -> None:
    """A whole answer written by an ASGI middleware, in llama-server's error shape
    ``{"error": {"message", "type", "code"}}`` (``code``: the HTTP status), with ``headers`` beside its type."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"), *headers]})
    await send({"type": "http.response.body", "body": body})


class _RequireApiKey:
    """llama-server's ``--api-key``: a request whose ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) is not one
    of ``keys`` gets 401 with an ``authentication_error``, except on ``public`` paths and CORS preflights (browsers
    send no credentials with those). Keys are compared in constant time."""

    def __init__(self, app, keys: tuple, public: frozenset):
        self.app, self.keys, self.public = app, tuple(key.encode() for key in keys), public

    def _allowed(self, scope) -> bool:
        if scope["path"] in self.public or scope["method"] == "OPTIONS":
            return True
        headers = dict(scope["headers"])
        given = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        if given.startswith(b"Bearer "):
            given = given[len(b"Bearer "):]
        return any(hmac.compare_digest(given, key) for key in self.keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._allowed(scope):
            return await self.app(scope, receive, send)
        await send_llama_error(send, 401, "Invalid API Key", "authentication_error", [(b"www-authenticate", b"Bearer")])


CORS_METHODS = b"GET, POST, DELETE, OPTIONS"  # llama-server's defaults
CORS_HEADERS = b"*"


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # this machine's own addresses


def is_localhost_origin(origin: str) -> bool:
    """Whether a browser's Origin names a page served from this machine (localhost, 127.0.0.1, [::1])."""
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in LOCAL_HOSTS


class _Cors:
    """llama-server's CORS: answers a preflight (OPTIONS) itself with the allowed methods and headers, and names the
    allowed origin on every answer: the request's own when ``origins`` is "*" (credentials allowed, as llama-server),
    when it is a localhost page ("localhost"), or when it is in the comma list; none otherwise."""

    def __init__(self, app, origins: str):
        self.app, self.origins = app, origins
        self.listed = {origin.strip() for origin in origins.split(",")} - {"", "*", "localhost"}

    def allowed(self, origin: str) -> str | None:
        if not origin:
            return None
        if self.origins == "*" or origin in self.listed or (self.origins == "localhost" and is_localhost_origin(origin)):
            return origin
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = dict(scope["headers"]).get(b"origin", b"").decode("latin-1")
        allowed = self.allowed(origin)
        # the names as llama-server writes them: names are case-insensitive, but clients that read them from a plain
        # dict (llama-server's own tests do) look them up so; specdec serve's HTTP layer (h11) keeps the case given
        named = [(b"Access-Control-Allow-Origin", allowed.encode("latin-1")), (b"Vary", b"Origin")] if allowed else []
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 200, "headers": named + [
                (b"Access-Control-Allow-Credentials", b"true"), (b"Access-Control-Allow-Methods", CORS_METHODS),
                (b"Access-Control-Allow-Headers", CORS_HEADERS), (b"Content-Type", b"text/html"),
                (b"Content-Length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_origin(message):
            if message["type"] == "http.response.start" and named:
                message = {**message, "headers": list(message.get("headers", [])) + named}
            await send(message)

        await self.app(scope, receive, with_origin)


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
