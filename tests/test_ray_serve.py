"""Ray Serve: two replicas of the OpenAI server on a local Ray instance (127.0.0.1, dashboard and usage stats off)."""

from __future__ import annotations

import contextlib
import os
import socket
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
    from specdec.runtime.ray_serve import RayOptions

    with pytest.raises(ValueError, match="replicas"):
        RayOptions(bundle="b", model_name="m", replicas=0)
    with pytest.raises(ValueError, match="max_replicas"):
        RayOptions(bundle="b", model_name="m", replicas=2, max_replicas=1)
    assert RayOptions(bundle="b", model_name="m", replicas=1, max_replicas=3, workers=2).scaling() == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}}


def test_two_replicas_answer_like_the_decoder(chat_bundle, monkeypatch):
    """On a local Ray instance, 2 replicas serve the OpenAI routes; greedy answers equal dec.generate/chat.
    (~30 s on 2 loaded cores: Ray start, 2 replicas loading the bundle.)"""
    import ray
    from ray import serve

    from specdec import SpeculativeDecoder
    from specdec.runtime.chat import chat
    from specdec.runtime.ray_serve import RayOptions, start

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    decoder = SpeculativeDecoder.load(chat_bundle)
    prompts = [f"def g{i}(y):" for i in range(4)]
    expected = [decoder.generate(p, max_new_tokens=16).text for p in prompts]
    messages = [{"role": "user", "content": "hi"}]
    expected_chat = chat(decoder, messages, max_new_tokens=12).text
    port = _free_port()
    options = RayOptions(bundle=str(chat_bundle), model_name=MODEL, host="127.0.0.1", port=port, replicas=2,
                         cpus_per_replica=0.5)
    try:
        start(options, num_cpus=2, object_store_memory=128 * 1024 * 1024)
        status = serve.status().applications["specdec"]
        replicas = status.deployments["SpecdecReplica"].replica_states
        assert replicas.get("RUNNING") == 2, replicas
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        answers = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
                   for p in prompts]
        assert answers == expected
        streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_chat
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "ok"
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "a", "n": 3},
                         timeout=10)
        assert bad.status_code == 400 and "n=1" in bad.json()["error"]["message"]
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
