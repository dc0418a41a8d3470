"""The llama.cpp peer without llama.cpp: argument building, timings parsing against a fake llama-server
on 127.0.0.1, one-line errors for a missing binary or GGUF, and bench.json's provenance and spread."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from specdec.bench import bench
from specdec.bench import llama_server as ls
from specdec.cli.main import main

# a /completion response as llama-server writes it (fields trimmed to those the peer reads and a few more)
CANNED = {"content": " world", "tokens": [1879, 0, 11], "stop": True, "tokens_cached": 0,
          "timings": {"cache_n": 0, "prompt_n": 12, "prompt_ms": 240.0, "prompt_per_token_ms": 20.0,
                      "prompt_per_second": 50.0, "predicted_n": 32, "predicted_ms": 1600.0,
                      "predicted_per_token_ms": 50.0, "predicted_per_second": 20.0,
                      "draft_n": 20, "draft_n_accepted": 15}}


@pytest.fixture
def fake_llama():
    """A llama-server stand-in: /health 200, /completion echoes CANNED and records each request body."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, payload, status=200):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._json({"status": "ok"} if self.path == "/health" else {"error": "no"}, 200 if self.path == "/health"
                       else 404)

        def do_POST(self):
            seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._json(CANNED)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}", seen=seen)
    server.shutdown()
    server.server_close()


def test_server_args_for_each_mode():
    """-m -t -c --parallel 1 --port --host 127.0.0.1, then the mode's speculative flags of this llama.cpp."""
    base = ["llama-server", "-m", "t.gguf", "-t", "2", "-c", "4096", "--parallel", "1", "--port", "8081", "--host",
            "127.0.0.1"]
    args = lambda mode: ls.server_args("llama-server", "t.gguf", 8081, 2, 4096, mode, "d.gguf", 5)  # noqa: E731
    assert args("llama:target") == base
    assert args("llama:draft") == base + ["--spec-type", "draft-simple", "--model-draft", "d.gguf",
                                          "--spec-draft-n-max", "5"]
    assert args("llama:ngram-simple") == base + ["--spec-type", "ngram-simple"]
    assert args("llama:ngram-mod") == base + ["--spec-type", "ngram-mod"]
    assert args("llama:ngram-cache") == base + ["--spec-type", "ngram-cache"]
    with pytest.raises(ValueError, match="unknown llama.cpp mode"):
        args("llama:magic")


def test_modes_the_binary_or_files_cannot_run_are_skipped_with_a_note():
    help_output = "--spec-type none,draft-simple,ngram-simple\n--model-draft FNAME\n--spec-draft-n-max N\n"
    modes, notes = ls.usable_modes(ls.MODES, help_output, "d.gguf")
    assert modes == ("llama:target", "llama:draft", "llama:ngram-simple")
    assert notes == ["llama:ngram-mod skipped: this llama-server's --help lacks ngram-mod",
                     "llama:ngram-cache skipped: this llama-server's --help lacks ngram-cache"]
    modes, notes = ls.usable_modes(ls.MODES, help_output + "ngram-mod,ngram-cache", None)
    assert "llama:draft" not in modes and notes[0].startswith("llama:draft skipped: no draft GGUF")


def test_timings_become_a_bench_record():
    """Decode = predicted_n / predicted_ms, prefill = prompt_ms; draft counts kept; passes unknown (None)."""
    item = {"id": "p", "kind": "code", "prompt": "x"}
    run = ls.record(item, "llama:draft", CANNED, 900.0)
    assert run["new_tokens"] == run["decode_tokens"] == 32 and run["prompt_tokens"] == 12
    assert run["decode_seconds"] == pytest.approx(1.6) and run["prefill_seconds"] == pytest.approx(0.24)
    assert run["decode_tokens"] / run["decode_seconds"] == pytest.approx(CANNED["timings"]["predicted_per_second"])
    assert (run["proposed"], run["accepted"], run["rounds"]) == (20, 15, None)
    assert run["tokens"] == [1879, 0, 11] and run["rss_mib"] == 900.0
    assert ls.record(item, "llama:target", CANNED, None)["proposed"] is None
    with pytest.raises(KeyError):
        ls.parse_timings({"content": "no timings"})


def test_peer_times_each_mode_through_completion(fake_llama):
    """Greedy, the prompt as token ids, cache_prompt false, n_predict; one run per mode; rows in the summary."""
    class Server:
        url = fake_llama.url
        argv = ["/somewhere/llama-server", "-m", "/models/t.gguf"]

        def rss_mib(self):
            return 1234.0

    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    peer = ls.LlamaServerPeer("unused", "t.gguf", None, encode, 32, lambda m: None,
                              servers={"llama:target": Server(), "llama:ngram-mod": Server()})
    runs = peer({"id": "a", "kind": "code", "prompt": "hi"})
    assert [r["mode"] for r in runs] == ["llama:target", "llama:ngram-mod"]
    path, body = fake_llama.seen[0]
    assert path == "/completion"
    assert body["prompt"] == [104, 105] and body["n_predict"] == 32 and body["temperature"] == 0
    assert body["cache_prompt"] is False and body["stream"] is False
    assert peer.describe()["llama:target"]["argv"] == ["llama-server", "-m", "t.gguf"]  # no machine paths
    base = [{**runs[0], "mode": "0", "repeat": 0}]
    rows = {r["mode"]: r for r in bench.summarize(base + runs, bench.Costs(0.3, (1.0, 1.1)), 0.0) if r["kind"] == "all"}
    assert rows["llama:ngram-mod"]["tokens_per_s"] == pytest.approx(20.0) and rows["llama:ngram-mod"]["rss_mib"] == 1234


def test_wait_healthy_sees_the_fake_server(fake_llama):
    ls.wait_healthy(fake_llama.url + "/health", timeout=5)
    with pytest.raises(RuntimeError, match="not healthy"):
        ls.wait_healthy(f"http://127.0.0.1:{ls.free_port()}/health", timeout=0.5)


def test_peer_gguf_must_be_a_gguf_file(tmp_path):
    (tmp_path / "not.gguf").write_text("text")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        ls.resolve_ggufs(str(tmp_path), [str(tmp_path / "not.gguf")])
    with pytest.raises(ValueError, match="takes TARGET"):
        ls.resolve_ggufs(str(tmp_path), ["a", "b", "c"])
    # the manifest's own GGUFs (sha256-checked): tests/export/test_provenance.py


def _prompts(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"id": "a", "prompt": "def f():"}]))
    return str(path)


@pytest.mark.parametrize("which", ["binary", "target", "draft"])
def test_missing_binary_or_gguf_is_one_line_before_anything_runs(tmp_path, capsys, which):
    """The bundle does not even exist: the llama peer's check comes first, one line, exit 2, nothing written."""
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    for path in (target, draft):
        path.write_bytes(b"GGUF" + b"\0" * 8)
    {"binary": binary, "target": target, "draft": draft}[which].unlink()
    code = main(["bench", str(tmp_path / "no-bundle"), "--prompts", _prompts(tmp_path), "--out",
                 str(tmp_path / "out"), "--peer-llama-server", str(binary), "--peer-gguf", str(target), str(draft)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert {"binary": "is not an executable file", "target": "the target GGUF", "draft": "the draft GGUF"}[which] in err
    assert not (tmp_path / "out").exists()


def test_provenance_records_commit_packages_cpu_threads_and_bundle_hash(tmp_path):
    import hashlib

    (tmp_path / "manifest.json").write_text('{"format_version": 1}')
    info = bench.provenance(tmp_path, 3)
    assert info["bundle_manifest_sha256"] == hashlib.sha256(b'{"format_version": 1}').hexdigest()
    assert info["threads"] == 3 and info["cpu_count"] >= 1 and info["python"]
    assert set(info["packages"]) == {"specdec", "onnxruntime", "numpy", "tokenizers"}
    assert info["packages"]["numpy"] and info["packages"]["specdec"]
    assert info["git_commit"] is None or len(info["git_commit"].split("-")[0]) == 40
    assert bench.provenance(tmp_path / "missing", None)["bundle_manifest_sha256"] is None


def test_spread_across_repeats_is_mean_and_stddev():
    """Per mode: each pass's decode rate; mean +- sample stddev in the 'all' row when passes > 1."""
    def run(mode, rep, tokens, seconds):
        return {"prompt": "p", "kind": "code", "mode": mode, "repeat": rep, "tokens": [1] * tokens,
                "new_tokens": tokens, "decode_tokens": tokens, "decode_seconds": seconds, "prefill_seconds": 0.1}

    runs = [run("0", 0, 10, 1.0), run("0", 1, 10, 0.5), run("llama:target", 0, 30, 1.0)]
    spread = bench.repeat_spread(runs)
    assert spread["0"]["tokens_per_s"] == [10.0, 20.0] and spread["0"]["mean"] == 15.0
    assert spread["0"]["stdev"] == pytest.approx(7.0711, abs=1e-3) and spread["llama:target"]["stdev"] is None
    report = {"summary": bench.summarize(runs, bench.Costs(0.3, (1.0, 1.1)), 0.0),
              "costs": {"draft_step": 0.3, "verify": [1.0, 1.1]}, "spread": spread,
              "provenance": bench.provenance(".", 2)}
    text = bench.markdown(report)
    assert "| all | target only | 15.00 ± 7.07 |" in text and "Commit " in text


def test_peers_with_repeats_run_every_pass(tiny_decoder):
    """A peer marked ``repeats`` is called in each pass (its runs carry the pass); the others only in the first."""
    calls = []

    class Peer:
        def __init__(self, name, repeats):
            self.name, self.repeats = name, repeats

        def warm_up(self, prompt, tokens):
            pass

        def __call__(self, item):
            calls.append(self.name)
            return [{"prompt": item["id"], "kind": item["kind"], "mode": self.name, "repeat": 0, "tokens": [1],
                     "new_tokens": 1, "decode_tokens": 1, "decode_seconds": 0.1, "prefill_seconds": 0.1,
                     "rss_mib": 5.0}]

    report = bench.run_bench(tiny_decoder, [{"id": "p", "kind": "code", "prompt": "def f():"}],
                             {"0": {"num_draft_tokens": 0}}, 4, 0.0, repeat=2, progress=lambda m: None,
                             peers=(Peer("llama", True), Peer("genai", False)))
    assert calls == ["llama", "genai", "llama"]
    llama = [r for r in report["runs"] if r["mode"] == "llama"]
    assert [r["repeat"] for r in llama] == [0, 1] and all(r["rss_mib"] == 5.0 for r in llama)
    assert report["spread"]["llama"]["stdev"] == 0.0
