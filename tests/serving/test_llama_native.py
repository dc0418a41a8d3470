"""llama-server's native routes as its clients send them: /completion (and /completions), /infill as llama.vim and
llama.vscode send it, /tokenize, /detokenize, /props, GET /slots, id_slot; llama-server's error shape; a bad-input
table (400 naming the field, never a 500); the pool's pinned jobs. Servers bind 127.0.0.1; loops are bounded."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from served_app import served_app

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")

MODEL = "tiny-fim"
WORKERS = 2


@pytest.fixture(scope="module")
def reference(fim_bundle):
    from specdec.decoding.decoder import SpeculativeDecoder

    return SpeculativeDecoder.load(fim_bundle)


@pytest.fixture(scope="module")
def served(fim_bundle, tmp_path_factory):
    from specdec.serving.app import ServerOptions, build_app
    from specdec.serving.pool import PoolOptions

    folder = tmp_path_factory.mktemp("slots")
    app = build_app(fim_bundle, ServerOptions(model_name=MODEL, slot_save_path=str(folder)),
                    PoolOptions(workers=WORKERS))
    with served_app(app) as (url, _):
        yield url


def _greedy(decoder, prompt, n, **more):
    from specdec.sampling.processors import SamplingConfig

    return decoder.generate(prompt, max_new_tokens=n, sampling=SamplingConfig(temperature=0.0), **more)


def _lines(response) -> list:
    return [line for line in response.iter_lines() if line]


# ----------------------------------------------------------------------------- /completion
PROMPT = "def add(a, b):\n    return"


def test_completion_as_a_client_sends_it(served, reference):
    """requests (as llama-cpp clients post it): cache_prompt, n_probs, return_tokens; the answer is the decoder's greedy
    output in llama-server's shape; the same request again reuses the slot's cache (timings.cache_n)."""
    expected = _greedy(reference, PROMPT, 12)
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "cache_prompt": True, "n_probs": 2,
            "return_tokens": True, "samplers": ["top_k", "temperature"]}
    answer = requests.post(f"{served}/completion", json=body, timeout=60).json()
    assert answer["content"] == expected.text and answer["tokens"] == expected.token_ids
    assert answer["stop"] is True and answer["model"] == MODEL and answer["id_slot"] in range(WORKERS)
    assert answer["tokens_predicted"] == len(expected.token_ids)
    assert answer["tokens_evaluated"] == expected.stats.prompt_tokens
    assert answer["stop_type"] == {"eos": "eos", "length": "limit"}[expected.finish_reason]
    assert answer["truncated"] is False and answer["generation_settings"]["n_predict"] == 12
    timings = answer["timings"]
    for key in ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                "predicted_per_token_ms", "predicted_per_second", "cache_n", "draft_n", "draft_n_accepted"):
        assert key in timings, key
    assert timings["prompt_n"] + timings["cache_n"] == answer["tokens_evaluated"]
    assert timings["draft_n_accepted"] <= timings["draft_n"]
    probs = answer["completion_probabilities"]
    assert [p["id"] for p in probs] == expected.token_ids[: len(probs)] and len(probs) >= len(expected.token_ids) - 1
    assert all(len(p["top_logprobs"]) == 2 for p in probs)
    assert answer["specdec"]["ignored_fields"] == ["samplers"]
    again = requests.post(f"{served}/completion", json={**body, "id_slot": answer["id_slot"]}, timeout=60).json()
    assert again["content"] == expected.text and again["timings"]["cache_n"] == answer["tokens_evaluated"] - 1


def test_completions_is_the_native_route_and_v1_is_openai(served, reference):
    """llama-server maps /completions to its native handler, not OpenAI's; /v1/completions stays OpenAI's."""
    expected = _greedy(reference, "x = ", 6)
    native = httpx.post(f"{served}/completions", json={"prompt": "x = ", "max_tokens": 6, "temperature": 0}).json()
    assert native["content"] == expected.text and "choices" not in native
    assert native["generation_settings"]["n_predict"] == 6  # max_tokens is n_predict's alias
    openai = httpx.post(f"{served}/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 6,
                                                          "temperature": 0}).json()
    assert openai["choices"][0]["text"] == expected.text


def test_completion_prompt_forms(served, reference):
    """Token ids, and a list mixing ids and text (tokenized without a BOS after the first part), as llama-server."""
    codec = reference.codec
    ids = codec.encode("def f():")
    expected = _greedy(reference, ids + codec.encode("\n    return", special=False), 6)
    mixed = httpx.post(f"{served}/completion", json={"prompt": ids + ["\n    return"], "n_predict": 6,
                                                     "temperature": 0}).json()
    assert mixed["content"] == expected.text
    plain = httpx.post(f"{served}/completion", json={"prompt": ids, "n_predict": 6, "temperature": 0}).json()
    assert plain["content"] == _greedy(reference, ids, 6).text


def test_completion_streams_like_llama_server(served, reference):
    """data: lines with content and tokens, no [DONE], the last with stop: true and the timings."""
    expected = _greedy(reference, PROMPT, 10)
    with httpx.stream("POST", f"{served}/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0,
                                                            "stream": True, "return_tokens": True},
                      timeout=60) as response:
        lines = _lines(response)
    assert all(line.startswith("data: {") for line in lines)
    events = [json.loads(line[6:]) for line in lines]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == expected.text
    assert [t for e in events for t in e["tokens"]] == expected.token_ids
    assert events[-1]["tokens_predicted"] == len(expected.token_ids) and "timings" in events[-1]
    assert events[-2]["tokens_predicted"] == sum(len(e["tokens"]) for e in events[:-1])


def test_completion_stop_word(served, reference):
    expected = _greedy(reference, PROMPT, 12)
    word = expected.text[3:5]
    if not word.strip():
        pytest.skip("the tiny model's output has no usable stop word here")
    cut = _greedy(reference, PROMPT, 12, stop=[word])
    answer = httpx.post(f"{served}/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                                      "stop": ["\u0000never", word]}).json()
    assert (answer["content"], answer["stop_type"], answer["stopping_word"]) == (cut.text, "word", word)


# ----------------------------------------------------------------------------- /infill as the editor plugins send it
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def test_infill_as_llama_vim_sends_it(served, reference):
    """llama.vim: id_slot 0, input_extra chunks with their "time", n_indent, samplers, t_max_prompt_ms, and
    response_fields, which llama-server answers flattened ("timings/prompt_n" at the top)."""
    from specdec.sampling.processors import SamplingConfig

    extra = [{"text": "def sub(a, b):\n    return a - b\n", "time": 1733000000, "filename": "util.py"}]
    ring = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
    warm = requests.post(f"{served}/infill", json=ring, timeout=60)  # the ring buffer's cache warm-up
    assert warm.status_code == 200 and warm.json() == {}, warm.text
    request = {"id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
               "input_extra": extra, "prompt": "    ", "n_predict": 8, "stop": [], "n_indent": 4, "top_k": 40,
               "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
               "t_max_prompt_ms": 500, "t_max_predict_ms": 60_000, "response_fields": LLAMA_VIM_FIELDS,
               "temperature": 0}
    answer = requests.post(f"{served}/infill", json=request, timeout=60).json()
    assert set(answer) == set(LLAMA_VIM_FIELDS), answer
    expected = reference.infill("def add(a, b):\n", "\n\nprint(add(1, 2))\n",
                                extra=[{"filename": "util.py", "text": extra[0]["text"]}], prompt="    ",
                                max_new_tokens=8, sampling=SamplingConfig(temperature=0.0))
    assert answer["content"] == expected.text and answer["truncated"] is False
    assert answer["timings/predicted_n"] == len(expected.token_ids)
    assert answer["timings/prompt_n"] < expected.stats.prompt_tokens  # the ring's warm-up left the extra cached
    slots = httpx.get(f"{served}/slots").json()
    assert slots[0]["n_prompt_tokens"] == expected.stats.prompt_tokens  # id_slot 0 ran it


def test_empty_response_fields_is_every_field(served):
    """llama-server reads response_fields [] as no selection: the whole answer (llama.vim's [""] selects nothing)."""
    answer = requests.post(f"{served}/completion", json={"prompt": "a", "n_predict": 2, "response_fields": []},
                           timeout=60).json()
    assert "content" in answer and "generation_settings" in answer and "timings" in answer


def test_infill_as_llama_vscode_sends_it(served):
    """llama.vscode (axios): chunks {text, time, filename}, top_p 0.99, samplers, t_max_prompt_ms; no model."""
    chunks = [{"text": "import os\n", "time": 1733000000.5, "filename": "a.py"}]
    body = {"input_prefix": "def f():\n    ", "input_suffix": "\n", "input_extra": chunks, "prompt": "",
            "n_predict": 6, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}
    answer = httpx.post(f"{served}/infill", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    assert isinstance(answer["content"], str) and answer["timings"]["predicted_n"] == answer["tokens_predicted"]
    assert answer["specdec"]["ignored_fields"] == ["input_extra.time", "samplers", "t_max_prompt_ms"]
    warm = httpx.post(f"{served}/infill", json={**body, "input_prefix": "", "input_suffix": "", "prompt": ""})
    assert warm.status_code == 200, warm.text


# ----------------------------------------------------------------------------- tokenize, detokenize, props
def test_tokenize_and_detokenize(served, reference):
    codec = reference.codec
    text = "def add(a, b):"
    tokens = httpx.post(f"{served}/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == codec.encode(text, special=False)  # add_special defaults to false, as llama-server
    pieces = httpx.post(f"{served}/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens and "".join(p["piece"] for p in pieces) == text
    special = "a<extra_120>b"  # <extra_120> is a special token of the chat bundle's tokenizer
    parsed = httpx.post(f"{served}/tokenize", json={"content": special}).json()["tokens"]
    literal = httpx.post(f"{served}/tokenize", json={"content": special, "parse_special": False}).json()["tokens"]
    assert len(parsed) == 3 and len(literal) > 3 and codec.token_id("<extra_120>") in parsed
    assert codec.token_id("<extra_120>") not in literal
    mixed = httpx.post(f"{served}/tokenize", json={"content": [7, "ab", 9]}).json()["tokens"]
    assert mixed == [7] + codec.encode("ab", special=False) + [9]
    assert httpx.post(f"{served}/detokenize", json={"tokens": parsed}).json() == {"content": special}
    assert httpx.post(f"{served}/detokenize", json={"tokens": tokens}).json() == {"content": text}
    assert httpx.post(f"{served}/tokenize", json={}).json() == {"tokens": []}


def test_tokenize_pieces_that_are_not_utf8_are_bytes():
    """with_pieces: a token holding part of a character is its list of bytes (llama-server's rule)."""
    from specdec.serving.dialects.llama_info import TokenRoutes
    from specdec.serving.dialects.llama_models import TokenizeRequest

    pieces = {1: b"a", 2: b"\xf0\x9f", 3: b"\x98\x80"}
    codec = SimpleNamespace(encode_mixed=lambda content, add, parse: list(content), piece_bytes=pieces.__getitem__)
    engine = SimpleNamespace(codec=codec, decoder=SimpleNamespace(manifest=SimpleNamespace(
        target=SimpleNamespace(vocab_size=8))))
    answer = asyncio.run(TokenRoutes(engine).tokenize(TokenizeRequest(content=[1, 2, 3], with_pieces=True)))
    assert answer == {"tokens": [{"id": 1, "piece": "a"}, {"id": 2, "piece": [240, 159]},
                                 {"id": 3, "piece": [152, 128]}]}


def test_mixed_prompts_get_the_bos_only_before_a_first_text():
    """llama-server's tokenize_mixed: add_special adds the BOS when the first part is text, never later."""
    from specdec.decoding.text.codec import TextCodec

    fake = SimpleNamespace(encode=lambda text, special, parse: [100] * special + [ord(c) for c in text])
    assert TextCodec.encode_mixed(fake, "ab", True) == [100, 97, 98]
    assert TextCodec.encode_mixed(fake, ["ab", 5, "c"], True) == [100, 97, 98, 5, 99]
    assert TextCodec.encode_mixed(fake, [5, "c"], True) == [5, 99]
    assert TextCodec.encode_mixed(fake, ["ab"], False) == [97, 98]


def test_props_has_llama_servers_fields(served, reference):
    props = httpx.get(f"{served}/props").json()
    assert props["total_slots"] == WORKERS and props["default_generation_settings"]["n_ctx"] == reference.max_context
    assert props["default_generation_settings"]["params"]["n_predict"] == -1
    assert props["bos_token"] == "<bos>" and props["eos_token"] == "<eos>"  # the tiny tokenizer's
    assert props["build_info"].startswith("specdec") and props["endpoint_slots"] is True
    assert props["specdec"]["bundle_identity"] == reference.identity and props["specdec"]["slot_save_path"] is True


# ----------------------------------------------------------------------------- slots, id_slot
def test_slots_describe_each_worker_and_id_slot_routes(served):
    answer = httpx.post(f"{served}/completion", json={"prompt": "x", "n_predict": 3, "id_slot": 1}).json()
    assert answer["id_slot"] == 1
    slots = httpx.get(f"{served}/slots").json()
    assert [s["id"] for s in slots] == list(range(WORKERS))
    one = slots[1]
    assert one["is_processing"] is False and one["speculative"] is True and one["n_ctx"] > 0
    assert one["n_prompt_tokens"] == answer["tokens_evaluated"]
    assert one["n_prompt_tokens_cache"] + one["n_prompt_tokens_processed"] == one["n_prompt_tokens"]
    assert one["next_token"][0]["n_decoded"] == answer["tokens_predicted"]
    assert one["specdec"]["target_tokens"] == answer["tokens_cached"]
    assert httpx.get(f"{served}/slots?fail_on_no_slot=1").status_code == 200  # both are idle


def test_fail_on_no_slot_when_every_worker_is_busy():
    from specdec.serving.dialects.llama_slots import Slots
    from specdec.serving.wire import APIError

    runner = SimpleNamespace(length=0)
    decoder = SimpleNamespace(max_context=64, target=runner, draft=None)
    pool = SimpleNamespace(decoders=[decoder], worker_states=lambda: [(True, None)])
    slots = Slots(SimpleNamespace(pool=pool), SimpleNamespace(slots_endpoint=True))
    with pytest.raises(APIError) as info:
        asyncio.run(slots.list(SimpleNamespace(query_params={"fail_on_no_slot": "1"})))
    assert info.value.status == 503 and info.value.message == "no slot available"
    assert asyncio.run(slots.list(SimpleNamespace(query_params={})))[0]["is_processing"] is True


# ----------------------------------------------------------------------------- errors
BAD = [
    ("/completion", {"n_predict": 2}, 400, "prompt"),
    ("/completion", {"prompt": []}, 400, "prompt"),
    ("/completion", {"prompt": [[1], 2]}, 400, "prompt"),  # several prompts mixed with an id
    ("/completion", {"prompt": [1, -2]}, 400, "prompt.1"),
    ("/completion", {"prompt": [1, 100_000]}, 400, "prompt"),
    ("/completion", {"prompt": [1.5]}, 400, "prompt.0"),
    ("/completion", {"prompt": "a", "n_predict": -3}, 400, "n_predict"),
    ("/completion", {"prompt": "a", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/completion", {"prompt": "a", "n_probs": 99}, 400, "n_probs"),
    ("/completion", {"prompt": "a", "logprobs": 99}, 400, "logprobs"),
    ("/completion", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/completion", {"prompt": "a", "id_slot": 7}, 400, "id_slot"),
    ("/completion", {"prompt": "a", "id_slot": -2}, 400, "id_slot"),
    ("/completion", {"prompt": "a", "n": 2}, 400, "n"),
    ("/completion", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/completion", {"prompt": "a", "grammar": "root ::= ", "json_schema": {}}, 400, "json_schema"),
    ("/completion", {"prompt": "a", "grammar": "root ::= ((("}, 400, "grammar"),
    ("/completion", {"prompt": "a", "response_fields": "content"}, 400, "response_fields"),
    ("/completion", {"prompt": "a", "return_tokens": "yes"}, 400, "return_tokens"),
    ("/completion", None, 400, "JSON"),
    ("/tokenize", {"content": 3}, 400, "content"),
    ("/tokenize", {"content": [1, 999]}, 400, "content.1"),
    ("/tokenize", {"content": [True]}, 400, "content.0"),
    ("/tokenize", {"content": "a", "with_pieces": 1}, 400, "with_pieces"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [999]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens.0"),
    ("/slots/0?action=save", {}, 400, "filename"),
    ("/slots/0?action=save", {"filename": 3}, 400, "filename"),
    ("/slots/0?action=save", {"filename": "../x.bin"}, 400, "Invalid filename"),
    ("/slots/0?action=restore", {"filename": "missing.bin"}, 400, "does not exist"),
    ("/slots/0?action=jump", {"filename": "x.bin"}, 400, "Invalid action"),
    ("/slots/0", {"filename": "x.bin"}, 400, "Invalid action"),
    ("/slots/9?action=erase", {}, 400, "Invalid slot ID"),
    ("/slots/-1?action=erase", {}, 400, "Invalid slot ID"),
    ("/slots/one?action=erase", {}, 400, "Invalid slot ID"),
]


@pytest.mark.parametrize("route, body, status, named", BAD, ids=[f"{r} {n}" for r, _, _, n in BAD])
def test_bad_input_is_a_400_naming_the_field(served, route, body, status, named):
    content = "{not json" if body is None else json.dumps(body)
    response = httpx.post(f"{served}{route}", content=content, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert named in error["message"] and "\n" not in error["message"], error
    assert error["code"] == status and error["type"] in ("invalid_request_error", "exceed_context_size_error")


def test_llama_routes_answer_llama_servers_error_shape(served):
    """{"error": {"code": <status>, "message", "type"}} as llama-server, with OpenAI's param; a context overflow
    is its exceed_context_size_error; an unsupported method keeps the shape."""
    overflow = httpx.post(f"{served}/completion", json={"prompt": "a", "n_predict": 100_000}).json()["error"]
    assert (overflow["code"], overflow["type"], overflow["param"]) == (400, "exceed_context_size_error", "n_predict")
    method = httpx.get(f"{served}/completion")
    assert method.status_code == 405 and method.json()["error"]["code"] == 405
    openai = httpx.post(f"{served}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 100_000})
    assert openai.json()["error"]["code"] == "context_length_exceeded"  # OpenAI's routes keep OpenAI's shape


# ----------------------------------------------------------------------------- the pool's pinned jobs
class _Stub:
    """A decoder for pool mechanics: fork() gives another; the job functions do the work."""

    def fork(self):
        return _Stub()


def test_a_pinned_job_waits_for_its_worker_and_lets_others_pass():
    """A job pinned to a busy worker waits for it (the slot action after the running generation); a younger job
    that may run anywhere takes the free worker meanwhile; the pinned one then runs on its own worker."""
    from specdec.serving.pool import END, DecoderPool, PoolOptions

    pool = DecoderPool(_Stub(), PoolOptions(workers=2, max_queue=4))
    release = threading.Event()
    try:
        def slow(decoder):
            yield "slow"
            assert release.wait(timeout=10)

        def quick(decoder):
            yield "quick"

        async def scenario():
            first = pool.submit(slow, worker=0)
            assert await first.get() == "slow" and first.worker == 0
            pinned = pool.submit(quick, worker=0)
            other = pool.submit(quick)
            assert await asyncio.wait_for(other.get(), timeout=10) == "quick" and other.worker == 1
            await asyncio.sleep(0.2)
            assert pinned.worker is None and pinned.items.empty()  # still waiting for worker 0
            release.set()
            assert await asyncio.wait_for(pinned.get(), timeout=10) == "quick" and pinned.worker == 0
            for job in (first, pinned, other):
                assert await asyncio.wait_for(job.get(), timeout=10) is END
            assert [job.task_id for job in (first, pinned, other)] == [1, 2, 3]
            states = pool.worker_states()
            assert states[0] == (False, pinned) and states[1] == (False, other)

        asyncio.run(scenario())
        with pytest.raises(ValueError, match="worker must be"):
            pool.submit(quick, worker=2)
    finally:
        release.set()
        pool.close(grace=5)


def test_slot_save_path_must_be_a_folder_and_is_not_for_ray(tmp_path):
    import argparse

    from specdec.cli.args import add_load_args
    from specdec.cli.serve import add_serve_parser, cmd_serve
    from specdec.serving.app import ServerOptions

    with pytest.raises(ValueError, match="is not a directory"):
        ServerOptions(model_name="m", slot_save_path=str(tmp_path / "missing"))
    assert ServerOptions(model_name="m", slot_save_path=str(tmp_path)).slot_save_path == str(tmp_path)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"), add_load_args)
    args = parser.parse_args(["serve", str(tmp_path), "--slot-save-path", str(tmp_path), "--ray"])
    with pytest.raises(ValueError, match="--slot-save-path is for one process's workers"):
        cmd_serve(args)
