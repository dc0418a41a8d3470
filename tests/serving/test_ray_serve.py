"""Ray Serve: two replicas of the OpenAI server on a local Ray instance (127.0.0.1, dashboard and usage stats off)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

MODEL = "tiny-chat"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_options_validated():
    """Bad replica settings are refused with the field named."""
    from specdec.serving.ray_serve import RayOptions

    from specdec.serving.app import LoadOptions, ServerOptions
    from specdec.serving.pool import PoolOptions

    server = ServerOptions(model_name="m")
    with pytest.raises(ValueError, match="replicas"):
        RayOptions(bundle="b", server=server, replicas=0)
    with pytest.raises(ValueError, match="max_replicas"):
        RayOptions(bundle="b", server=server, replicas=2, max_replicas=1)
    with pytest.raises(ValueError, match="cache_ram_mib"):
        LoadOptions(cache_ram_mib=-1)
    assert RayOptions(bundle="b", server=server, pool=PoolOptions(workers=2), replicas=1,
                      max_replicas=3).scaling() == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}}


def test_ctrl_c_while_deploying_stops_cleanly(monkeypatch):
    """Ctrl-C can land while ``serve.run`` still waits for the deployment (its replicas may already answer): it
    stops the server alike, removing the half-deployed application, exit 0. Planted: the interrupt escaped
    (exit 130, the application left behind)."""
    import ray
    from ray import serve

    from specdec.serving import ray_serve
    from specdec.serving.app import ServerOptions

    deleted = []

    def interrupted(options):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_serve, "start", interrupted)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(serve, "delete", deleted.append)
    try:
        code = ray_serve.serve_on_ray(ray_serve.RayOptions(bundle="b", server=ServerOptions(model_name="m")))
    except KeyboardInterrupt:  # not re-raised into pytest, which would stop the whole run
        pytest.fail("Ctrl-C while deploying escaped serve_on_ray")
    assert code == 0 and deleted == [ray_serve.APP_NAME]


def test_two_replicas_answer_like_the_decoder(chat_bundle):
    """`specdec serve --ray --replicas 2` on a local Ray instance (node address 127.0.0.1, dashboard and usage
    statistics off): both replicas answer the OpenAI routes and the chat page, greedy answers equal dec.generate /
    chat, and Ctrl-C stops everything. (~30-60 s on 2 loaded cores: Ray start, 2 replicas loading the bundle.)"""
    from specdec import SpeculativeDecoder
    from specdec.decoding.text.chat import chat

    decoder = SpeculativeDecoder.load(chat_bundle)
    prompts = [f"def g{i}(y):" for i in range(4)]
    expected = [decoder.generate(p, max_new_tokens=16).text for p in prompts]
    messages = [{"role": "user", "content": "hi"}]
    expected_chat = chat(decoder, messages, max_new_tokens=12).text
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "specdec.cli.main", "serve", str(chat_bundle), "--ray", "--replicas", "2",
         "--cpus-per-replica", "0.5", "--host", "127.0.0.1", "--port", str(port), "--model-name", MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 150
        pids = set()
        while len(pids) < 2 and time.monotonic() < deadline:  # bounded: until both replicas have answered
            assert process.poll() is None, process.stdout.read()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(f"{url}/health", timeout=5)
                if health.status_code == 200:
                    pids.add(health.json()["pid"])
            time.sleep(0.2)
        assert len(pids) == 2, f"replicas seen: {pids}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answers = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
                   for p in prompts]
        assert answers == expected
        streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_chat
        bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", "n": 3}, timeout=10)
        assert bad.status_code == 400 and "n=1" in bad.json()["error"]["message"]
        page = httpx.get(f"{url}/", timeout=10)  # the chat page: the replicas build the same app
        assert page.status_code == 200 and "/webui/app.js" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            # removing the application and stopping Ray took over 60 s once in a full run on 2 loaded cores
            process.wait(timeout=150)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack: where it hung
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
    if process.returncode != 0:
        output = process.stdout.read() if process.stdout else ""
        raise AssertionError(f"Ctrl-C did not stop the Ray server within 150 s (exit {process.returncode}); "
                             f"its last output:\n{output[-12000:]}")
