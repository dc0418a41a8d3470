"""What a user moving from llama-server expects of the server: cached prompt tokens in usage, warm-up requests,
routing to the worker that holds the prompt, llama-server's /infill (and /v1/completions' suffix), the prompt
cache in /metrics, ``--cache-ram``. In-process servers on 127.0.0.1 only; every loop bounded."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time

import pytest
from served_app import failing_load, served_app

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

MODEL = "tiny-fim"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


def _supports_cache_ram() -> bool:
    from specdec.decoding.decoder import SpeculativeDecoder

    return "cache_ram_mib" in inspect.signature(SpeculativeDecoder.load).parameters


@pytest.fixture(scope="module")
def reference(fim_bundle):
    """A decoder of its own: the expected answers, computed cold."""
    from specdec.decoding.decoder import SpeculativeDecoder

    return SpeculativeDecoder.load(fim_bundle)


@pytest.fixture(scope="module")
def served(fim_bundle):
    """build_app over the FIM bundle: 2 workers, a prompt cache when the decoder has one; yields (url, app)."""
    from specdec.serving.app import LoadOptions, ServerOptions, build_app
    from specdec.serving.pool import PoolOptions

    load = LoadOptions(cache_ram_mib=8 if _supports_cache_ram() else 0)
    app = build_app(fim_bundle, ServerOptions(model_name=MODEL, shutdown_grace=1.0), PoolOptions(workers=2), load)
    with served_app(app) as (url, _):
        yield url


def _post(url, path, payload, raw=None):
    return httpx.post(f"{url}{path}", content=raw if raw is not None else json.dumps(payload),
                      headers={"Content-Type": "application/json"}, timeout=60)


def _sse(url, path, payload) -> list:
    with httpx.stream("POST", f"{url}{path}", json=payload, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[5:]) for line in response.iter_lines()
                if line.startswith("data:") and line != "data: [DONE]"]


# ----------------------------------------------------------------------------- model names, routes without /v1
def test_any_model_name_is_the_served_model_and_routes_answer_without_v1(served):
    """As llama-server: with one model served, a request naming another model (an agent configured for a hosted
    one) is answered, and the reply names the served id; /models and /chat/completions answer without /v1."""
    body = {"model": "claude-opus-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0}
    for path in ("/v1/chat/completions", "/chat/completions"):
        reply = _post(served, path, body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == MODEL
    for path in ("/v1/models", "/models"):
        assert [card["id"] for card in httpx.get(f"{served}{path}", timeout=10).json()["data"]] == [MODEL]


def test_strict_model_names_and_aliases():
    """--strict-model-name: OpenAI's 404 for a name not served; aliases are listed and answered."""
    from specdec.serving.app import ServerOptions
    from specdec.serving.wire import APIError

    options = ServerOptions(model_name="m", aliases=("alias", "m"), strict_model=True)
    assert options.model_names == ("m", "alias") and options.answer_model("alias") == "m"
    with pytest.raises(APIError, match="does not exist") as info:
        options.answer_model("gpt-4")
    assert info.value.status == 404 and info.value.param == "model"
    assert ServerOptions(model_name="m").answer_model("gpt-4") == "m"


# ----------------------------------------------------------------------------- cached tokens, warm-up
def test_warm_up_then_cached_tokens_in_usage(served, reference):
    """max_tokens=0 prefills and answers at once (empty, "length"); the next request on the same messages
    reports the reused prompt tokens as usage.prompt_tokens_details.cached_tokens (plain and streamed) and
    answers exactly what a cold decoder does."""
    from specdec.decoding.text.chat import chat, chat_prompt

    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0}
    warm = _post(served, "/v1/chat/completions", {**body, "max_tokens": 0})
    assert warm.status_code == 200, warm.text
    warm = warm.json()
    assert warm["choices"][0]["message"]["content"] == "" and warm["choices"][0]["finish_reason"] == "length"
    prompt_tokens = len(chat_prompt(reference, MESSAGES).ids)
    assert warm["usage"]["completion_tokens"] == 0 and warm["usage"]["prompt_tokens"] == prompt_tokens
    assert "prompt_tokens_details" in warm["usage"]

    expected = chat(reference, MESSAGES, max_new_tokens=12)
    reply = _post(served, "/v1/chat/completions", {**body, "max_tokens": 12}).json()
    assert reply["choices"][0]["message"]["content"] == expected.text
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < prompt_tokens  # the last prompt token is always fed by the first round
    assert reply["specdec"]["cached_tokens"] == cached

    chunks = _sse(served, "/v1/chat/completions", {**body, "max_tokens": 12, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected.text
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_completions_warm_up_and_cached_tokens(served, reference):
    prompt = "def fib(n):\n    "
    warm = _post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0}).json()
    assert warm["choices"][0]["text"] == "" and warm["usage"]["completion_tokens"] == 0
    reply = _post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10,
                                              "temperature": 0}).json()
    assert reply["choices"][0]["text"] == reference.generate(prompt, max_new_tokens=10).text
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_metrics_count_cached_and_computed_prompt_tokens(served):
    _post(served, "/v1/completions", {"model": MODEL, "prompt": "x = [1, 2, 3]", "max_tokens": 0})
    _post(served, "/v1/completions", {"model": MODEL, "prompt": "x = [1, 2, 3]", "max_tokens": 0})
    text = httpx.get(f"{served}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["specdec_prompt_tokens_cached_total"] > 0
    assert values["specdec_prompt_tokens_computed_total"] > 0
    assert values["specdec_routed_to_cache_total"] > 0
    if _supports_cache_ram():
        for name in ("hits_total", "misses_total", "evictions_total", "bytes", "entries"):
            assert f"specdec_prompt_cache_{name}" in values, name


# ----------------------------------------------------------------------------- routing
def test_pool_routes_to_the_worker_holding_the_prompt(fim_bundle, reference):
    """Of the free workers, the one whose cache holds the longest prefix of the prompt takes the job (the
    lowest index on a tie); a decoder without cached_prefix counts as holding nothing."""
    from specdec.serving.pool import DecoderPool, PoolOptions

    pool = DecoderPool(reference.fork(), PoolOptions(workers=3))
    try:
        codec = reference.codec
        held = codec.encode("class Point:\n    def __init__(self, x, y):")
        pool.decoders[2].generate(held, max_new_tokens=0)  # worker 2 holds this prompt
        pool.decoders[1].generate(held[:3], max_new_tokens=0)  # worker 1 a shorter piece of it

        def work(decoder):
            yield "ok"

        async def scenario():
            routed = []
            for prompt in (held + codec.encode(" pass"), codec.encode("zzz"), None):
                job = pool.submit(work, prompt_ids=prompt)
                assert await job.get() == "ok"
                routed.append(job.worker)
                await job.get()  # END: the worker is free again
            return routed

        assert asyncio.run(asyncio.wait_for(scenario(), timeout=20)) == [2, 0, 0]
        assert pool.routed_to_cache == 1
    finally:
        pool.close(grace=5)


def test_a_job_ends_only_once_its_worker_is_free(reference):
    """END reaches the client only after the worker is marked free, so a next turn sent the moment the last
    one ends is routed to the worker holding its cache. Holding the pool's lock keeps the worker from freeing
    itself: END must not arrive meanwhile (it did when END was put before the worker was freed, a race that
    sent a fast client's next turn to a cold worker)."""
    from specdec.serving.pool import END, DecoderPool, PoolOptions

    pool = DecoderPool(reference.fork(), PoolOptions(workers=2))
    finish = threading.Event()
    try:
        def work(decoder):
            yield "ok"
            assert finish.wait(timeout=10)  # the job ends only once the test holds the lock

        async def scenario():
            job = pool.submit(work)
            assert await job.get() == "ok"
            with pool._lock:  # the worker cannot mark itself free while this is held
                finish.set()
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(job.get(), timeout=0.5)
                assert pool.busy == 1
            assert await asyncio.wait_for(job.get(), timeout=10) is END
            assert pool.busy == 0 and pool._assigned[job.worker] is None

        asyncio.run(scenario())
    finally:
        pool.close(grace=5)


def test_a_stream_sends_its_last_lines_only_after_the_job_ends():
    """A streaming reply's last lines ([DONE]) wait for the job's END, which the pool sends once the worker is
    free, so a client that sends its next turn on [DONE] is routed to the worker holding its cache. Before, the
    last lines went out on the job's Done item, while its worker could still be busy."""
    from types import SimpleNamespace

    from specdec.decoding.request import GenerationStats
    from specdec.serving.jobs import Done, Engine
    from specdec.serving.metrics import Metrics
    from specdec.serving.pool import END, Job

    async def scenario():
        job = Job(lambda decoder: iter(()), asyncio.get_running_loop())
        job.started = job.submitted
        engine = Engine(SimpleNamespace(decoder=None), None, Metrics())
        lines = engine.events(job, "hello", lambda piece: [f"piece {piece.text}"], lambda done: ["last", "[DONE]"],
                              lambda message, code: [f"error {message}"])
        assert await lines.__anext__() == "piece hello"
        job.items.put_nowait(Done(GenerationStats(), 0.0))
        following = asyncio.ensure_future(lines.__anext__())
        await asyncio.sleep(0.2)
        assert not following.done()  # the answer is complete, but its worker has not been freed yet
        job.items.put_nowait(END)
        assert await asyncio.wait_for(following, timeout=5) == "last"
        assert await lines.__anext__() == "[DONE]"
        await lines.aclose()

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- /infill
def _greedy_infill(decoder, prefix, suffix, n, extra=(), prompt=""):
    from specdec.sampling.processors import SamplingConfig

    return decoder.infill(prefix, suffix, extra=list(extra), prompt=prompt, max_new_tokens=n,
                          sampling=SamplingConfig(temperature=0.0))


INFILL = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
          "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
          "prompt": "return", "n_predict": 12, "temperature": 0}


def test_infill_answers_like_llama_server(served, reference):
    """/infill with llama-server's fields: the decoder's infill (greedy), llama-server's answer shape, unknown
    llama.cpp fields listed rather than refused, the second identical request served from the cache."""
    expected = _greedy_infill(reference, INFILL["input_prefix"], INFILL["input_suffix"], 12,
                              INFILL["input_extra"], INFILL["prompt"])
    response = _post(served, "/infill", {**INFILL, "n_probs": 0, "mirostat": 0, "cache_prompt": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["content"] == expected.text and answer["stop"] is True
    assert answer["tokens_predicted"] == len(expected.token_ids)
    assert answer["tokens_evaluated"] == expected.stats.prompt_tokens
    assert answer["stop_type"] in ("eos", "limit", "word")
    timings = answer["timings"]
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"):
        assert key in timings, key
    assert timings["predicted_n"] == answer["tokens_predicted"]
    assert answer["specdec"]["ignored_fields"] == ["mirostat"] and "completion_probabilities" not in answer
    probs = _post(served, "/infill", {**INFILL, "n_probs": 2}).json()["completion_probabilities"]
    assert len(probs) == answer["tokens_predicted"] - (answer["stop_type"] == "eos")  # the end token has none
    assert all(len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["logprob"] >= p["logprob"] - 1e-9 for p in probs)
    again = _post(served, "/infill", INFILL).json()
    assert again["content"] == expected.text
    assert again["timings"]["cache_n"] > 0  # prompt tokens reused; tokens_cached: what the slot holds after it
    assert again["timings"]["prompt_n"] == again["tokens_evaluated"] - again["timings"]["cache_n"]
    assert again["tokens_cached"] == again["tokens_evaluated"] + again["tokens_predicted"] - 1  # the last is never fed
    assert again["specdec"]["ignored_fields"] == []


def test_infill_streams_content_lines(served, reference):
    expected = _greedy_infill(reference, "x = ", " + 1\n", 8)
    events = _sse(served, "/infill", {"input_prefix": "x = ", "input_suffix": " + 1\n", "n_predict": 8,
                                      "temperature": 0, "stream": True})
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == expected.text
    assert events[-1]["tokens_predicted"] == len(expected.token_ids)


def test_infill_warm_up_and_until_the_end(served):
    """n_predict=0 prefills and returns at once; n_predict=-1 generates until EOS or the context's end."""
    warm = _post(served, "/infill", {"input_prefix": "import os\n", "input_suffix": "", "n_predict": 0}).json()
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    rest = _post(served, "/infill", {"input_prefix": "import os\n", "input_suffix": "", "n_predict": -1,
                                     "temperature": 0, "t_max_predict_ms": 60_000})
    assert rest.status_code == 200, rest.text
    assert rest.json()["tokens_predicted"] >= 1


def test_completions_suffix_is_fill_in_the_middle(served, reference):
    """/v1/completions with suffix (OpenAI's legacy insert, Ollama's suffix) is the decoder's infill."""
    expected = _greedy_infill(reference, "def f(x):\n    ", "\n    return y\n", 10)
    reply = _post(served, "/v1/completions", {"model": MODEL, "prompt": "def f(x):\n    ",
                                              "suffix": "\n    return y\n", "max_tokens": 10, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected.text
    tokens = _post(served, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "suffix": "x", "max_tokens": 4})
    assert tokens.status_code == 400 and tokens.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("payload, named", [
    ({"temperature": "hot"}, "temperature"),
    ({"n_predict": -2}, "n_predict"),
    ({"n_predict": 100_000}, "n_predict"),
    ({"input_extra": [{"file": "a.py"}]}, "input_extra.0.text"),
    ({"input_extra": "a.py"}, "input_extra"),
    ({"seed": -5}, "seed"),
    ({"top_p": 0}, "top_p"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"stop": ["", "x"]}, "stop"),
    ({"input_prefix": 3}, "input_prefix"),
    ({"input_prefix": "\ud800"}, "input_prefix"),
])
def test_infill_bad_fields_are_400_naming_the_field(served, payload, named):
    response = _post(served, "/infill", {"input_prefix": "a", "input_suffix": "b", **payload})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert named in message and "\n" not in message, message
    if named in ("n_predict", "temperature", "seed", "top_p", "repeat_penalty", "input_prefix"):
        assert response.json()["error"]["param"] == named


def test_infill_on_a_bundle_without_fim_tokens_is_400_saying_why(chat_bundle):
    from specdec.serving.app import ServerOptions, build_app

    with served_app(build_app(chat_bundle, ServerOptions(model_name=MODEL))) as (url, _):
        response = _post(url, "/infill", {"input_prefix": "def f():", "input_suffix": "\n"})
        assert response.status_code == 400, response.text
        assert "no fill-in-the-middle tokens" in response.json()["error"]["message"]
        suffix = _post(url, "/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b", "max_tokens": 2})
        assert suffix.status_code == 400 and "fill-in-the-middle" in suffix.json()["error"]["message"]


class _Stream:
    """decoder.stream's iterator over scripted pieces, each taking ``delay`` seconds."""

    def __init__(self, pieces, delay):
        self.pieces, self.delay, self.closed, self.token_ids = iter(pieces), delay, False, []

    def __iter__(self):
        return self

    def __next__(self):
        piece = next(self.pieces)
        time.sleep(self.delay)
        self.token_ids.append(len(self.token_ids))
        return piece

    def close(self):
        self.closed = True

    finish_reason = "length"
    stop_string = None


def test_time_limit_ends_at_a_newline_past_it():
    """t_max_predict_ms (llama.cpp's): past the limit, the middle ends once a newline has been generated; the
    decoder's stream is closed (the worker is free) and the finish says it was the limit."""
    from specdec.decoding.options import GenerationOptions
    from specdec.serving.dialects.llama import llama_answer
    from specdec.serving.jobs import Done, Prepared, stream_work

    stream = _Stream(["a", "b", "c\n", "d", "e", "f"], delay=0.02)

    class Decoder:
        eos_ids = frozenset()

        def stream(self, prompt_ids, options, stats=None):
            return stream

    prepared = Prepared([1, 2], GenerationOptions(max_new_tokens=6), time_limit=0.03)
    items = list(stream_work(prepared, None)(Decoder()))
    pieces, done = items[:-1], items[-1]
    assert [p.text for p in pieces] == ["a", "b", "c\n"] and isinstance(done, Done) and done.finish == "time"
    assert stream.closed and llama_answer("abc\n", done, set(), MODEL, [])["stop_type"] == "limit"
    untimed = _Stream(["a\n", "b"], delay=0.0)
    Decoder.stream = lambda self, prompt_ids, options, stats=None: untimed
    got = list(stream_work(Prepared([1], GenerationOptions(max_new_tokens=2)), None)(Decoder()))[:-1]
    assert [p.text for p in got] == ["a\n", "b"]


def test_infill_stream_has_no_done_marker(served):
    """llama-server's stream ends with the "stop": true line, not OpenAI's [DONE]."""
    with httpx.stream("POST", f"{served}/infill", json={"input_prefix": "a", "n_predict": 2, "stream": True},
                      timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines and all(line.startswith("data: {") for line in lines)
    assert json.loads(lines[-1][6:])["stop"] is True


# ----------------------------------------------------------------------------- --cache-ram
def test_serve_cache_ram_reaches_the_decoder(fim_bundle, monkeypatch):
    """`specdec serve --cache-ram MiB` loads the decoder with cache_ram_mib (its pool's workers share it)."""
    if not _supports_cache_ram():
        pytest.skip("SpeculativeDecoder.load has no cache_ram_mib yet")
    import argparse

    import specdec.serving.app as app_module
    from specdec.cli.args import add_load_args
    from specdec.cli.serve import add_serve_parser, cmd_serve

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"), add_load_args)
    args = parser.parse_args(["serve", str(fim_bundle), "--cache-ram", "16", "--workers", "2"])
    built = {}
    original = app_module.create_app

    def capture(pool, options):
        built["app"] = original(pool, options)
        return built["app"]

    def until_loaded(server, sockets=None):  # instead of serving: returns once the loaded pool is attached
        engine, started = built["app"].state.engine, time.monotonic()
        while not engine.ready and time.monotonic() - started < 120:
            time.sleep(0.05)

    monkeypatch.setattr(app_module, "create_app", capture)
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", until_loaded)
    assert cmd_serve(args) == 0
    pool = built["app"].state.engine.pool
    try:
        cache = pool.decoder.prompt_cache
        assert cache is not None and cache.stats()["capacity_bytes"] == 16 * 2**20
        assert all(d.prompt_cache is cache for d in pool.decoders)
    finally:
        pool.close(grace=1)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", str(fim_bundle), "--cache-ram", "lots"])


def test_props_says_what_the_server_holds(served):
    """GET /props: llama-server's fields a client sizes prompts with, and specdec's caches and proposers."""
    props = httpx.get(f"{served}/props", timeout=10).json()
    assert props["default_generation_settings"]["n_ctx"] > 0 and props["total_slots"] == 2
    assert props["model_alias"] == MODEL and "hybrid" in props["specdec"]["proposers"]
    assert props["specdec"]["kv_dtype"]["target"] in ("float32", "float16")


def test_the_server_has_its_pass_costs_before_it_listens(fim_bundle, monkeypatch):
    """build_app measures (or reads) this machine's pass costs before serving: the first request never waits for a
    calibration (one of ~15 s on the real pair, cached per machine afterwards); where none are stored it asks for
    provisional ones (a coarse measurement; the idle pool measures them in full)."""
    from specdec import SpeculativeDecoder
    from specdec.serving.app import ServerOptions, build_app

    asked = []
    original = SpeculativeDecoder.costs
    monkeypatch.setattr(SpeculativeDecoder, "costs",
                        lambda self, provisional=False: asked.append((self, provisional)) or original(self, provisional))
    build_app(fim_bundle, ServerOptions(model_name=MODEL))
    assert len(asked) == 1 and asked[0][0]._costs is not None and asked[0][1] is True


def test_several_prompts_in_one_completion(served, reference):
    """llama-server's batch: a list of token lists or strings is several prompts, answered in order as a list, each
    the answer that prompt gets alone (greedy); a batch is not streamed; a list of ids and strings stays one prompt."""
    url = served
    text = "def add(a, b):"
    tokens = _post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    body = {"n_predict": 6, "temperature": 0, "return_tokens": True}
    alone = _post(url, "/completion", {**body, "prompt": tokens}).json()
    for batch in ([tokens, tokens], [tokens, text], [text, "def sub(a, b):"]):
        answers = _post(url, "/completion", {**body, "prompt": batch}).json()
        assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1]
        assert answers[0]["tokens"] == alone["tokens"] and answers[0]["content"] == alone["content"]
    assert answers[1]["content"] == _post(url, "/completion", {**body, "prompt": "def sub(a, b):"}).json()["content"]
    single = _post(url, "/completion", {**body, "prompt": [*tokens[:2], " b):"]}).json()
    assert isinstance(single, dict)
    # llama-server's JSON prompt object is its prompt_string, alone or as one prompt of a batch
    as_object = _post(url, "/completion", {**body, "prompt": {"prompt_string": text}}).json()
    assert as_object["tokens"] == alone["tokens"]
    answers = _post(url, "/completion", {**body, "prompt": [tokens, {"prompt_string": text}]}).json()
    assert [a["tokens"] for a in answers] == [alone["tokens"]] * 2
    for bad, message in (({"prompt": [tokens, tokens], "stream": True}, "not streamed"),
                         ({"prompt": [tokens[0], tokens]}, "mixes token ids"),
                         ({"prompt": [tokens] * 17}, "at most 16"),
                         ({"prompt": [tokens, []]}, "empty prompt"),
                         ({"prompt": {"prompt_string": text, "multimodal_data": ["aGk="]}}, "multimodal model"),
                         ({"prompt": {"text": text}}, "prompt_string")):
        refused = _post(url, "/completion", {**body, **bad})
        assert refused.status_code == 400 and message in refused.text, refused.text


def test_chat_template_file_replaces_the_bundles_in_every_worker(chat_bundle, tmp_path, monkeypatch):
    """llama-server's --chat-template-file: the file's template renders every worker's prompts, with the bundle's
    special tokens; a missing file or one that does not parse is one line at start."""
    from specdec.decoding.text.chat import ChatTemplateError
    from specdec.serving.app import ServerOptions, build_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    pools = []
    monkeypatch.setattr(DecoderPool, "__init__", lambda self, *a, _init=DecoderPool.__init__: (
        pools.append(self), _init(self, *a))[1])
    app = build_app(chat_bundle, ServerOptions(model_name=MODEL, chat_template_file=str(template)),
                    PoolOptions(workers=2))
    with served_app(app) as (url, _):
        reply = _post(url, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}).json()
        eos = pools[0].decoder.chat_template.special_tokens.get("eos_token", "")
        assert reply["prompt"] == f"[user] hi{eos}\n[assistant] "
        assert [d.chat_template.origin for d in pools[0].decoders] == [str(template)] * 2
        chat = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "temperature": 0})
        assert chat.status_code == 200 and "__verbose" not in chat.json()
        # llama-server's verbose: the prompt as rendered (here by the file's template) and the answer
        verbose = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "temperature": 0, "verbose": True}).json()
        assert verbose["__verbose"]["prompt"] == reply["prompt"]
        assert verbose["__verbose"]["content"] == verbose["choices"][0]["message"]["content"]
    with pytest.raises(ValueError, match="chat_template_file .* is not a file"):
        ServerOptions(model_name=MODEL, chat_template_file=str(tmp_path / "missing.jinja"))
    template.write_text("{% for m in messages %}")  # no endfor
    with pytest.raises(ChatTemplateError, match="chat template file .*chat.jinja"):
        build_app(chat_bundle, ServerOptions(model_name=MODEL, chat_template_file=str(template)))


# ----------------------------------------------------------------------------- return_progress, timings_per_token
def _progress(events) -> list:
    return [event["prompt_progress"] for event in events if "prompt_progress" in event]


def test_return_progress_reports_the_prompt_before_the_first_token_on_every_route(served):
    """llama-server's ``return_progress``: the first report has cache == processed, the reports grow, the last has
    processed == total; a prompt sent again reports its reused tokens; text comes after the last report (a server
    that never reports, or reports out of order, fails this)."""
    long_text = "def f(x):\n    return x + 1\n" * 12
    chat = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4, "temperature": 0, "stream": True,
            "return_progress": True}
    for path, body in (("/v1/chat/completions", chat), ("/completion", {"prompt": long_text, "n_predict": 4,
                                                                       "stream": True, "return_progress": True})):
        for attempt in range(2):  # the second reads most of its prompt from the worker's cache
            events = _sse(served, path, body)
            reports = _progress(events)
            assert reports and reports[0]["cache"] == reports[0]["processed"], (path, reports)
            assert all(a["processed"] < b["processed"] for a, b in zip(reports, reports[1:])), reports
            assert reports[-1]["processed"] == reports[-1]["total"] > 0
            assert all(set(r) == {"total", "cache", "processed", "time_ms"} for r in reports)
            last_report = max(i for i, event in enumerate(events) if "prompt_progress" in event)
            texts = [i for i, event in enumerate(events)
                     if (event.get("choices") or [{}])[0].get("delta", {}).get("content") or event.get("content")]
            assert texts and min(texts) > last_report
            if attempt:
                assert reports[0]["cache"] > 0 and len(reports) == 2
    plain = _sse(served, "/v1/chat/completions", {**chat, "return_progress": False})
    assert not _progress(plain)  # only when asked


def test_responses_stream_reports_progress_and_timings_per_token(served):
    """llama-server's telemetry on the Responses stream: ``prompt_progress`` on ``response.in_progress`` events,
    ``timings`` on each text delta (with ``timings_per_token``) and on the last event."""
    with httpx.stream("POST", f"{served}/v1/responses", json={
            "input": "def f(x):\n" * 20, "max_output_tokens": 6, "temperature": 0, "stream": True,
            "timings_per_token": True, "return_progress": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    progress = [event for event in events if "prompt_progress" in event]
    assert progress and all(event["type"] == "response.in_progress" for event in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert deltas and all({"prompt_per_second", "predicted_per_second"} <= set(event["timings"]) for event in deltas)
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and "timings" in events[-1]


def test_serve_refuses_a_template_that_does_not_parse_before_its_port_opens(chat_bundle, tmp_path, monkeypatch,
                                                                               capsys):
    """``specdec serve --chat-template-file`` compiles the file before the server starts: one line, exit 2, no
    server's log lines (a check made only after the load would come after uvicorn's)."""
    from specdec.cli import serve
    from specdec.cli.main import main
    from specdec.decoding import load_options

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}")  # no endfor
    monkeypatch.setattr(serve, "_show_logs", lambda: None)
    monkeypatch.setattr(load_options, "BackgroundLoad", failing_load(AssertionError("the load was waited for")))
    assert main(["serve", str(chat_bundle), "--host", "127.0.0.1", "--port", "0", "--chat-template-file",
                 str(template)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: chat template file ") and "chat.jinja" in err
