"""llama-server's slot save / restore / erase: a worker's KV caches of both models in a file.

Save in one `specdec serve`, restore in a fresh one: the next turn is warm (its cached tokens are the ones saved)
and token for token what a cold run answers. A changed byte, a truncated file, a file of another bundle, a file
that is not a slot file: each refused with one line, and the worker's cache is as it was (the next request is
served exactly as before the refusal). Filenames cannot leave the folder; a save never replaces a user's file or
another bundle's. Servers bind 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
from paths import TOOLS

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.integration

PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n" * 2
GREEDY = {"n_predict": 16, "temperature": 0, "return_tokens": True, "id_slot": 0}


@contextlib.contextmanager
def serve(bundle, folder):
    """`specdec serve BUNDLE --slot-save-path FOLDER` in a subprocess on 127.0.0.1 (one worker)."""
    from specdec.bench.llama_server import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "specdec.cli.main", "serve", str(bundle), "--host", "127.0.0.1", "--port",
            str(port), "--slot-save-path", str(folder), "--shutdown-grace", "2"]
    process = ServerProcess(argv, port, "specdec serve").start(90)
    try:
        yield process.url
    finally:
        process.stop()


def _post(url, path, body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def rewrite(data: bytes, change) -> bytes:
    """A slot file whose header ``change`` edited, with a checksum that matches again (a forged file)."""
    from specdec.decoding.slot_file import DIGEST, MAGIC

    start = len(MAGIC)
    (length,) = struct.unpack("<I", data[start:start + 4])
    header = json.loads(data[start + 4:start + 4 + length])
    change(header)
    raw = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(raw)) + raw + data[start + 4 + length:-DIGEST]
    return body + hashlib.sha256(body).digest()


def test_save_then_restore_in_a_fresh_server_is_warm_and_exact(fim_bundle, tmp_path):
    from specdec.decoding.decoder import SpeculativeDecoder
    from specdec.sampling.processors import SamplingConfig

    with serve(fim_bundle, tmp_path) as url:
        first = _ok(_post(url, "/completion", {"prompt": PROMPT, **GREEDY}))
        saved = _ok(_post(url, "/slots/0?action=save", {"filename": "conversation.bin"}))
        prompt_ids = _ok(_post(url, "/tokenize", {"content": PROMPT, "add_special": True}))["tokens"]
        more = _ok(_post(url, "/tokenize", {"content": "\n    def pop(self):\n"}))["tokens"]
    assert saved["id_slot"] == 0 and saved["filename"] == "conversation.bin" and saved["timings"]["save_ms"] >= 0
    assert first["tokens_evaluated"] - 1 <= saved["n_saved"] <= first["tokens_cached"]
    assert saved["n_written"] == (tmp_path / "conversation.bin").stat().st_size
    next_turn = prompt_ids + first["tokens"] + more  # the conversation's next turn, as token ids

    with serve(fim_bundle, tmp_path) as url:  # a fresh process: its caches are empty
        assert _ok(_post(url, "/completion", {"prompt": "zz", "n_predict": 1}))["timings"]["cache_n"] == 0
        restored = _ok(_post(url, "/slots/0?action=restore", {"filename": "conversation.bin"}))
        assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
        assert httpx.get(f"{url}/slots").json()[0]["specdec"]["target_tokens"] == saved["n_saved"]
        warm = _ok(_post(url, "/completion", {"prompt": next_turn, **GREEDY}))
        assert warm["timings"]["cache_n"] == saved["n_saved"]  # warm: nothing saved is computed again
        erased = _ok(_post(url, "/slots/0?action=erase", {}))
        assert erased == {"id_slot": 0, "n_erased": warm["tokens_cached"]}
        cold = _ok(_post(url, "/completion", {"prompt": next_turn, **GREEDY}))
    assert cold["timings"]["cache_n"] == 0
    assert (warm["tokens"], warm["content"]) == (cold["tokens"], cold["content"])
    reference = SpeculativeDecoder.load(fim_bundle).generate(next_turn, max_new_tokens=16,
                                                             sampling=SamplingConfig(temperature=0.0))
    assert warm["tokens"] == reference.token_ids


def test_refused_files_leave_the_cache_as_it_was(fim_bundle, tmp_path):
    """Each bad file is refused with one line and nothing loaded: the request after the refusal is served exactly
    as the same request before it (text, tokens, cached tokens), and the slot holds what it held."""
    request = {"prompt": "def area(r):\n    return 3.14 * r * r\n", **GREEDY}
    with serve(fim_bundle, tmp_path) as url:
        _ok(_post(url, "/completion", request))
        before = _ok(_post(url, "/completion", request))  # steady: the slot holds this prompt and its answer
        held = httpx.get(f"{url}/slots").json()[0]["specdec"]
        good = _ok(_post(url, "/slots/0?action=save", {"filename": "good.bin"}))
        data = (tmp_path / "good.bin").read_bytes()
        middle = len(data) // 2
        bad = {
            "payload-byte.bin": (data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:], "checksum"),
            "header-byte.bin": (data[:40] + bytes([data[40] ^ 1]) + data[41:], "damaged"),
            "digest-byte.bin": (data[:-1] + bytes([data[-1] ^ 1]), "checksum"),
            "truncated.bin": (data[:-100], "truncated"),
            "appended.bin": (data + b"\0", "bytes appended"),
            "other-bundle.bin": (rewrite(data, lambda h: h.update(bundle="0" * 64)), "another bundle"),
            "newer.bin": (rewrite(data, lambda h: h.update(format=2)), "newer than this specdec"),
            "no-draft.bin": (rewrite(data, lambda h: h.update(models=h["models"][:1])), "holds the caches of"),
            "not-a-slot.bin": (b"my notes\n" * 10, "not a specdec slot file"),
            "empty.bin": (b"", "not a specdec slot file"),
        }
        for name, (content, _) in bad.items():
            (tmp_path / name).write_bytes(content)
        for name, (_, phrase) in bad.items():
            response = _post(url, "/slots/0?action=restore", {"filename": name})
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert phrase in error["message"] and "\n" not in error["message"], (name, error)
            assert (error["code"], error["param"]) == (400, "filename")
            assert httpx.get(f"{url}/slots").json()[0]["specdec"] == held, name
            after = _ok(_post(url, "/completion", request))
            assert (after["content"], after["tokens"], after["timings"]["cache_n"]) == (
                before["content"], before["tokens"], before["timings"]["cache_n"]), name
        assert _ok(_post(url, "/slots/0?action=restore", {"filename": "good.bin"}))["n_restored"] == good["n_saved"]


def test_filenames_stay_in_the_folder_and_saves_replace_no_one_elses_file(fim_bundle, tmp_path):
    folder, outside = tmp_path / "slots", tmp_path / "outside.bin"
    folder.mkdir()
    outside.write_bytes(b"not yours")
    (folder / "link.bin").symlink_to(outside)
    (folder / "notes.txt").write_text("a user's own file")
    with serve(fim_bundle, folder) as url:
        _ok(_post(url, "/completion", {"prompt": "x = 1\n", **GREEDY}))
        for name in ("../outside.bin", "sub/a.bin", "..", ".", "a\\b.bin", " a.bin", "a.bin.", "a..bin",
                     str(outside), "link.bin", "", "a:b", "x" * 256):
            for action in ("save", "restore"):
                response = _post(url, f"/slots/0?action={action}", {"filename": name})
                assert response.status_code == 400, (name, response.text)
                assert response.json()["error"]["message"] == "Invalid filename", (name, response.text)
        assert outside.read_bytes() == b"not yours"
        conflict = _post(url, "/slots/0?action=save", {"filename": "notes.txt"})
        assert conflict.status_code == 409 and "not a specdec slot file" in conflict.json()["error"]["message"]
        assert (folder / "notes.txt").read_text() == "a user's own file"
        first = _ok(_post(url, "/slots/0?action=save", {"filename": "mine.bin"}))
        assert _ok(_post(url, "/slots/0?action=save", {"filename": "mine.bin"})) | {"timings": None} == \
            first | {"timings": None}  # this bundle's own file: replaced (atomically)
        foreign = rewrite((folder / "mine.bin").read_bytes(), lambda h: h.update(bundle="f" * 64))
        (folder / "theirs.bin").write_bytes(foreign)
        refused = _post(url, "/slots/0?action=save", {"filename": "theirs.bin"})
        assert refused.status_code == 409 and "another bundle" in refused.json()["error"]["message"]
        assert (folder / "theirs.bin").read_bytes() == foreign
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


def test_without_a_save_path_slot_actions_are_501(fim_bundle):
    from fastapi.testclient import TestClient

    from specdec.serving.app import ServerOptions, build_app

    with TestClient(build_app(fim_bundle, ServerOptions(model_name="m"))) as client:
        for action in ("save", "restore", "erase"):
            response = client.post(f"/slots/0?action={action}", json={"filename": "a.bin"})
            assert response.status_code == 501, response.text
            assert response.json()["error"]["type"] == "not_supported_error"
            assert "--slot-save-path" in response.json()["error"]["message"]
        assert client.get("/slots").status_code == 200  # monitoring needs no folder


def test_no_slots_and_a_server_seed(fim_bundle):
    """``--no-slots``: GET /slots is a 501 and /props says so; ``--seed N``: a sampled request without a seed is
    the request with seed N (and /props' default params name it), one with its own seed keeps it."""
    from fastapi.testclient import TestClient

    from specdec.serving.app import ServerOptions, build_app

    options = ServerOptions(model_name="m", slots_endpoint=False, seed=7)
    body = {"prompt": "def area(r):", "n_predict": 12, "temperature": 1.5, "return_tokens": True}
    with TestClient(build_app(fim_bundle, options)) as client:
        refused = client.get("/slots")
        assert refused.status_code == 501 and refused.json()["error"]["type"] == "not_supported_error"
        props = client.get("/props").json()
        assert props["endpoint_slots"] is False and props["default_generation_settings"]["params"]["seed"] == 7
        unseeded = [client.post("/completion", json=body).json()["tokens"] for _ in range(2)]
        seeded = client.post("/completion", json={**body, "seed": 7}).json()["tokens"]
        other = client.post("/completion", json={**body, "seed": 8}).json()["tokens"]
    assert unseeded[0] == unseeded[1] == seeded != other
    with pytest.raises(ValueError, match="seed must be an integer"):
        ServerOptions(model_name="m", seed=-1)


def test_several_chat_choices(fim_bundle):
    """``n`` (and llama-server's ``id_slot``) on the chat route: n choices, choice i sampled with seed + i (the request's or the server's), so choice
    0 is the n=1 answer and the others differ from it; greedy choices are equal; usage counts the prompt once;
    n with stream is a 400 naming n."""
    from fastapi.testclient import TestClient

    from specdec.serving.app import ServerOptions, build_app

    body = {"messages": [{"role": "user", "content": "def area(r):"}], "max_tokens": 10, "temperature": 1.5}
    with TestClient(build_app(fim_bundle, ServerOptions(model_name="m", seed=3))) as client:
        several = client.post("/v1/chat/completions", json={**body, "n": 3, "id_slot": 0}).json()
        no_slot = client.post("/v1/chat/completions", json={**body, "id_slot": 1})  # one worker: slot 0 only
        texts = [choice["message"]["content"] for choice in several["choices"]]
        alone = [client.post("/v1/chat/completions", json={**body, "seed": 3 + i}).json() for i in range(3)]
        greedy = client.post("/v1/chat/completions", json={**body, "n": 2, "temperature": 0}).json()
        streamed = client.post("/v1/chat/completions", json={**body, "n": 2, "stream": True})
        too_many = client.post("/v1/chat/completions", json={**body, "n": 9})
    assert [c["index"] for c in several["choices"]] == [0, 1, 2]
    assert texts == [a["choices"][0]["message"]["content"] for a in alone] and len(set(texts)) > 1
    assert several["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert several["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "n"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert no_slot.status_code == 400 and no_slot.json()["error"]["param"] == "id_slot"


def test_a_refusal_check_that_touched_the_cache_would_be_caught(fim_bundle, tmp_path, monkeypatch):
    """Planted failure: a restore that changes the cache before it refuses (as one that loaded the target and
    then found the draft wrong would) makes the next request differ from the one before the refusal, which is
    what test_refused_files_leave_the_cache_as_it_was compares."""
    import specdec.decoding.slot_file as slot_file
    from specdec.decoding.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(fim_bundle)
    prompt = decoder.codec.encode("def area(r):\n    return 3.14 * r * r\n")
    decoder.generate(prompt, max_new_tokens=8)
    before = decoder.generate(prompt, max_new_tokens=8)
    decoder.save_caches(tmp_path / "good.bin")
    (tmp_path / "bad.bin").write_bytes((tmp_path / "good.bin").read_bytes()[:-1])
    with pytest.raises(slot_file.SlotFileError, match="truncated"):
        decoder.restore_caches(tmp_path / "bad.bin")
    assert decoder.generate(prompt, max_new_tokens=8).stats.cached_tokens == before.stats.cached_tokens

    def careless(decoder, path):
        decoder.target.reset()
        raise slot_file.SlotFileError("refused after touching the cache")

    monkeypatch.setattr(slot_file, "read_slot", careless)
    with pytest.raises(slot_file.SlotFileError):
        decoder.restore_caches(tmp_path / "bad.bin")
    assert decoder.generate(prompt, max_new_tokens=8).stats.cached_tokens != before.stats.cached_tokens


def test_header_checks_against_the_loaded_bundle(fim_bundle, tmp_path):
    """Forged headers with valid checksums: token counts past the context, shapes or dtypes this runner does not
    have, ids outside the vocabulary; each refused before any cache is touched."""
    import numpy as np

    from specdec.decoding.decoder import SpeculativeDecoder
    from specdec.decoding.slot_file import MAGIC, SlotFileError

    decoder = SpeculativeDecoder.load(fim_bundle)
    decoder.generate("def f(x):\n    return x\n", max_new_tokens=4)
    decoder.save_caches(tmp_path / "good.bin")
    data = (tmp_path / "good.bin").read_bytes()

    def shape(header):
        header["models"][0]["shape"][0] += 1

    def dtype(header):
        header["models"][0]["dtype"] = "<f4" if header["models"][0]["dtype"] == "<f2" else "<f2"

    def tokens(header):
        header["models"][0]["tokens"] = decoder.max_context + 1

    cases = {"shape": (shape, "cache is"), "dtype": (dtype, "cache is"), "tokens": (tokens, "context")}
    held = decoder.target.length
    for name, (change, phrase) in cases.items():
        (tmp_path / f"{name}.bin").write_bytes(rewrite(data, change))
        with pytest.raises(SlotFileError, match=phrase):
            decoder.restore_caches(tmp_path / f"{name}.bin")
        assert decoder.target.length == held
    start = len(MAGIC)
    (length,) = struct.unpack("<I", data[start:start + 4])
    ids_at = start + 4 + length  # the target's first token id
    forged = bytearray(data[:-32])
    forged[ids_at:ids_at + 8] = np.int64(10**6).tobytes()
    (tmp_path / "vocab.bin").write_bytes(bytes(forged) + hashlib.sha256(bytes(forged)).digest())
    with pytest.raises(SlotFileError, match="vocabulary"):
        decoder.restore_caches(tmp_path / "vocab.bin")
    assert decoder.target.length == held


@pytest.mark.parametrize("name", ["a.bin", "slot-0.bin", "conversation 1.bin", "été.bin", "x" * 255])
def test_ordinary_filenames_are_allowed(tmp_path, name):
    from specdec.decoding.slot_file import slot_path

    assert slot_path(tmp_path, name) == tmp_path.resolve() / name


def test_slot_timing_tool_runs_on_the_tiny_bundle(fim_bundle, tmp_path):
    """tools/measure/slot_timing.py: cold first turn, save, restart, restore, the next turn restored and cold; its table,
    and the restored and cold answers are the same tokens."""
    tool = TOOLS / "measure" / "slot_timing.py"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    done = subprocess.run([sys.executable, str(tool), str(fim_bundle), "--prompt-file", str(prompt), "--max-tokens",
                           "8", "--keep", str(tmp_path / "kept")], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert "| restore slot 0 |" in done.stdout and "next turn restored vs cold: the same " in done.stdout
    assert (tmp_path / "kept" / "slot_timing.bin").stat().st_size > 0
