"""A dialect is one module: a new file in ``serving/dialects`` that defines ``RANK`` and ``mount`` serves its routes
(and answers its errors in its own shape) with nothing else edited. Shown with a module written to a temporary
folder added to the package's search path, served in-process (no socket)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from package_extension import package_with  # noqa: E402

import specdec.serving.dialects as dialects  # noqa: E402

MODULE = '''
from fastapi.responses import JSONResponse

from specdec.serving.wire import APIError

RANK = 50


def owns_errors(path):
    return path.startswith("/echo")


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None, extra=None):
    return JSONResponse({"echo_error": message, "status": status}, status_code=status, headers=headers)


def mount(app, engine, server):
    async def echo(text: str = ""):
        if not text:
            raise APIError(400, "text must not be empty", param="text")
        return {"model": server.model_name, "echo": text, "tokens": len(engine.pool.decoder.codec.encode(text))}

    app.add_api_route("/echo", echo, methods=["GET"])
'''


def _app():
    from test_agents_server import scripted_chat_decoder

    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    pool = DecoderPool(scripted_chat_decoder(), PoolOptions(workers=1))
    return create_app(pool, ServerOptions(model_name="m", webui=False))


@pytest.fixture
def with_new_module(tmp_path, monkeypatch):
    with package_with(monkeypatch, dialects, dialects.dialects, tmp_path, {"echo_dialect.py": MODULE}):
        yield


def test_the_four_dialects_are_found_in_rank_order():
    dialects.dialects.cache_clear()
    names = [module.__name__.rsplit(".", 1)[1] for module in dialects.dialects()]
    assert names == ["openai", "responses", "anthropic", "llama"]  # llama_info / llama_slots: helpers, no RANK


def test_a_new_module_is_a_dialect_with_its_routes_and_error_shape(with_new_module):
    with TestClient(_app()) as client:
        answer = client.get("/echo", params={"text": "hello"})
        assert answer.status_code == 200
        assert answer.json()["model"] == "m" and answer.json()["echo"] == "hello" and answer.json()["tokens"] > 0
        bad = client.get("/echo")
        assert bad.status_code == 400 and bad.json() == {"echo_error": "text must not be empty", "status": 400}
        assert client.get("/v1/models").status_code == 200  # the other dialects still mount


def test_without_the_module_the_route_does_not_exist():
    dialects.dialects.cache_clear()
    with TestClient(_app()) as client:
        assert client.get("/echo", params={"text": "hello"}).status_code == 404
