"""``token_sources``: the streamed text split by the proposer of its tokens (serving/jobs.py ``SourceSpans``).

Unit tests drive the server's real job (``stream_work``) over the decoder's real text path (``RequestState.commit``,
``StopStrings``, ``TextStream``) on scripted rounds of tokens, with a byte-level BPE tokenizer (characters split
across tokens, special tokens) and a SentencePiece-style one (a word's leading space, byte fallback). The oracle
does not share the code under test: a character belongs to the first token whose prefix decodes to the text up to
and including it. The integration tests compare the server's spans with ``GenerationResult.sources`` of the same
greedy request on the tiny chat bundle.
"""

from __future__ import annotations

import json

import pytest

from specdec.decoding.options import GenerationOptions
from specdec.decoding.text.codec import TextCodec, _byte_level_alphabet
from paths import TOOLS

END_OF_TURN = "<|im_end|>"


# ----------------------------------------------------------------------------- tokenizers made here
@pytest.fixture(scope="module")
def byte_codec(tmp_path_factory):
    """Byte-level BPE (as Qwen's, GPT-2's): one token per byte, plus "a"+first byte of "é", "wor", "ld", a special
    end-of-turn token and a non-special added token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    alphabet = _byte_level_alphabet()
    vocab = {char: byte for byte, char in enumerate(alphabet)}
    for word in ("a" + alphabet[0xC3], "wor", "ld"):
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(END_OF_TURN, special=True)])
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    path = tmp_path_factory.mktemp("byte-level") / "tokenizer.json"
    tokenizer.save(str(path))
    return TextCodec(path)


@pytest.fixture(scope="module")
def piece_codec(tmp_path_factory):
    """SentencePiece style (Llama 2, Mistral): "▁" for a space, <0xNN> byte fallback, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<eos>": 1}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for word in ("▁Hello", "▁world", "!", "▁été", "▁"):
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    path = tmp_path_factory.mktemp("sentencepiece") / "tokenizer.json"
    tokenizer.save(str(path))
    return TextCodec(path)


def _bytes(text: str) -> list:
    """Byte-level token ids of ``text``, one a byte."""
    return list(text.encode("utf-8"))


# ----------------------------------------------------------------------------- the job over scripted rounds
class ScriptedStream:
    """A decoder whose ``stream`` commits scripted rounds ``[(tokens, source)]`` through the decoder's own text
    path (``RequestState.commit``: the round's last token is the target's; EOS, stop ids, stop strings, the
    budget), then the final flush, as ``SpeculativeDecoder._pieces`` does."""

    def __init__(self, codec, rounds, eos_ids=()):
        self.codec, self.rounds, self.eos_ids = codec, rounds, frozenset(eos_ids)

    def stream(self, prompt_ids, options, stats=None):
        from specdec.decoding.decoder import TextStream
        from specdec.decoding.request import Limits, RequestState, make_request

        vocab = self.codec.tokenizer.get_vocab_size()
        request = make_request(self.codec, Limits(vocab, 4096, True, self.eos_ids), prompt_ids, options)
        state = self.state = RequestState(request, self.codec, self.eos_ids, vocab, stats=stats)

        def pieces():
            for tokens, source in self.rounds:
                if state.finish:
                    break
                piece = state.commit(list(tokens), source)
                if piece:
                    yield piece
            tail = state.text.finish()
            if tail:
                yield tail

        return TextStream(pieces(), state)


def run_job(codec, rounds, sources=True, eos_ids=(), **options):
    """The server's job on the scripted rounds: (pieces, Done, the tokens' sources)."""
    from specdec.serving.jobs import Done, Prepared, stream_work

    prepared = Prepared([65], GenerationOptions(max_new_tokens=options.pop("max_new_tokens", 64), **options),
                        sources=sources)
    scripted = ScriptedStream(codec, rounds, eos_ids)
    items = list(stream_work(prepared, codec)(scripted))
    assert isinstance(items[-1], Done)
    assert len(scripted.state.sources) == len(items[-1].output_ids)
    return items[:-1], items[-1], list(scripted.state.sources)


def expected_sources(codec, text: str, ids: list, sources: list) -> list:
    """Per character of ``text``: the source of the first token whose prefix decodes to the text up to and
    including that character (a character split across tokens: the token completing it)."""
    prefixes = [codec.decode(ids[: k + 1]) for k in range(len(ids))]
    out = []
    for index in range(len(text)):
        owner = next(k for k, decoded in enumerate(prefixes) if decoded[: index + 1] == text[: index + 1])
        out.append(sources[owner])
    return out


def span_problems(codec, pieces, done, sources, spans_of=lambda piece: piece.spans) -> list:
    """What is wrong with the pieces' spans, against the tokens' sources (empty: nothing)."""
    problems = []
    for number, piece in enumerate(pieces):
        spans = spans_of(piece)
        if spans is None:
            problems.append(f"piece {number} {piece.text!r} has no spans")
            continue
        if "".join(text for text, _ in spans) != piece.text:
            problems.append(f"piece {number}: spans {spans!r} do not concatenate to {piece.text!r}")
    if problems:
        return problems
    text = "".join(piece.text for piece in pieces)
    got = [source for piece in pieces for span_text, source in spans_of(piece) for _ in span_text]
    want = expected_sources(codec, text, done.output_ids, sources)
    wrong = [(i, text[i], g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return [f"character {i} {c!r}: source {g!r}, the tokens say {w!r}" for i, c, g, w in wrong[:5]]


def byte_rounds(codec):
    """A draft round ending inside "é" (a + its first byte), the target completing it; an emoji split over a
    suffix round and the target; "€" over lookup; a non-special added token."""
    a_c3 = codec.token_id("a" + _byte_level_alphabet()[0xC3])
    emoji, euro = _bytes("😀"), _bytes("€")
    return [([72, 105, a_c3], "draft"), ([0xA9, 32], "draft"), ([emoji[0], emoji[1], emoji[2]], "suffix"),
            ([emoji[3]], "suffix"), ([euro[0], euro[1], euro[2], codec.token_id("<tool>")], "lookup"),
            ([33, 10], "draft")]


CASES = {
    # characters split across tokens of different sources
    "multi-byte": dict(rounds=byte_rounds),
    # a stop string cuts the text inside a token's text ("wor" + "ld"): the spans stop where the text does
    "stop string": dict(rounds=lambda c: [([72, 32, c.token_id("wor")], "draft"), ([c.token_id("ld"), 33], "suffix"),
                                          ([10, 10], "draft")], stop=("orl",)),
    # a stop string's prefix held back, then released by a token that does not complete it
    "held stop prefix": dict(rounds=lambda c: [([120, 121], "draft"), ([113, 33], "suffix"), ([33], "lookup")],
                             stop=("xyz",)),
    # the end-of-turn token (special, a stop id) ends the answer and adds no text
    "end of turn": dict(rounds=lambda c: [([72, 105], "draft"), ([33, c.token_id(END_OF_TURN)], "draft")],
                        stop_token_ids=("eot",)),
    # a special token inside the answer: the text skips it, the spans too
    "special inside": dict(rounds=lambda c: [([72, c.token_id(END_OF_TURN), 105], "suffix"), ([33, 33], "draft")]),
    # the budget ends inside a character: the decoder's final flush gives it out (a replacement character)
    "cut character": dict(rounds=lambda c: [([72, 105], "draft"), ([0xE2, 0x82], "suffix")], max_new_tokens=4),
}


def _case(codec, name):
    case = dict(CASES[name])
    rounds = case.pop("rounds")(codec)
    if case.get("stop_token_ids") == ("eot",):
        case["stop_token_ids"] = (codec.token_id(END_OF_TURN),)
    return rounds, case


@pytest.mark.parametrize("name", list(CASES))
def test_spans_follow_the_tokens_byte_level(byte_codec, name):
    rounds, options = _case(byte_codec, name)
    pieces, done, sources = run_job(byte_codec, rounds, **options)
    assert pieces and span_problems(byte_codec, pieces, done, sources) == []
    if name == "stop string":
        assert "".join(p.text for p in pieces) == "H w" and done.finish == "stop"
    if name == "end of turn":
        assert done.finish == "stop" and "".join(p.text for p in pieces) == "Hi!"
    if name == "cut character":
        assert pieces[-1].spans[-1] == ("\ufffd", "suffix")  # the first token holding it: E2 (a suffix proposal)
    if name == "multi-byte":  # "a" is the target's "a"+0xC3 token's; the draft's 0xA9 completes "é"
        assert [span for piece in pieces for span in piece.spans][1:3] == [("a", "target"), ("é", "draft")]
    if name == "held stop prefix":  # "xy" waited for the next token, then went out with its own sources
        assert pieces[0].spans[:2] == [("x", "draft"), ("y", "target")]


def test_spans_follow_the_tokens_sentencepiece(piece_codec):
    """A word's leading space (stripped only at the start of the text) and byte fallback ("<0xC3>" "<0xA9>")."""
    vocab = piece_codec.tokenizer.get_vocab()
    rounds = [([vocab["▁Hello"], vocab["▁world"]], "draft"), ([vocab["<0xC3>"], vocab["<0xA9>"]], "suffix"),
              ([vocab["▁été"], vocab["!"], vocab["<eos>"]], "lookup")]
    pieces, done, sources = run_job(piece_codec, rounds, eos_ids=(vocab["<eos>"],))
    assert "".join(p.text for p in pieces) == "Hello worldé été!" and done.finish == "eos"
    assert span_problems(piece_codec, pieces, done, sources) == []


@pytest.mark.parametrize("which", ["multi-byte", "sentencepiece"])
def test_planted_per_token_text_is_caught(byte_codec, piece_codec, which, monkeypatch):
    """Token texts decoded one by one, without the tokens before them (a character split across tokens becomes
    replacement characters, SentencePiece loses its spaces): the check reports it."""
    from specdec.serving import jobs

    def planted(self, token, source):  # each token's text decoded alone (a byte table's view)
        self.queue.append([len(self.codec.decode([token])), source])

    monkeypatch.setattr(jobs.SourceSpans, "_push", planted)
    if which == "multi-byte":
        codec, (rounds, options), eos = byte_codec, _case(byte_codec, "multi-byte"), ()
    else:
        codec, vocab = piece_codec, piece_codec.tokenizer.get_vocab()
        rounds, options = [([vocab["▁Hello"], vocab["▁world"], vocab["!"]], "draft")], {}
        eos = ()
    pieces, done, sources = run_job(codec, rounds, eos_ids=eos, **options)
    assert span_problems(codec, pieces, done, sources), "the planted splitter went unnoticed"


def test_planted_dropped_spans_are_caught(byte_codec):
    """A piece without spans, or with spans that lose text, is reported."""
    pieces, done, sources = run_job(byte_codec, byte_rounds(byte_codec))
    assert span_problems(byte_codec, pieces, done, sources, spans_of=lambda piece: None)
    assert span_problems(byte_codec, pieces, done, sources, spans_of=lambda piece: piece.spans[1:] or [("", "target")])
    shifted = lambda piece: [(text, "target") for text, _ in piece.spans]  # noqa: E731
    assert span_problems(byte_codec, pieces, done, sources, spans_of=shifted)


def test_no_span_work_without_token_sources(byte_codec, monkeypatch):
    """A request that does not ask for sources runs no span code at all (and its pieces carry none)."""
    from specdec.serving import jobs

    def refuse(*args, **kwargs):
        raise AssertionError("SourceSpans used without token_sources")

    monkeypatch.setattr(jobs, "SourceSpans", refuse)
    pieces, _, _ = run_job(byte_codec, byte_rounds(byte_codec), sources=False)
    assert pieces and all(piece.spans is None for piece in pieces)
    with pytest.raises(AssertionError, match="without token_sources"):  # the guard itself works
        run_job(byte_codec, byte_rounds(byte_codec), sources=True)


def test_target_passes_are_the_decode_loops():
    """``specdec.target_passes`` counts the decode loop's target passes, not the prefill's."""
    from specdec.decoding.request import GenerationStats
    from specdec.serving.dialects.openai import specdec_fields
    from specdec.serving.jobs import Done

    stats = GenerationStats(new_tokens=12, rounds=5, target_forwards=8, prefill_forwards=3)
    assert specdec_fields(Done(stats, 0.0))["target_passes"] == 5


# ----------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def chat_decoder(chat_bundle):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder.load(chat_bundle)


@pytest.fixture(scope="module")
def server_url(chat_decoder):
    pytest.importorskip("uvicorn")
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions
    from served_app import served_app as _uvicorn

    pool = DecoderPool(chat_decoder.fork(), PoolOptions(workers=1, max_queue=4))
    with _uvicorn(create_app(pool, ServerOptions(model_name="tiny-chat", shutdown_grace=1.0))) as (url, _):
        yield url


MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
DRAFT_CHAIN = dict(proposer="draft", num_draft_tokens=4)  # a fixed chain: the same proposals in both runs


def _stream(url, route, body):
    """(text, [(text, source)], final specdec block) of a streamed answer."""
    import httpx

    text, spans, final = [], [], None
    with httpx.stream("POST", f"{url}{route}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0]
            piece = choice.get("text") if "text" in choice else (choice["delta"].get("content") or "")
            block = chunk.get("specdec") or {}
            if piece:
                assert "sources" in block, f"a chunk with text has no sources: {chunk}"
                assert "".join(s["text"] for s in block["sources"]) == piece
                spans += [(s["text"], s["source"]) for s in block["sources"]]
            text.append(piece or "")
            if choice["finish_reason"]:
                final = block
    return "".join(text), spans, final


def _expected_spans(codec, result, text):
    from specdec.serving.jobs import merge_spans

    chars = expected_sources(codec, text, result.token_ids, result.sources)
    return merge_spans(list(zip(text, chars)))


def _reference(decoder, route, **options):
    """``GenerationResult`` of the request in-process: ``dec.chat`` / ``dec.generate``."""
    from specdec.decoding.text.chat import chat

    if route == "chat":
        return chat(decoder, MESSAGES, max_new_tokens=40, **DRAFT_CHAIN, **options)
    return decoder.generate(PROMPT, max_new_tokens=40, **DRAFT_CHAIN, **options)


PROMPT = "def add(a, b):"
ROUTES = {"chat": ("/v1/chat/completions", {"messages": MESSAGES}), "completions": ("/v1/completions", {"prompt": PROMPT})}


@pytest.mark.parametrize("route", list(ROUTES))
def test_server_spans_equal_the_api_sources(chat_decoder, server_url, route):
    """Streamed and whole answers: the spans concatenate to the content, and their sources are the ones
    ``GenerationResult.sources`` gives the same greedy request; with a stop string cutting the text too."""
    import httpx

    from specdec.serving.jobs import merge_spans

    result = _reference(chat_decoder, route)
    assert {"draft", "target"} <= set(result.sources), "the request should mix proposals and target tokens"
    want = _expected_spans(chat_decoder.codec, result, result.text)
    path, fields = ROUTES[route]
    body = {**fields, "model": "tiny-chat", "max_tokens": 40, "temperature": 0, "token_sources": True, **DRAFT_CHAIN}
    text, spans, final = _stream(server_url, path, body)
    assert text == result.text and merge_spans(spans) == want
    assert final["target_passes"] == final["rounds"] == result.stats.rounds
    whole = httpx.post(f"{server_url}{path}", json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert (choice["message"]["content"] if route == "chat" else choice["text"]) == result.text
    assert [(s["text"], s["source"]) for s in whole["specdec"]["sources"]] == want
    plain = httpx.post(f"{server_url}{path}", json={**body, "token_sources": False}, timeout=60).json()
    assert "sources" not in plain["specdec"]  # not asked: not sent
    stop = result.text[5:8]
    assert len(stop) == 3, "the answer should be long enough to cut"
    cut = _reference(chat_decoder, route, stop=[stop])
    text, spans, _ = _stream(server_url, path, {**body, "stop": [stop]})
    assert text == cut.text == result.text[: result.text.index(stop)]
    assert merge_spans(spans) == _expected_spans(chat_decoder.codec, cut, cut.text)


def test_server_spans_stop_at_the_end_of_turn(chat_decoder, server_url):
    """An answer that ends with the template's end-of-turn token (its output constrained to a short text, so the
    model must end the turn): the spans hold the text, not the end token, and match ``GenerationResult.sources``."""
    from specdec import Constraint
    from specdec.decoding.text.chat import chat
    from specdec.serving.jobs import merge_spans

    from conftest import TINY_END_OF_TURN

    grammar = 'root ::= "<b>add</b> = a + b"'
    result = chat(chat_decoder, MESSAGES, max_new_tokens=40, constraint=Constraint.gbnf(grammar), **DRAFT_CHAIN)
    assert result.finish_reason == "stop" and result.token_ids[-1] == chat_decoder.codec.token_id(TINY_END_OF_TURN)
    body = {"messages": MESSAGES, "model": "tiny-chat", "max_tokens": 40, "temperature": 0, "token_sources": True,
            "grammar": grammar, **DRAFT_CHAIN}
    text, spans, final = _stream(server_url, "/v1/chat/completions", body)
    assert text == result.text == "<b>add</b> = a + b"
    assert merge_spans(spans) == _expected_spans(chat_decoder.codec, result, text)
    assert final["target_passes"] == result.stats.rounds


def test_target_only_makes_one_token_a_pass(chat_decoder, server_url):
    """``num_draft_tokens: 0``: every decode pass makes one token (target_passes = completion tokens), every span is
    the target's; the prefill's passes are not counted."""
    import httpx

    from specdec.decoding.text.chat import chat

    body = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "token_sources": True,
            "num_draft_tokens": 0}
    answer = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer["specdec"]["target_passes"] == answer["usage"]["completion_tokens"] == answer["specdec"]["rounds"]
    assert {s["source"] for s in answer["specdec"]["sources"]} == {"target"}
    chat_decoder.clear_cache()  # a cold prefill: its passes are counted in target_forwards, not in decode_forwards
    result = chat(chat_decoder, MESSAGES, max_new_tokens=24, num_draft_tokens=0)
    assert result.stats.target_forwards > result.stats.decode_forwards == len(result.token_ids)


def test_sources_overhead_tool_runs(chat_bundle):
    """tools/measure/sources_overhead.py on the tiny bundle: same answers with and without the field, and a ratio."""
    import subprocess
    import sys
    
    tool = TOOLS / "measure" / "sources_overhead.py"
    done = subprocess.run([sys.executable, str(tool), str(chat_bundle), "--requests", "2", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "with token_sources:" in done.stdout and "x (sums:" in done.stdout
