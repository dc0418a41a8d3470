"""Session traces and their replay, without a model: traces are deterministic and shaped as promised; the replay
streams each request to fake servers on 127.0.0.1, carries each server's own replies into the next chat turn,
reads cached tokens and timings, and records a missing route per request instead of stopping."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdec.bench import traces
from specdec.bench.session import SessionServer, measures, run_session, session_markdown


def test_traces_are_deterministic_and_have_the_promised_shapes(tmp_path):
    first, second = traces.make_traces(), traces.make_traces()
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    written = traces.write_traces(tmp_path)
    assert sorted(p.name for p in written) == ["chat-paste.json", "edit-agent.json", "editor-completion.json",
                                               "fim-typing.json", "long-completion.json", "repo-agent-16k.json",
                                               "repo-agent-30k.json", "repo-agent-8k.json", "review-agent.json",
                                               "tests-agent.json"]
    assert all(traces.load_trace(p) == first[p.name] for p in written)
    tokens = lambda text: len(text) / traces.CHARS_PER_TOKEN  # noqa: E731  (the generator's own estimate)

    for size in (8, 16, 30):  # a long paste of whole files (the last cut), then short follow-ups in one chat
        agent = first[f"repo-agent-{size}k.json"]["requests"]
        assert len(agent) == 3 and {r["conversation"] for r in agent} == {"repository"}
        assert 0.97 * size * 1000 < tokens(agent[0]["user"]) < 1.03 * size * 1000, size
        assert agent[0]["user"].count("### Lib/") >= 1 and all(tokens(r["user"]) < 100 for r in agent[1:])

    chat = first["chat-paste.json"]["requests"]
    assert len(chat) == 4 and {r["conversation"] for r in chat} == {"paste"}
    assert 1000 < tokens(chat[0]["user"]) < 1500 and all(tokens(r["user"]) < 100 for r in chat[1:])

    fim = first["fim-typing.json"]["requests"]
    assert fim[0]["n_predict"] == 0 and len(fim) == 13 and all(r["n_predict"] == 24 for r in fim[1:])
    prefix_lines = [r["input_prefix"].count("\n") for r in fim[1:]]
    assert all(b - a == 2 for a, b in zip(prefix_lines, prefix_lines[1:]))
    assert all(len(b["input_suffix"]) < len(a["input_suffix"]) for a, b in zip(fim[1:], fim[2:]))
    assert len({r["input_prefix"] + r["input_suffix"] for r in fim}) == 1  # one file, the cursor moving
    assert all(r["input_extra"] and r["input_extra"][0]["filename"].endswith(".py") for r in fim)

    editor = first["editor-completion.json"]["requests"]
    assert len(editor) == 12 and all(r["route"] == "completion" and r["max_tokens"] == 24 for r in editor)
    assert [r["prompt"].count("\n") for r in editor] == [90 + 2 * k for k in range(12)]
    assert all(b["prompt"].startswith(a["prompt"]) for a, b in zip(editor, editor[1:]))  # the file grows at its end

    long = first["long-completion.json"]["requests"]
    assert all(r["route"] == "completion" and r["max_tokens"] == 128 and 1200 < tokens(r["prompt"]) <= 1500
               and r["prompt"].endswith("\n") for r in long)

    edit = first["edit-agent.json"]["requests"]
    assert len(edit) == 9 and len({r["conversation"] for r in edit}) == 3
    assert all(r["user"].startswith("```python\n") == (i % 3 == 0) for i, r in enumerate(edit))

    tests = first["tests-agent.json"]["requests"]  # one module, a new chat per function: the same prompt prefix
    assert len({r["conversation"] for r in tests}) == len(tests) == 4
    assert len({r["user"].split("Write pytest")[0] for r in tests}) == 1

    review = first["review-agent.json"]["requests"]  # successive versions of one file, the same question
    assert len({r["conversation"] for r in review}) == len(review) == 3
    assert len({r["user"] for r in review}) == 3 and len({r["user"][-80:] for r in review}) == 1


@pytest.mark.parametrize("data, message", [
    ({"requests": []}, "non-empty 'requests' list"),
    ({"requests": [{"route": "telnet"}]}, "request 0 must be an object whose 'route'"),
    ({"requests": [{"route": "chat", "user": "hi"}]}, "request 0: 'conversation' must be a string"),
])
def test_bad_traces_are_refused_naming_the_request(tmp_path, data, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        traces.load_trace(path)


def _fake(flavor: str):
    """An OpenAI-style streaming server: 'specdec' has no /infill (404) and reports no cached tokens;
    'llama' reports usage.prompt_tokens_details.cached_tokens and timings, and serves /infill."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status, body: bytes, kind="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, json.dumps({"data": [{"id": f"{flavor}-model"}]}).encode())

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            if self.path == "/infill" and flavor == "specdec":
                return self._send(404, json.dumps({"error": {"message": "Not Found"}}).encode())
            turn = len(seen)
            pieces = [f"reply{turn} ", "more"]
            timings = {"prompt_n": 5, "cache_n": 95, "predicted_n": 2, "predicted_per_second": 40.0}
            events = []
            for piece in pieces:
                if self.path == "/infill":
                    events.append({"content": piece, "stop": False})
                elif self.path == "/v1/completions":
                    events.append({"choices": [{"index": 0, "text": piece, "finish_reason": None}]})
                else:
                    events.append({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
            if self.path == "/infill":
                events.append({"content": "", "stop": True, "timings": timings})
            else:
                usage = {"prompt_tokens": 100, "completion_tokens": 2}
                if flavor == "llama":
                    usage["prompt_tokens_details"] = {"cached_tokens": 95}
                final = {"choices": [], "usage": usage}
                final.update({"timings": timings} if flavor == "llama" else {"specdec": {"tokens_per_second": 12.5}})
                events.append(final)
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(200, data.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def fakes():
    made = {name: _fake(name) for name in ("specdec", "llama")}
    yield made
    for server, _ in made.values():
        server.shutdown()
        server.server_close()


def test_replay_streams_interleaves_and_carries_each_servers_replies(fakes):
    trace = {"name": "t", "requests": [
        {"route": "chat", "conversation": "c", "user": "first", "max_tokens": 50},
        {"route": "chat", "conversation": "c", "user": "second", "max_tokens": 50},
        {"route": "infill", "input_prefix": "def f(", "input_suffix": "\n", "input_extra": [], "prompt": "",
         "n_predict": 24},
        {"route": "completion", "prompt": "x = ", "max_tokens": 300}]}
    servers = [SessionServer(name, f"http://127.0.0.1:{server.server_address[1]}", name)
               for name, (server, _) in fakes.items()]
    report = run_session([trace], servers, max_tokens_cap=16, progress=lambda m: None)
    spec_seen, llama_seen = fakes["specdec"][1], fakes["llama"][1]
    # the second turn carries the reply that server gave to the first
    assert spec_seen[1][1]["messages"] == [{"role": "user", "content": "first"},
                                           {"role": "assistant", "content": "reply1 more"},
                                           {"role": "user", "content": "second"}]
    assert llama_seen[1][1]["messages"][1] == {"role": "assistant", "content": "reply1 more"}
    assert spec_seen[0][1]["model"] == "specdec-model" and spec_seen[0][1]["stream"] is True
    assert "cache_prompt" not in spec_seen[0][1] and llama_seen[0][1]["cache_prompt"] is True
    assert spec_seen[0][1]["max_tokens"] == 16 and llama_seen[3][1]["max_tokens"] == 16  # capped
    assert llama_seen[2] [0] == "/infill" and llama_seen[2][1]["n_predict"] == 16

    rows = {(r["index"], r["server"]): r for r in report["requests"]}
    assert [(r["index"], r["server"]) for r in report["requests"]][:2] == [(0, "specdec"), (0, "llama")]
    assert rows[(2, "specdec")]["error"].startswith("HTTP 404") and rows[(3, "specdec")]["error"] is None
    assert rows[(0, "llama")]["cached_tokens"] == 95 and rows[(0, "llama")]["computed_tokens"] == 5
    assert rows[(0, "specdec")]["cached_tokens"] is None and rows[(0, "specdec")]["decode_tok_s"] == 12.5
    assert rows[(2, "llama")]["prompt_tokens"] == 100 and rows[(2, "llama")]["cached_source"] == "native"
    assert rows[(0, "llama")]["reported"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 95}
    assert rows[(0, "llama")]["decode_tok_s"] == 40.0 and rows[(0, "llama")]["ttft_s"] is not None
    summary = {r["server"]: r for r in report["summary"]}
    assert summary["specdec"]["errors"] == 1 and summary["llama"]["cached_share"] == pytest.approx(0.95)
    text = session_markdown(report)
    assert "| t | 2 | infill | specdec |" in text and "HTTP 404" in text


def test_native_answer_without_cache_n_uses_tokens_cached():
    """specdec's /infill answers as llama.cpp's /completion does: tokens_cached / tokens_evaluated beside timings."""
    got = measures({"timings": {"prompt_n": 30, "predicted_n": 8, "predicted_per_second": 9.0}, "tokens_cached": 70,
                    "tokens_evaluated": 100, "ttft_s": 0.5, "total_s": 1.0, "pieces": 8})
    assert (got["prompt_tokens"], got["cached_tokens"], got["computed_tokens"]) == (100, 70, 30)
    assert got["decode_tok_s"] == 9.0


def test_measures_fall_back_to_client_side_rate():
    result = {"usage": {"prompt_tokens": 10, "completion_tokens": 11}, "ttft_s": 1.0, "total_s": 3.0, "pieces": 11}
    got = measures(result)
    assert got["decode_tok_s"] == pytest.approx(5.0) and got["decode_source"] == "client"
    assert got["cached_tokens"] is None and got["computed_tokens"] is None


def test_a_specdec_mode_server_sends_its_options_with_every_request():
    from specdec.bench.session import SPECDEC_MODES, request_body

    server = SessionServer("specdec:target", "http://127.0.0.1:9", "specdec", extra=SPECDEC_MODES["target"])
    server.model = "m"
    for request, messages in (({"route": "chat", "conversation": "c", "user": "u", "max_tokens": 5},
                               [{"role": "user", "content": "u"}]),
                              ({"route": "completion", "prompt": "x", "max_tokens": 5}, None)):
        _, body = request_body(server, request, messages, None)
        assert body["num_draft_tokens"] == 0 and body["max_tokens"] == 5
    assert SPECDEC_MODES["default"] == {} and SPECDEC_MODES["suffix"] == {"proposer": "suffix"}
