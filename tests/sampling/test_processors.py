"""The processors reproduce Hugging Face transformers' LogitsProcessors (order and semantics)."""

import numpy as np
import pytest

from specdec.sampling.processors import SamplingConfig, greedy_token, sampling_distribution

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

CONFIGS = [
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.9, min_p=0.1),
    SamplingConfig(temperature=1.0, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    SamplingConfig(temperature=0.5, repetition_penalty=0.8),
]


def hf_distribution(logits, context, config):
    from transformers.generation import logits_process as lp

    processors = lp.LogitsProcessorList()
    if config.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    processors.append(lp.TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        processors.append(lp.TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(lp.MinPLogitsWarper(config.min_p))
    scores = processors(torch.tensor([context]), torch.tensor(logits)[None].clone())
    return torch.softmax(scores.double(), dim=-1)[0].numpy()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("vocab", [50, 5000])
def test_distribution_matches_transformers(config, vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(5):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        context = list(rng.integers(0, vocab, size=8))
        ours = sampling_distribution(logits, np.unique(np.array(context, dtype=np.int64)), config)
        theirs = hf_distribution(logits, context, config)
        assert np.array_equal(ours > 0, theirs > 0), f"kept sets differ, trial {trial}"
        assert np.abs(ours - theirs).max() < 1e-5


def test_greedy_uses_the_repetition_penalty_like_transformers():
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    config = SamplingConfig(temperature=0.0, repetition_penalty=1.5)
    assert greedy_token(logits, np.array([0]), config) == 1  # 2.0/1.5 < 1.9
    assert greedy_token(logits, np.array([2]), config) == 0


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0), dict(min_p=-0.1),
     dict(repetition_penalty=0.0), dict(top_k=1.5)],
)
def test_invalid_sampling_values_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)
