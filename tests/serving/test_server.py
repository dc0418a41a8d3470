"""The OpenAI-compatible server: real clients against a live `specdec serve`, and the pool's mechanics.

Everything listens on and talks to 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from served_app import served_app

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

MODEL = "tiny-chat"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process=None, seconds: float = 90.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"server exited: {process.stderr.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"server at {url} not healthy within {seconds}s")


@pytest.fixture(scope="module")
def decoder(chat_bundle):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder.load(chat_bundle)


@contextlib.contextmanager
def _specdec_serve(bundle, *flags):
    """`specdec serve BUNDLE FLAGS` in a subprocess on 127.0.0.1, healthy; yields (base url, process); SIGINT (then
    kill) on the way out."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli.main", "serve", str(bundle), "--host", "127.0.0.1", "--port", str(port),
         *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def served(chat_bundle):
    """`specdec serve` in a subprocess on 127.0.0.1 (2 workers, 4 waiting, OpenAI's strict model names); yields
    (base url, process)."""
    with _specdec_serve(chat_bundle, "--workers", "2", "--max-queue", "4", "--model-name", MODEL,
                        "--shutdown-grace", "5", "--strict-model-name") as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_health_metrics(served):
    """/v1/models names the served model; /health is ok; /metrics is Prometheus text with the pool gauges."""
    url = served[0]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    text = httpx.get(f"{url}/metrics").text
    assert "# TYPE specdec_queue_depth gauge" in text and "specdec_workers 2" in text
    assert "# TYPE specdec_suffix_cache_tokens gauge" in text  # the default suffix store, shared by the workers
    assert "specdec_draft_session_open 1" in text and "specdec_draft_session_closes_total 0" in text


def test_openai_client_chat_equals_in_process(client, decoder):
    """Greedy chat through the official client (plain and streamed) is dec.chat's text, with its token counts."""
    from specdec.decoding.text.chat import chat, chat_prompt

    expected = chat(decoder, MESSAGES, max_new_tokens=20)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == len(chat_prompt(decoder, MESSAGES).ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert 0.0 <= reply.model_extra["specdec"]["acceptance_rate"] <= 1.0
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].model_extra["timings"]["predicted_n"] == len(expected.token_ids)  # llama-server's timings


def test_openai_client_completions_equal_generate(client, decoder):
    """Greedy /v1/completions (plain and streamed) equals dec.generate, stop strings included."""
    prompt = "def fib(n):"
    expected = decoder.generate(prompt, max_new_tokens=24)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    stop = expected.text[5:7]
    if stop:
        cut = decoder.generate(prompt, max_new_tokens=24, stop=[stop])
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (cut.text, "stop")


def test_extensions_and_seeded_sampling(client, decoder):
    """specdec fields (top_k, min_p, repetition_penalty, num_draft_tokens, proposer, tree) reach the decoder."""
    from specdec import SamplingConfig

    options = dict(top_k=5, min_p=0.01, repetition_penalty=1.1, num_draft_tokens=3, proposer="draft")
    expected = decoder.generate("x = ", max_new_tokens=16, seed=7,
                                sampling=SamplingConfig(temperature=0.8, top_p=0.9, top_k=5, min_p=0.01,
                                                        repetition_penalty=1.1), num_draft_tokens=3,
                                proposer="draft")
    reply = client.completions.create(model=MODEL, prompt="x = ", max_tokens=16, temperature=0.8, top_p=0.9,
                                      seed=7, extra_body=options)
    assert reply.choices[0].text == expected.text
    tree = client.completions.create(model=MODEL, prompt="x = ", max_tokens=16, temperature=0,
                                     extra_body={"tree": [2, 1]})
    assert tree.choices[0].text == decoder.generate("x = ", max_new_tokens=16).text


def _post(url, payload, path="/v1/chat/completions", raw=None):
    return httpx.post(f"{url}{path}", content=raw if raw is not None else json.dumps(payload),
                      headers={"Content-Type": "application/json"}, timeout=30)


BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("payload, raw, status, named", [
    (None, "{not json", 400, ["not valid JSON"]),
    ({**BASE, "temperature": "hot", "max_tokens": "5"}, None, 400, ["temperature", "max_tokens"]),
    ({**BASE, "temperature": 3.0, "top_p": 0}, None, 400, ["temperature", "top_p"]),
    ({**BASE, "top_k": -1, "num_draft_tokens": 99}, None, 400, ["top_k", "num_draft_tokens"]),
    ({**BASE, "best_of": 2, "logprobs_x": 1}, None, 400, ["best_of: unknown field", "logprobs_x: unknown field"]),
    ({**BASE, "logit_bias": {"5": 200}}, None, 400, ["logit_bias values must be numbers in -100..100"]),
    ({**BASE, "logit_bias": {"5": "x"}}, None, 400, ["logit_bias"]),
    ({**BASE, "n": 9}, None, 400, ["n: Input should be less than or equal to 8"]),
    ({**BASE, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, ["messages.0.role"]),
    ({**BASE, "messages": []}, None, 400, ["messages"]),
    ({**BASE, "max_tokens": 10_000}, None, 400, ["context"]),
    ({**BASE, "messages": [{"role": "user", "content": "y" * 600}]}, None, 400, ["context"]),
    ({**BASE, "model": "gpt-4"}, None, 404, ["gpt-4"]),
    # the decoder's own checks (make_request), in the client's field names
    ({**BASE, "max_tokens": -1}, None, 400, ["max_tokens must be"]),
    ({**BASE, "tree": [2, 1], "proposer": "lookup"}, None, 400, ["tree", "proposer"]),
    ({**BASE, "max_tokens": None, "max_completion_tokens": 10_000}, None, 400, ["max_completion_tokens: ", "context"]),
])
def test_bad_requests_named(served, payload, raw, status, named):
    """Each malformed request gets the right status and an OpenAI error naming every bad field."""
    response = _post(served[0], payload, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    for word in named:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("payload, param, code", [
    ({**BASE, "max_tokens": -1}, "max_tokens", None),
    ({**BASE, "tree": [2, 1], "proposer": "lookup"}, "tree", None),
    ({**BASE, "max_tokens": 10_000}, "max_tokens", "context_length_exceeded"),
    ({**BASE, "max_tokens": None, "messages": [{"role": "user", "content": "y" * 600}]}, "messages",
     "context_length_exceeded"),
])
def test_decoder_checks_name_the_param(served, payload, param, code):
    """What only the decoder checks (make_request: the budget, the context, tree + proposer) comes back as a
    400 whose ``param`` is the client's field, with OpenAI's context_length_exceeded code for an overflow."""
    response = _post(served[0], payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_bad_completion_prompt_and_client_error(served, client):
    """The official client raises BadRequestError / NotFoundError with the server's message."""
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="a", max_tokens=4)
    response = _post(served[0], {"model": MODEL, "prompt": [500], "max_tokens": 2}, path="/v1/completions")
    assert response.status_code == 400 and "token ids" in response.json()["error"]["message"]


def test_concurrent_clients_more_than_workers(served, decoder):
    """6 concurrent clients on 2 workers (4 may wait) each get their own prompt's greedy completion."""
    prompts = [f"def f{i}(x):" for i in range(6)]
    expected = [decoder.generate(p, max_new_tokens=24).text for p in prompts]
    answers = [None] * len(prompts)

    def ask(index):
        local = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60)
        answers[index] = local.completions.create(model=MODEL, prompt=prompts[index], max_tokens=24,
                                                  temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert answers == expected


# ----------------------------------------------------------------------------- in-process server, slow decoder
class SlowDecoder:
    """A decoder whose stream sleeps after each piece: long generations on a tiny model, for pool mechanics."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def fork(self):
        return SlowDecoder(self.inner.fork(), self.delay)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, *args, **kwargs):
        return SlowStream(self.inner.stream(*args, **kwargs), self.delay)


class SlowStream:
    """The decoder's TextStream, sleeping after each piece; ``close``, ``finish``, ``output`` pass through."""

    def __init__(self, stream, delay: float):
        self.stream, self.delay = stream, delay

    def __iter__(self):
        return self

    def __next__(self):
        piece = next(self.stream)
        time.sleep(self.delay)
        return piece

    def close(self):
        self.stream.close()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.fixture
def slow_server(decoder):
    """One worker, no waiting room, a stream that takes ~10 s unless cancelled."""
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    pool = DecoderPool(SlowDecoder(decoder.fork(), 0.05), PoolOptions(workers=1, max_queue=0))
    with served_app(create_app(pool, ServerOptions(model_name=MODEL, shutdown_grace=1.0))) as (url, server):
        yield url, pool, server


LONG = {"model": MODEL, "prompt": "a", "max_tokens": 200, "temperature": 0, "stream": True}


def _busy(url) -> int:
    return httpx.get(f"{url}/health", timeout=5).json()["busy"]


def _wait(condition, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_full_queue_429_and_disconnect_frees_the_worker(slow_server, decoder):
    """With the one worker streaming, a second request gets 429 + Retry-After; when the streaming client
    disconnects, its generation is cancelled, the worker is free again and the next request is answered."""
    url, pool, _ = slow_server
    with httpx.Client(timeout=30) as streaming:
        with streaming.stream("POST", f"{url}/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            busy = _post(url, {**LONG, "stream": False, "max_tokens": 2}, path="/v1/completions")
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
            assert "busy" in busy.json()["error"]["message"]
        # leaving the block closes the connection mid-stream
    assert _wait(lambda: _busy(url) == 0, seconds=5), "the disconnected stream still holds the worker"
    assert pool.cancelled_jobs == 1
    answer = _post(url, {**LONG, "stream": False, "max_tokens": 3}, path="/v1/completions")
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == decoder.generate("a", max_new_tokens=3).text
    assert "specdec_cancelled_total 1" in httpx.get(f"{url}/metrics").text


def test_non_streaming_client_that_gives_up_frees_the_worker(slow_server):
    """A non-streaming client that times out and closes its connection cancels the generation too."""
    url, pool, _ = slow_server
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json={**LONG, "stream": False}, timeout=1.0)
    assert _wait(lambda: _busy(url) == 0, seconds=5), "the abandoned request still holds the worker"
    assert pool.cancelled_jobs == 1


def test_shutdown_cancels_what_outlives_the_grace(slow_server):
    """Shutdown waits the grace period, then cancels the running stream; the pool's worker ends."""
    url, pool, server = slow_server
    seen = []

    def consume():
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=30) as response:
                for line in response.iter_lines():
                    seen.append(line)

    reader = threading.Thread(target=consume)
    reader.start()
    assert _wait(lambda: len(seen) > 1, seconds=10)
    started = time.monotonic()
    server.should_exit = True
    reader.join(timeout=20)
    assert not reader.is_alive() and time.monotonic() - started < 8  # ~1 s grace, not the 10 s stream
    assert _wait(lambda: pool.closed and pool.busy == 0, seconds=10)
    assert not any("[DONE]" in line for line in seen)  # cancelled, not silently completed


def test_sigterm_lets_a_short_request_finish(served):
    """SIGTERM: an in-flight short stream still completes ([DONE]); the process exits within the grace."""
    url, process = served
    lines = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                      json={**BASE, "max_tokens": 30, "stream": True}) as response:
        iterator = response.iter_lines()
        lines.append(next(iterator))
        process.send_signal(signal.SIGTERM)
        lines.extend(iterator)
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]
    process.wait(timeout=20)


def test_pool_shares_sessions_and_bounds_the_queue(decoder):
    """Workers are forks sharing one set of onnxruntime sessions; submissions beyond workers + max_queue
    raise PoolBusy; options are validated."""
    import asyncio

    from specdec.serving.pool import END, DecoderPool, PoolBusy, PoolOptions

    with pytest.raises(ValueError, match="workers"):
        PoolOptions(workers=0)
    with pytest.raises(ValueError, match="max_queue"):
        PoolOptions(max_queue=-1)
    pool = DecoderPool(decoder.fork(), PoolOptions(workers=2, max_queue=1))
    try:
        first, second = pool.decoders
        assert first.target.session is second.target.session and first.draft.session is second.draft.session
        assert first.target is not second.target  # own caches
        release = threading.Event()

        def blocked(dec):
            release.wait(timeout=10)
            yield dec is not None

        async def scenario():
            jobs = [pool.submit(blocked) for _ in range(3)]
            with pytest.raises(PoolBusy):
                pool.submit(blocked)
            release.set()
            return [[await job.get(), await job.get()] for job in jobs]

        assert asyncio.run(asyncio.wait_for(scenario(), timeout=20)) == [[True, END]] * 3
    finally:
        pool.close(grace=5)


def test_api_key_guards_every_route_but_health_and_the_page(decoder):
    """llama-server's --api-key: no key or a wrong one is 401 (authentication_error) on the API, /metrics and the
    slots; /health, the chat page's files and CORS preflights stay open; Bearer and x-api-key both work; a
    request without a ``model`` field is served (llama-server requires none)."""
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    pool = DecoderPool(decoder.fork(), PoolOptions(workers=1))
    options = ServerOptions(model_name=MODEL, api_keys=("sk-one", "sk-two"))
    with served_app(create_app(pool, options)) as (url, _):
        body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-on"}, {"x-api-key": "x"}):
            for method, path, payload in (("POST", "/v1/chat/completions", body), ("GET", "/v1/models", None),
                                          ("GET", "/metrics", None), ("POST", "/completion", {"prompt": "a"}),
                                          ("GET", "/slots", None), ("GET", "/props", None)):
                answer = httpx.request(method, url + path, json=payload, headers=headers, timeout=30)
                assert answer.status_code == 401, (path, headers)
                assert answer.json()["error"]["type"] == "authentication_error"
        for path in ("/health", "/v1/health", "/", "/webui/app.js"):
            assert httpx.get(url + path, timeout=30).status_code in (200, 404), path
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert httpx.get(url + "/", timeout=30).status_code == 200
        assert httpx.options(url + "/v1/chat/completions", timeout=30).status_code != 401
        for headers in ({"Authorization": "Bearer sk-one"}, {"Authorization": "sk-two"}, {"x-api-key": "sk-two"}):
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert answer.status_code == 200 and answer.json()["model"] == MODEL
        answer = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-one", max_retries=0).models.list()
        assert [m.id for m in answer.data] == [MODEL]
    with pytest.raises(ValueError, match="API keys"):
        ServerOptions(model_name=MODEL, api_keys=(" sk",))


def test_ctx_size_is_split_between_the_workers_as_llama_server_s():
    import argparse

    from specdec.cli.serve import worker_context

    args = lambda **given: argparse.Namespace(**{"ctx_size": None, "max_context": None, "workers": 1, **given})  # noqa: E731
    assert worker_context(args(ctx_size=32768, workers=2)) == 16384
    assert worker_context(args(max_context=4096, workers=2)) == 4096 and worker_context(args()) is None
    with pytest.raises(ValueError, match="give one"):
        worker_context(args(ctx_size=100, max_context=100))
    with pytest.raises(ValueError, match="fewer than 2"):
        worker_context(args(ctx_size=3, workers=2))


def test_serve_reads_api_keys_from_flags_and_a_file(tmp_path):
    import argparse

    from specdec.cli.serve import api_keys

    keys = tmp_path / "keys"
    keys.write_text("sk-file\n\n sk-two \n")
    args = argparse.Namespace(api_key=["sk-a,sk-b", "sk-a"], api_key_file=str(keys))
    assert api_keys(args) == ("sk-a", "sk-b", "sk-file", "sk-two")
    assert api_keys(argparse.Namespace(api_key=None, api_key_file=None)) == ()
    with pytest.raises(ValueError, match="no key"):
        api_keys(argparse.Namespace(api_key=[" , "], api_key_file=None))
    with pytest.raises(ValueError, match="--api-key-file"):
        api_keys(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "missing")))


def test_llama_server_flags_and_several_hosts(chat_bundle):
    """llama-server's spellings (-np, --alias, -c, --no-ui) and a comma list of --host addresses: one server
    answering on each (127.0.0.1 and localhost; an empty address is a one-line error)."""
    from specdec.cli.serve import host_list

    assert host_list("127.0.0.1, localhost,127.0.0.1") == ["127.0.0.1", "localhost"]
    with pytest.raises(ValueError, match="empty address"):
        host_list("127.0.0.1,")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        hosts = ["127.0.0.1", "localhost", "[::1]"]  # localhost is 127.0.0.1 here: one socket for both
    except OSError:  # no IPv6 loopback on this machine
        hosts = ["127.0.0.1", "localhost"]
    # the later --host wins over the helper's 127.0.0.1
    with _specdec_serve(chat_bundle, "--host", ",".join(host.strip("[]") for host in hosts), "-np", "2",
                        "--alias", "llama-name", "-c", "256", "--no-ui") as (url, _):
        port = url.rsplit(":", 1)[1]
        for host in hosts:
            assert httpx.get(f"http://{host}:{port}/health", timeout=10).json()["workers"] == 2
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"] == "llama-name"
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port}/props", timeout=10).json()["default_generation_settings"][
            "n_ctx"] == 128  # llama-server's -c: the context split between the 2 workers


@pytest.mark.parametrize("origins, origin, allowed", [
    ("localhost", "http://localhost:8080", True), ("localhost", "http://[::1]:3000", True),
    ("localhost", "http://127.0.0.1", True), ("localhost", "http://localhost.evil.com", False),
    ("localhost", "http://evil.com", False), ("*", "http://web.mydomain.fr", True),
    ("http://a.example,http://b.example", "http://b.example", True),
    ("http://a.example,http://b.example", "http://c.example", False), ("", "http://localhost", False)])
def test_cors_as_llama_server(decoder, origins, origin, allowed):
    """A preflight is answered without a key (browsers send none) with llama-server's methods and headers; every
    answer names the origin when it is allowed (default: pages of this machine only) and none otherwise."""
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    pool = DecoderPool(decoder.fork(), PoolOptions(workers=1))
    with served_app(create_app(pool, ServerOptions(model_name=MODEL, api_keys=("sk",), cors_origins=origins))) as (
            url, _):
        preflight = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization"}, timeout=30)
        named = preflight.headers.get("access-control-allow-origin")
        if not origins:
            assert preflight.status_code == 405 and named is None  # no CORS at all: no route answers a preflight
            return
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-methods"] == (
            "GET, POST, DELETE, OPTIONS")
        assert named == (origin if allowed else None)
        answer = httpx.get(url + "/v1/models", headers={"Origin": origin, "Authorization": "Bearer sk"}, timeout=30)
        assert answer.status_code == 200 and answer.headers.get("access-control-allow-origin") == named


@pytest.fixture(scope="module")
def llama_client_server(chat_bundle):
    """Its own `specdec serve` (the module's ``served`` is stopped by the SIGTERM test)."""
    with _specdec_serve(chat_bundle, "--model-name", MODEL) as served:
        yield served


def test_cors_header_names_are_written_as_llama_servers(llama_client_server):
    """`specdec serve` writes the CORS names in llama-server's case (its h11 layer keeps them; httptools would lower
    them): clients that look them up case-sensitively, as llama-server's own tests do, find them."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(llama_client_server[0])
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost\r\n"
                     b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := sock.recv(4096):
            raw += chunk
    head = raw.split(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200")
    for name in (b"Access-Control-Allow-Origin: http://localhost", b"Access-Control-Allow-Methods: ",
                 b"Access-Control-Allow-Headers: *", b"Access-Control-Allow-Credentials: true"):
        assert b"\r\n" + name in head, head


def test_llama_server_extensions_on_openai_routes(llama_client_server, decoder):
    """What llama-server's clients read besides OpenAI's fields: logit_bias (ids; text keys as their tokens; false
    bans), system_fingerprint, /apply-template and the prompt's token count, and a context overflow's counts (its
    exceed_context_size_error type on the un-prefixed route, OpenAI's shape on /v1)."""
    from specdec import SamplingConfig

    url = llama_client_server[0]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert plain["system_fingerprint"].startswith("b")
    completion = {"prompt": "def add(a, b):", "n_predict": 12, "temperature": 0, "return_tokens": True}
    emitted = httpx.post(f"{url}/completion", json=completion, timeout=60).json()["tokens"]
    banned = sorted(set(emitted))[:3]
    text_of = {t: decoder.codec.decode([t]) for t in set(emitted)}
    words = [t for t, text in text_of.items() if text and decoder.codec.encode(text, special=False) == [t]][:3]
    for bias in ([[t, False] for t in banned], {str(t): -100 for t in banned},
                 [[text_of[t], False] for t in words]):
        if not bias:
            continue  # no token of this output reads back as itself from its text
        banned_here = words if isinstance(bias, list) and isinstance(bias[0][0], str) else banned
        again = httpx.post(f"{url}/completion", json={**completion, "logit_bias": bias}, timeout=60).json()["tokens"]
        assert again != emitted and not set(again) & set(banned_here), bias
    config = SamplingConfig(logit_bias={t: -100 for t in banned})
    expected = decoder.chat(MESSAGES, max_new_tokens=12, sampling=config).text
    biased = httpx.post(f"{url}/v1/chat/completions", json={**body, "logit_bias": {str(t): -100 for t in banned}},
                        timeout=60).json()["choices"][0]["message"]["content"]
    assert biased == expected
    prompt = httpx.post(f"{url}/apply-template", json={"messages": MESSAGES}, timeout=30).json()["prompt"]
    assert "def add(a, b):" in prompt and "be brief" in prompt
    prefilled = MESSAGES + [{"role": "assistant", "content": "def add(a, b):"}]  # a prefill: continued
    prompt_of = lambda extra: httpx.post(f"{url}/apply-template", json={"messages": prefilled, **extra},  # noqa: E731
                                         timeout=30).json()["prompt"]
    assert prompt_of({}).endswith("assistant\ndef add(a, b):")
    assert prompt_of({"add_generation_prompt": False, "continue_final_message": True}) == prompt_of({})
    assert prompt_of({"continue_final_message": False}).endswith("assistant\n")
    continued = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": prefilled},
                           timeout=60).json()["choices"][0]["message"]["content"]
    assert continued == decoder.chat(prefilled, max_new_tokens=12).text
    both = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": prefilled, "add_generation_prompt": True,
                                                           "continue_final_message": True}, timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    counted = httpx.post(f"{url}/chat/completions/input_tokens", json={"messages": MESSAGES}, timeout=30).json()
    assert counted["input_tokens"] == len(decoder.codec.encode(prompt, special=False))
    long = {"messages": MESSAGES * 400, "max_tokens": 4}
    error = httpx.post(f"{url}/chat/completions", json=long, timeout=60).json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_prompt_tokens"] > error["n_ctx"] > 0
    error = httpx.post(f"{url}/v1/chat/completions", json={**long, "model": MODEL}, timeout=60).json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
