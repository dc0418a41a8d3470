"""Greedy speculative decoding is token-identical to target-only decoding through the same runtime."""

import pytest

from specdec import SamplingConfig

PROMPTS = ["d", "def add(a, b):\n    return", "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_target_only_for_every_gamma(tiny_decoder, prompt):
    baseline = tiny_decoder.generate(prompt, max_new_tokens=48, num_draft_tokens=0)
    assert baseline.stats.draft_forwards == 0
    for gamma in range(1, 9):
        result = tiny_decoder.generate(prompt, max_new_tokens=48, num_draft_tokens=gamma, proposer="draft")
        assert result.token_ids == baseline.token_ids, f"gamma={gamma}"
        assert result.stats.target_forwards < baseline.stats.target_forwards  # the draft did help


def test_draft_is_useful_but_imperfect(tiny_decoder):
    """The fixture pair must exercise both acceptance and rejection, or the tests above prove little."""
    stats = tiny_decoder.generate(PROMPTS[1], max_new_tokens=64, num_draft_tokens=4, proposer="draft").stats
    assert 0.2 < stats.acceptance_rate < 0.98


def test_greedy_with_repetition_penalty_matches_target_only(tiny_decoder):
    config = SamplingConfig(temperature=0.0, repetition_penalty=1.3)
    baseline = tiny_decoder.generate(PROMPTS[1], max_new_tokens=40, num_draft_tokens=0, sampling=config)
    for gamma in (1, 3, 6):
        result = tiny_decoder.generate(PROMPTS[1], max_new_tokens=40, num_draft_tokens=gamma, sampling=config)
        assert result.token_ids == baseline.token_ids


@pytest.mark.parametrize("eos_index", [0, 3, 10])
def test_eos_inside_a_draft_ends_generation_at_the_same_token(tiny_decoder, eos_index):
    """Make a token the target emits an EOS: speculative output stops exactly where target-only does."""
    prompt = PROMPTS[2]
    free_run = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0).token_ids
    eos = free_run[eos_index]
    saved = tiny_decoder.eos_ids
    tiny_decoder.eos_ids = frozenset({eos})
    try:
        baseline = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
        assert baseline.finish_reason == "eos" and baseline.token_ids[-1] == eos
        for gamma in (2, 5, 8):
            result = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=gamma)
            assert result.token_ids == baseline.token_ids
            assert result.finish_reason == "eos"
    finally:
        tiny_decoder.eos_ids = saved


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_max_new_tokens_is_never_exceeded(tiny_decoder, max_new):
    baseline = tiny_decoder.generate(PROMPTS[0], max_new_tokens=max_new, num_draft_tokens=0)
    result = tiny_decoder.generate(PROMPTS[0], max_new_tokens=max_new, num_draft_tokens=8)
    assert len(result.token_ids) == max_new
    assert result.token_ids == baseline.token_ids


def test_token_id_prompt_equals_text_prompt(tiny_decoder):
    ids = tiny_decoder.codec.encode(PROMPTS[1])
    assert tiny_decoder.generate(ids, max_new_tokens=12).token_ids == tiny_decoder.generate(PROMPTS[1], max_new_tokens=12).token_ids


def test_stream_yields_the_same_text_as_generate(tiny_decoder):
    config = SamplingConfig(temperature=0.8, top_k=30)
    result = tiny_decoder.generate(PROMPTS[1], max_new_tokens=30, num_draft_tokens=3, sampling=config, seed=5)
    streamed = "".join(tiny_decoder.stream(PROMPTS[1], max_new_tokens=30, num_draft_tokens=3, sampling=config, seed=5))
    assert streamed == result.text


def test_same_seed_same_tokens_different_seed_differs(tiny_decoder):
    config = SamplingConfig(temperature=1.0)
    runs = [tiny_decoder.generate(PROMPTS[1], max_new_tokens=24, num_draft_tokens=4, sampling=config, seed=s).token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_string_ends_generation_before_it(tiny_decoder):
    full = tiny_decoder.generate(PROMPTS[1], max_new_tokens=30, num_draft_tokens=0)
    stop = full.text[10:12]
    assert stop
    result = tiny_decoder.generate(PROMPTS[1], max_new_tokens=30, num_draft_tokens=4, stop=[stop])
    assert result.finish_reason == "stop"
    assert stop not in result.text
    assert full.text.startswith(result.text)
    assert len(result.token_ids) <= 12
