"""Cache reuse across requests: a warm cache changes what is computed, never the tokens.

A decoder keeps, for each model, the longest prefix of a new request that its cache holds (the
runner records the token and position of every slot) and computes only the rest. Every mode,
greedy and seeded sampling, must return exactly the tokens a cold decoder returns, whatever the
previous request left behind: the same prompt again, a chat's next turn (prompt + reply + more),
a prompt that diverges part-way, a shorter one, one after a warm-up (max_new_tokens=0).
"""

from __future__ import annotations

import numpy as np
import pytest

from scripted import ScriptedRunner, scripted_decoder
from specdec.sampling.processors import SamplingConfig

PROMPT = "abc kab<c\nab cab"
MODES = [dict(num_draft_tokens=0), dict(num_draft_tokens=2, proposer="draft"), dict(num_draft_tokens=3, proposer="lookup"),
         dict(proposer="hybrid"), dict(num_draft_tokens="auto"), dict(tree="2,1"), dict(tree="auto")]
SAMPLINGS = [dict(), dict(sampling=SamplingConfig(temperature=0.9, top_k=8), seed=5),
             dict(sampling=SamplingConfig(temperature=1.0, top_p=0.9), seed=2, acceptance="rejection")]


def _previous_requests(decoder, prompt_ids, reply_ids):
    """What a user might have sent before: each leaves the cache in a different state."""
    return {
        "same prompt": prompt_ids,
        "next turn": prompt_ids + reply_ids[:7] + prompt_ids[:5],
        "diverges": prompt_ids[:6] + [(t + 1) % 15 for t in prompt_ids[6:]],
        "longer": prompt_ids + reply_ids + prompt_ids,
        "shorter": prompt_ids[:3],
    }


@pytest.mark.parametrize("options", SAMPLINGS, ids=["greedy", "coupled", "rejection"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_warm_cache_returns_the_cold_tokens(mode, options):
    if options.get("acceptance") == "rejection" and (mode.get("num_draft_tokens") == "auto" or mode.get("tree") == "auto"
                                                     or mode.get("proposer") == "hybrid"):
        pytest.skip("rejection sampling is reproducible only with a fixed schedule")
    cold = scripted_decoder()
    warm = scripted_decoder()
    prompt_ids = cold.codec.encode(PROMPT)
    reply = cold.generate(prompt_ids, max_new_tokens=24, num_draft_tokens=0).token_ids
    for name, previous in _previous_requests(cold, prompt_ids, reply).items():
        for question in (prompt_ids, previous + prompt_ids[:4]):
            warm.generate(previous, max_new_tokens=9, **mode, **options)  # leaves previous + its reply in the caches
            expected = cold.fork().generate(question, max_new_tokens=20, **mode, **options)
            got = warm.generate(question, max_new_tokens=20, **mode, **options)
            assert got.token_ids == expected.token_ids, (name, question)
            assert got.text == expected.text


def test_a_next_turn_computes_only_the_new_tokens():
    decoder = scripted_decoder()
    prompt_ids = decoder.codec.encode(PROMPT)
    first = decoder.generate(prompt_ids, max_new_tokens=12, num_draft_tokens=2, proposer="draft")
    assert first.stats.cached_tokens == 0
    turn = prompt_ids + first.token_ids + decoder.codec.encode("ab c")
    second = decoder.generate(turn, max_new_tokens=12, num_draft_tokens=2, proposer="draft")
    # the caches hold the prompt and the reply but its last token (never fed: the request ended on it)
    assert second.stats.cached_tokens == len(prompt_ids) + len(first.token_ids) - 1
    assert second.stats.draft_cached_tokens >= len(prompt_ids)
    assert decoder.cached_prefix(turn) >= second.stats.cached_tokens


def test_a_warm_up_request_prefills_and_returns_nothing():
    decoder = scripted_decoder()
    prompt_ids = decoder.codec.encode(PROMPT)
    warm_up = decoder.generate(prompt_ids, max_new_tokens=0)
    assert warm_up.token_ids == [] and warm_up.text == "" and warm_up.finish_reason == "length"
    assert warm_up.stats.rounds == 0
    after = decoder.generate(prompt_ids + [3, 4], max_new_tokens=5)
    assert after.stats.cached_tokens == len(prompt_ids) - 1  # all but the last token of the warm-up (never fed)


def test_the_cache_is_checked_token_by_token_not_by_length():
    """Planted: a cache that trusted its length would reuse rows of another prompt; the held prefix stops at
    the first differing token, and at a slot written at another position (a tree node)."""
    decoder = scripted_decoder()
    prompt_ids = decoder.codec.encode(PROMPT)
    decoder.generate(prompt_ids, max_new_tokens=6, num_draft_tokens=0)
    other = list(prompt_ids)
    other[4] = (other[4] + 1) % 15
    assert decoder.cached_prefix(other) == 4
    assert decoder.cached_prefix(prompt_ids[:7]) == 7
    decoder.target.slot_positions[2] = 9  # as if slot 2 held a token written at another position
    assert decoder.cached_prefix(prompt_ids) == 2


@pytest.mark.integration
@pytest.mark.parametrize("form", ["tiny_bundle", "tiny_standard_bundle"])
def test_warm_cache_returns_the_cold_tokens_on_exported_graphs(form, request):
    """The same on real onnxruntime graphs (fused and standard forms): rows computed in a chat's earlier
    turn (decode and verify passes) are reused by the next turn's prefill."""
    from specdec import SpeculativeDecoder

    warm = SpeculativeDecoder.load(request.getfixturevalue(form))
    prompt_ids = warm.codec.encode("def add(a, b):\n    return")
    for mode in MODES:
        for options in SAMPLINGS[:2]:
            warm.generate(prompt_ids, max_new_tokens=16, **mode, **options)
            reply = warm.generate(prompt_ids, max_new_tokens=16, **mode, **options)
            turn = prompt_ids + reply.token_ids + prompt_ids[:5]
            got = warm.generate(turn, max_new_tokens=16, **mode, **options)
            cold = warm.fork().generate(turn, max_new_tokens=16, **mode, **options)
            assert got.token_ids == cold.token_ids, (mode, options)
            assert reply.stats.cached_tokens == len(prompt_ids) - 1
            # a tree node's rows are never reused (they may round differently): after a tree reply only the prompt
            assert got.stats.cached_tokens >= len(prompt_ids) + (0 if "tree" in mode else len(reply.token_ids) - 1)


# ----------------------------------------------------------------------------- the prompt cache in host RAM
class SnapshottingRunner(ScriptedRunner):
    """A scripted runner whose "keys/values" (its slot token table) can be snapshotted like a real cache's."""

    _slot_bytes = 64

    def _kv_rows(self, count):  # [count, 8] int64: 64 bytes a slot, as _slot_bytes says
        return np.repeat(self.slot_tokens[:count, None], 8, axis=1)

    def _set_kv_rows(self, rows, count):
        self.slot_tokens[:count] = rows[:count, 0]

    def _fork(self):
        return SnapshottingRunner(self.model, self.max_context, self.max_step_tokens)


def _with_prompt_cache(capacity_bytes: int, identity: str = "bundle-a"):
    from specdec.decoding.prompt_cache import PromptCache

    decoder = scripted_decoder()
    decoder.target = SnapshottingRunner(decoder.target.model, decoder.max_context)
    decoder.draft = SnapshottingRunner(decoder.draft.model, decoder.max_context)
    decoder.prompt_cache = PromptCache(capacity_bytes, identity)
    return decoder


@pytest.mark.parametrize("options", SAMPLINGS[:2], ids=["greedy", "coupled"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_worker_restores_another_worker_s_prefix_and_returns_the_cold_tokens(mode, options):
    first = _with_prompt_cache(1 << 20)
    second = first.fork()  # another worker: its own (empty) caches, the same prompt cache
    prompt_ids = first.codec.encode(PROMPT * 2)
    reply = first.generate(prompt_ids, max_new_tokens=12, **mode, **options)
    turn = prompt_ids + reply.token_ids + prompt_ids[:6]
    got = second.generate(turn, max_new_tokens=16, **mode, **options)
    cold = scripted_decoder().generate(turn, max_new_tokens=16, **mode, **options)
    assert got.token_ids == cold.token_ids
    assert got.stats.cached_tokens >= len(prompt_ids)  # restored from the RAM cache, not computed
    assert first.prompt_cache.stats()["hits"] >= 1


def test_the_prompt_cache_is_bounded_by_bytes_and_evicts_the_least_recent():
    decoder = _with_prompt_cache(capacity_bytes=3 * 40 * 72)  # about three 40-token snapshots
    prompts = [[i] + [(j * 3 + i) % 14 for j in range(39)] for i in range(6)]  # six distinct first tokens
    for ids in prompts:
        decoder.generate(ids, max_new_tokens=2, num_draft_tokens=0)
        assert decoder.prompt_cache.bytes <= decoder.prompt_cache.capacity
    stats = decoder.prompt_cache.stats()
    assert stats["evictions"] >= 3 and stats["entries"] <= 3
    entry, shared = decoder.prompt_cache.lookup("target", prompts[-1])
    assert shared >= 39
    entry, shared = decoder.prompt_cache.lookup("target", prompts[0])
    assert entry is None or shared < 39  # the oldest was evicted


def test_an_entry_of_another_bundle_or_role_is_never_used():
    decoder = _with_prompt_cache(1 << 20, identity="bundle-a")
    prompt_ids = decoder.codec.encode(PROMPT * 3)
    decoder.generate(prompt_ids, max_new_tokens=4, num_draft_tokens=0)
    assert decoder.prompt_cache.lookup("target", prompt_ids)[0] is not None
    assert decoder.prompt_cache.lookup("draft", prompt_ids)[0] is None  # the target's rows are not the draft's
    decoder.prompt_cache.identity = "bundle-b"  # as if another bundle shared the cache
    assert decoder.prompt_cache.lookup("target", prompt_ids)[0] is None


@pytest.mark.integration
@pytest.mark.parametrize("form", ["tiny_bundle", "tiny_standard_bundle"])
def test_a_restored_snapshot_returns_the_cold_tokens_on_exported_graphs(form, request):
    """Real KV rows: one worker's snapshot restored into another worker's cache by one copy."""
    from specdec import SpeculativeDecoder

    bundle = request.getfixturevalue(form)
    first = SpeculativeDecoder.load(bundle, cache_ram_mib=16)
    cold = SpeculativeDecoder.load(bundle)
    prompt_ids = first.codec.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return")
    for mode in (dict(num_draft_tokens=2, proposer="draft"), dict(tree="2,1"), dict(num_draft_tokens=0)):
        reply = first.generate(prompt_ids, max_new_tokens=12, **mode)
        turn = prompt_ids + reply.token_ids + prompt_ids[:4]
        got = first.fork().generate(turn, max_new_tokens=12, **mode)
        assert got.token_ids == cold.generate(turn, max_new_tokens=12, **mode).token_ids, mode
        assert got.stats.cached_tokens >= len(prompt_ids) and got.stats.draft_cached_tokens >= (
            len(prompt_ids) if mode.get("num_draft_tokens") != 0 else 0)
    stats = first.prompt_cache.stats()
    assert stats["hits"] >= 3 and 0 < stats["bytes"] <= 16 * 2**20


# ----------------------------------------------------------------------------- the draft's prefill on long prompts
def test_the_draft_is_skipped_when_its_prefill_costs_more_than_it_can_save(monkeypatch):
    """Default auto hybrid on a long prompt with a short answer: lookup alone proposes (the same tokens); on a
    chat's next turn the draft's cache holds the history, its prefill is small, and the draft runs again."""
    decoder = scripted_decoder(max_context=1024)
    monkeypatch.setattr(decoder, "_observe_prefill", lambda computed, seconds: None)
    decoder._prefill_per_token = 0.2  # the scripted costs' units: a T=1 target pass costs 1.0
    long_prompt = [(j * 5 + j // 7) % 15 for j in range(600)]
    skipped = decoder.generate(long_prompt, max_new_tokens=20)
    assert skipped.stats.draft_skipped and skipped.stats.draft_forwards == 0
    assert skipped.token_ids == decoder.fork().generate(long_prompt, max_new_tokens=20, num_draft_tokens=0).token_ids
    drafted = decoder.generate(long_prompt[:40], max_new_tokens=20)
    assert not drafted.stats.draft_skipped and drafted.stats.draft_forwards > 0
    assert not decoder.generate(long_prompt, max_new_tokens=20, proposer="draft").stats.draft_skipped  # asked for


def test_a_tree_node_s_row_is_never_reused_by_another_request():
    """A tree pass masks columns mid-row (a second sibling skips the first), which may round differently from the
    prefill a cold cache would run: after compaction such a slot holds the right token at the right position,
    yet it is not offered to the next request. Planted: without the rule held_prefix would say 2."""
    runner = ScriptedRunner(scripted_decoder().target.model)
    runner.forward([1, 2, 3], [0, 1, 1], parents=[-1, 0, 0])  # node 2 is the second child of node 0
    runner.commit(3)
    runner.keep_path([0, 2], 0)  # the accepted path: tokens 1, 3 at positions 0, 1
    assert runner.slot_ids[:2].tolist() == [1, 3] and runner.slot_positions[:2].tolist() == [0, 1]
    assert runner.held_prefix([1, 3]) == 1


def test_clear_cache_makes_the_next_request_cold():
    decoder = scripted_decoder()
    prompt_ids = decoder.codec.encode(PROMPT)
    decoder.generate(prompt_ids, max_new_tokens=4)
    assert decoder.cached_prefix(prompt_ids) > 0
    decoder.clear_cache()
    assert decoder.cached_prefix(prompt_ids) == 0
    assert decoder.generate(prompt_ids, max_new_tokens=4).stats.cached_tokens == 0


def test_a_stream_s_finish_reason_is_none_while_it_runs():
    stream = scripted_decoder().stream(PROMPT, max_new_tokens=30, num_draft_tokens=0)
    next(stream)
    assert stream.finish_reason is None
    list(stream)
    assert stream.finish_reason in ("eos", "stop", "length")


def test_the_first_token_of_a_default_request_never_waits_for_the_draft():
    """Default auto hybrid: the draft reads the prompt lazily, in the first round that uses it, and the first round
    never does; the tokens are target-only's. Planted: an eager draft prefill (or a draft first round) fails."""
    decoder = scripted_decoder(eos=None)
    prompt_ids = [int(t) for t in np.random.default_rng(3).integers(0, 15, 60)]  # little for suffix matching
    stream = decoder.stream(prompt_ids, max_new_tokens=40)
    next(stream)
    assert stream.stats.draft_forwards == 0 and stream.stats.rounds == 1
    list(stream)
    expected = decoder.fork().generate(prompt_ids, max_new_tokens=40, num_draft_tokens=0)
    assert stream.token_ids == expected.token_ids


def test_the_first_round_of_a_default_request_is_a_one_token_pass():
    """A warm turn's first token comes after one one-token pass (as target-only's), not after a wide suffix tree
    verify; later rounds speculate. Planted: a first round that proposes fails (the prompt repeats, so the suffix
    tree is there to take)."""
    decoder = scripted_decoder(eos=None)
    prompt_ids = [(j * 5 + j // 7) % 15 for j in range(60)]
    stream = decoder.stream(prompt_ids, max_new_tokens=40)
    next(stream)
    assert stream.stats.rounds == 1 and stream.stats.proposed == 0 and stream.stats.target_forwards == 2
    list(stream)
    assert stream.stats.suffix_rounds > 0
    assert stream.token_ids == decoder.fork().generate(prompt_ids, max_new_tokens=40, num_draft_tokens=0).token_ids
