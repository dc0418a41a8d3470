"""An OpenAI-compatible HTTP server over a DecoderPool (FastAPI; the ``[serve]`` extra): the wiring.

Routes: ``/v1/models``, ``/v1/completions`` (with ``suffix``: fill-in-the-middle), ``/v1/chat/completions``
(``stream: true`` as server-sent events), llama-server's ``/infill``, ``/health``, ``/metrics`` (Prometheus
text). Every error is OpenAI-shaped JSON (``{"error":
{"message", "type", "param", "code"}}``): 400 for bad input (each bad field named), 404 for an unknown
model, 429 (queue full) / 503 (shutting down) with ``Retry-After``. Generation runs in the pool's worker
threads; a client that goes away cancels its job.

``build_app`` is the one load -> pool -> app path (``specdec serve`` and each Ray Serve replica);
``create_app`` mounts the handlers (handlers.py) over a pool. The wire shapes are protocol.py's.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.serving.handlers import Chat, Completions, Infill, Info
from specdec.serving.metrics import Metrics
from specdec.serving.pool import DecoderPool, PoolOptions
from specdec.serving.protocol import APIError, ClientGone, error_response, field_errors

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class LoadOptions:
    """``SpeculativeDecoder.load``'s arguments besides the bundle."""
    provider: str = "cpu"
    max_context: int | None = None
    threads: int | None = None
    verify: bool = True
    cache_ram_mib: float = 0  # a prompt cache in host RAM shared by the pool's workers (0: none)
    suffix_cache_mib: float | None = None  # recent outputs for suffix proposals (None: the decoder's default)
    exact_rows: bool = False  # one-token target passes as two rows (greedy identity on every CPU)

    def load_kwargs(self) -> dict:
        kwargs = dict(provider=self.provider, max_context=self.max_context, threads=self.threads, verify=self.verify)
        if self.exact_rows:
            kwargs["exact_rows"] = True
        if self.cache_ram_mib:
            kwargs["cache_ram_mib"] = self.cache_ram_mib
        if self.suffix_cache_mib is not None:
            kwargs["suffix_cache_mib"] = self.suffix_cache_mib
        return kwargs


def build_app(bundle, server: ServerOptions, pool: PoolOptions | None = None,
              load: LoadOptions | None = None) -> FastAPI:
    """Load ``bundle``, fork a pool of its decoders, and the app serving it: ``specdec serve``'s and each Ray
    replica's one path from a bundle to an app."""
    from specdec.decoding.decoder import SpeculativeDecoder

    load = load or LoadOptions()
    decoder = SpeculativeDecoder.load(bundle, **load.load_kwargs())
    log.info("loaded %s (max_context %d, provider %s)", bundle, decoder.max_context, load.provider)
    return create_app(DecoderPool(decoder, pool or PoolOptions()), server)


def create_app(pool: DecoderPool, options: ServerOptions) -> FastAPI:
    """The FastAPI app serving ``pool`` under the OpenAI routes; closing the app closes the pool."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(pool.close, options.shutdown_grace)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.add_middleware(_CountRequests, metrics=metrics)
    _add_error_handlers(app)

    info, completions, chat, infill = (Info(pool, options, metrics), Completions(pool, options, metrics),
                                       Chat(pool, options, metrics), Infill(pool, options, metrics))
    app.add_api_route("/health", info.health, methods=["GET"])
    app.add_api_route("/metrics", info.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", info.models, methods=["GET"])
    app.add_api_route("/v1/models/{model}", info.model, methods=["GET"])
    app.add_api_route("/v1/completions", completions.create, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.create, methods=["POST"])
    app.add_api_route("/infill", infill.create, methods=["POST"])  # llama-server's fill-in-the-middle
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error OpenAI-shaped: bad fields 400 (each named), HTTP errors as themselves, anything else 500."""

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
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


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
