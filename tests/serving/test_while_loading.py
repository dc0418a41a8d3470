"""While the bundle loads, the server answers as llama-server does: every route 503 "Loading model" (the chat page's
files excepted), the API key checked first; once the pool is attached, the routes answer. A load that fails after
the port opened ends ``specdec serve`` with its one-line error and exit 2."""

from __future__ import annotations

import pytest
from served_app import failing_load

pytest.importorskip("fastapi")

LOADING = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}


class _Pool:
    """What /health reads of a pool."""

    closed, busy, waiting = False, 0, 0

    class options:
        workers = 1

    def close(self, grace):
        pass


def _client(**options):
    from fastapi.testclient import TestClient

    from specdec.serving.app import ServerOptions, create_app

    app = create_app(None, ServerOptions(model_name="m", **options))
    return app, TestClient(app)


def test_every_route_answers_loading_model_until_the_pool_is_attached():
    app, client = _client()
    for method, path in (("GET", "/health"), ("GET", "/v1/health"), ("GET", "/v1/models"), ("POST", "/completion"),
                         ("POST", "/v1/chat/completions"), ("GET", "/metrics")):
        answer = client.request(method, path, json={})
        assert answer.status_code == 503 and answer.json() == LOADING, (method, path)
        assert answer.headers["retry-after"] == "1"
    assert client.get("/").status_code == 200  # the chat page loads, as llama-server's front end does
    app.state.engine.attach(_Pool())
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_api_key_is_checked_before_the_loading_answer():
    _, client = _client(api_keys=("k",))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 503
    assert client.get("/health").status_code == 503  # public, so the loading answer


def test_a_folder_that_is_no_bundle_fails_before_the_port_opens_in_one_line(monkeypatch, capsys, tmp_path):
    from specdec.cli import serve
    from specdec.cli.main import main

    monkeypatch.setattr(serve, "_show_logs", lambda: None)
    assert main(["serve", str(tmp_path), "--host", "127.0.0.1", "--port", "0", "--no-webui"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: ") and "manifest" in err


def test_a_load_that_fails_later_ends_the_server_with_its_error_last_and_exit_2(monkeypatch, capsys, tmp_path):
    from specdec.cli import serve
    from specdec.cli.main import main
    from specdec.decoding import load_options

    monkeypatch.setattr(serve, "_show_logs", lambda: None)
    failure = ValueError("the target's session could not be made")
    monkeypatch.setattr(load_options, "BackgroundLoad", failing_load(failure))
    assert main(["serve", str(tmp_path), "--host", "127.0.0.1", "--port", "0", "--no-webui"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "specdec: error: the target's session could not be made"
