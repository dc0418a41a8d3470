"""logit_bias (OpenAI's and llama-server's): added to the model's logits before every other processor, in the
target's distribution and the draft's proposals alike, so speculation stays exact and a banned token never
appears."""

from __future__ import annotations

import numpy as np
import pytest
from scripted import scripted_decoder

from specdec.decoding.options import GenerationError
from specdec.sampling.processors import (SamplingConfig, SamplingError, biased, greedy_token,
                                         sampling_distribution)

MODES = [dict(num_draft_tokens=3, proposer="draft"), dict(tree="2,2,1", proposer="draft"),
         dict(num_draft_tokens="auto"), dict(num_draft_tokens=2, proposer="suffix"),
         dict(num_draft_tokens=2, proposer="lookup")]


def test_bias_is_added_first_and_minus_inf_bans():
    logits = np.array([1.0, 3.0, 2.0, 0.5], dtype=np.float32)
    config = SamplingConfig(temperature=1.0, logit_bias={1: -np.inf, 3: 2.0})
    assert config.logit_bias == ((1, -np.inf), (3, 2.0))
    expected = np.exp(np.array([1.0, -np.inf, 2.0, 2.5]) - 2.5)
    assert np.allclose(sampling_distribution(logits, np.zeros(0, np.int64), config), expected / expected.sum())
    assert greedy_token(logits, np.zeros(0, np.int64), SamplingConfig(logit_bias=((1, -100),))) == 2
    assert biased(logits, ()) is logits and logits[1] == 3.0  # no copy without a bias; never in place
    for bad in ({-1: 1.0}, {1: 101.0}, {1: np.inf}, {"1": 1.0}, {1: True}, [(1,)]):
        with pytest.raises(SamplingError, match="logit_bias"):
            SamplingConfig(logit_bias=bad)


def test_every_mode_equals_target_only_under_a_bias_and_never_emits_a_banned_token():
    """Greedy and coupled seeded sampling, every proposer: the same tokens as target-only decoding with the same
    bias. Applying the bias to the target's rows only in the greedy chooser (not in sampling) or to the draft only
    fails the sampled half or the ban."""
    decoder = scripted_decoder(vocab=16, eos=99, seed=5)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = decoder.generate(prompt, max_new_tokens=30, num_draft_tokens=0).token_ids
    banned = sorted(set(plain))[:3]
    bias = {token: -np.inf for token in banned} | {7: 3.0}
    for sampling in (SamplingConfig(logit_bias=bias), SamplingConfig(temperature=0.8, logit_bias=bias)):
        baseline = decoder.generate(prompt, max_new_tokens=30, sampling=sampling, num_draft_tokens=0, seed=3).token_ids
        assert not set(baseline) & set(banned) and baseline != plain
        for mode in MODES:
            out = decoder.generate(prompt, max_new_tokens=30, sampling=sampling, seed=3, **mode).token_ids
            assert out == baseline, (sampling.temperature, mode)


def test_a_bias_outside_the_vocabulary_is_refused_naming_it():
    decoder = scripted_decoder(vocab=16, eos=15)
    with pytest.raises(GenerationError, match="logit_bias token ids must be in 0..15"):
        decoder.generate([1, 2], max_new_tokens=4, sampling=SamplingConfig(logit_bias={16: 1.0}))


def test_the_wire_forms_become_the_same_pairs():
    """OpenAI's {id: bias}, llama-server's [[id or text, bias or false]] and {text: bias}: ids kept, text split into
    its tokens, false as -inf; a text key without a tokenizer is a 400 naming the field."""
    pytest.importorskip("fastapi")
    from specdec.serving.wire import APIError, logit_bias_pairs

    encode = {"hello world": [5, 6], " x": [9]}.get
    assert logit_bias_pairs({"12": -100, "3": 2.5}) == ((12, -100), (3, 2.5))
    assert logit_bias_pairs([[12, False], ["hello world", -1.0]], encode) == ((12, float("-inf")), (5, -1.0), (6, -1.0))
    assert logit_bias_pairs({" x": False}, encode) == ((9, float("-inf")),)
    with pytest.raises(APIError, match="logit_bias: 'hello' is not a token id"):
        logit_bias_pairs({"hello": 1.0})
