"""The decoder loop on scripted runners (no torch, no onnxruntime): exactness, seeds, stop strings, errors."""

import itertools

import numpy as np
import pytest

from specdec.decoding.request import GenerationError
from specdec.sampling.processors import DistributionError, SamplingConfig

from scripted import scripted_decoder

MODES = [
    dict(num_draft_tokens=0),
    dict(num_draft_tokens=1, proposer="draft"),
    dict(num_draft_tokens=3, proposer="draft"),
    dict(num_draft_tokens="auto", proposer="draft"),
    dict(num_draft_tokens="auto", proposer="lookup"),
    dict(num_draft_tokens=2, proposer="lookup"),
    dict(num_draft_tokens="auto", proposer="hybrid"),
    dict(num_draft_tokens=2, proposer="hybrid"),
    dict(tree="2,2,1"),
    dict(tree="auto"),
]
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
SAMPLED = [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3),
           SamplingConfig(temperature=1.2, min_p=0.05)]


@pytest.fixture(scope="module")
def decoder():
    return scripted_decoder()


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_greedy_every_mode_equals_target_only(decoder, mode):
    """Greedy: every proposer, length and tree emits exactly target-only's tokens."""
    for prompt in (PROMPT, [4], [7, 7, 7, 7, 7]):
        base = decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0, seed=None)
        spec = decoder.generate(prompt, max_new_tokens=40, seed=None, **mode)
        assert spec.token_ids == base.token_ids and spec.text == base.text


@pytest.mark.parametrize("config", SAMPLED, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_coupled_sampling_every_mode_equals_target_only_sampling(decoder, mode, config):
    """Seeded sampling: speculation returns exactly the tokens target-only sampling returns with that seed."""
    for seed in range(4):
        base = decoder.generate(PROMPT, max_new_tokens=30, sampling=config, num_draft_tokens=0, seed=seed)
        spec = decoder.generate(PROMPT, max_new_tokens=30, sampling=config, seed=seed, **mode)
        assert spec.token_ids == base.token_ids, seed


def test_coupled_sampling_draws_differ_across_seeds(decoder):
    outputs = {tuple(decoder.generate(PROMPT, max_new_tokens=20, sampling=SAMPLED[0], seed=seed).token_ids) for seed in range(8)}
    assert len(outputs) >= 6


def test_seeded_output_is_the_same_from_a_fresh_or_reused_decoder():
    """Same arguments and seed -> same tokens, whatever decoder (fresh or reused) and its measured costs."""
    from specdec.decoding.cost_model import Costs

    first = scripted_decoder()
    other = scripted_decoder(costs=Costs(draft_step=0.9, verify=tuple(1.0 + t for t in range(9))))
    for mode in MODES:
        runs = [dec.generate(PROMPT, max_new_tokens=25, sampling=SAMPLED[1], seed=11, **mode).token_ids for dec in (first, first, other)]
        assert runs[0] == runs[1] == runs[2], mode


def test_rejection_sampling_with_a_fixed_schedule_is_reproducible(decoder):
    for mode in (dict(num_draft_tokens=2, proposer="draft"), dict(tree="2,2,1")):
        runs = [decoder.generate(PROMPT, max_new_tokens=25, sampling=SAMPLED[0], seed=3, acceptance="rejection", **mode).token_ids
                for _ in range(2)]
        assert runs[0] == runs[1]


# ---------------------------------------------------------------- exact distributions (3 tokens, bonus reached)
VOCAB = 5
STAT_PROMPT = [1, 2]
STAT_CONFIG = SamplingConfig(temperature=1.0, top_k=4, repetition_penalty=1.5)
RUNS = 6000


def exact_joint(model, prompt, config, length=3):
    """{tokens: probability} of the first ``length`` tokens: the target's own sampling, processors included."""
    from specdec.sampling.processors import sampling_distribution

    joint = {}
    for tokens in itertools.product(range(model.vocab), repeat=length):
        prob, sequence = 1.0, list(prompt)
        for token in tokens:
            seen = np.array(sorted(set(sequence)), dtype=np.int64)
            prob *= sampling_distribution(model.logits(sequence), seen, config)[token]
            sequence.append(token)
        joint[tokens] = prob
    return joint


def chi_square_pvalue(decoder, mode, acceptance, runs=RUNS):
    from scipy.stats import chisquare

    joint = exact_joint(decoder.target.model, STAT_PROMPT, STAT_CONFIG)
    keys = sorted(joint)
    counts = dict.fromkeys(keys, 0)
    for seed in range(runs):
        out = decoder.generate(STAT_PROMPT, max_new_tokens=3, sampling=STAT_CONFIG, seed=seed, acceptance=acceptance, **mode).token_ids
        counts[tuple(out)] += 1
    expected = np.array([joint[k] for k in keys]) * runs
    observed = np.array([counts[k] for k in keys], dtype=float)
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def stat_decoder():
    return scripted_decoder(vocab=VOCAB, eos=VOCAB + 10, draft_noise=1.0, seed=5)


STAT_MODES = [dict(num_draft_tokens=2, proposer="draft"), dict(num_draft_tokens=3, proposer="draft"), dict(tree="2,1")]


@pytest.mark.parametrize("acceptance", ["coupled", "rejection"])
@pytest.mark.parametrize("mode", STAT_MODES, ids=str)
def test_first_three_tokens_follow_the_target_distribution(stat_decoder, mode, acceptance):
    """Speculative sampling's first 3 tokens (bonus rows reached) follow the target's exact joint distribution."""
    assert chi_square_pvalue(stat_decoder, mode, acceptance) > 1e-3


def _plant_context_without_candidates(monkeypatch):
    from specdec.decoding.request import RequestState

    monkeypatch.setattr(RequestState, "context", lambda self, candidates=(): np.fromiter(self.seen, dtype=np.int64))


def _plant_bonus_from_previous_row(monkeypatch):
    from specdec.decoding import rules

    original = rules.TokenRule.verify_chain

    def shifted(self, rows, contexts, proposals, draft_dists, first_position):
        if len(proposals):
            rows = np.concatenate([rows[:-1], rows[-2:-1]])
            contexts = contexts[:-1] + contexts[-2:-1]
        return original(self, rows, contexts, proposals, draft_dists, first_position)

    monkeypatch.setattr(rules.TokenRule, "verify_chain", shifted)


def _plant_noise_of_round_offset(monkeypatch):
    """Coupled noise keyed by the offset within a round instead of the absolute position."""
    from specdec.sampling import coupling

    original = coupling.PositionNoise.at
    monkeypatch.setattr(coupling.PositionNoise, "at", lambda self, position: original(self, position % 2))


@pytest.mark.parametrize("plant, acceptance", [
    (_plant_context_without_candidates, "rejection"),
    (_plant_context_without_candidates, "coupled"),
    (_plant_bonus_from_previous_row, "rejection"),
    (_plant_bonus_from_previous_row, "coupled"),
    (_plant_noise_of_round_offset, "coupled"),
], ids=["penalty-context-rejection", "penalty-context-coupled", "bonus-row-rejection", "bonus-row-coupled",
        "noise-by-offset"])
def test_planted_bugs_fail_the_distribution_test(stat_decoder, monkeypatch, plant, acceptance):
    """Negative controls: each classic bug makes the same check fail decisively."""
    plant(monkeypatch)
    assert chi_square_pvalue(stat_decoder, dict(num_draft_tokens=3, proposer="draft"), acceptance) < 1e-4


# ---------------------------------------------------------------- stop strings: stream == generate
STOPS = [["k<"], ["<"], ["é"], ["€"], ["\n\n"], ["b", "xyz"], ["zzz"]]


@pytest.mark.parametrize("stop", STOPS, ids=str)
@pytest.mark.parametrize("mode", [dict(num_draft_tokens=0), dict(num_draft_tokens=3, proposer="draft"),
                                  dict(tree="2,2,1")], ids=str)
def test_stream_equals_generate_for_every_stop_string(mode, stop):
    """stream and generate give the same text and tokens; the text ends before the first stop string."""
    dec = scripted_decoder(seed=2)
    for seed in range(6):
        args = dict(max_new_tokens=60, sampling=SamplingConfig(temperature=1.0), seed=seed, stop=stop, **mode)
        result = dec.generate(PROMPT, **args)
        stream = dec.stream(PROMPT, **args)
        pieces = list(stream)
        assert "".join(pieces) == result.text
        assert stream.token_ids == result.token_ids and stream.finish_reason == result.finish_reason
        full = dec.codec.decode(result.token_ids)
        if result.finish_reason == "stop":
            cut = min(full.find(s) for s in stop if s in full)
            assert result.text == full[:cut]
        else:
            assert not any(s in result.text for s in stop)
        for i in range(1, len(pieces) + 1):  # no piece ever shows a stop string's start that later completes
            assert not any(s in "".join(pieces[:i]) for s in stop)


def test_stop_string_spanning_tokens_never_leaks(decoder):
    """The tester's case: stop "k<" over two tokens: stream must not show "k" before the stop completes."""
    dec = scripted_decoder(seed=2)
    for seed in range(20):
        args = dict(max_new_tokens=60, sampling=SamplingConfig(temperature=1.0), seed=seed, stop=["k<"])
        assert "".join(dec.stream(PROMPT, **args)) == dec.generate(PROMPT, **args).text


def test_bare_string_is_one_stop_string(decoder):
    result = decoder.generate(PROMPT, max_new_tokens=40, sampling=SAMPLED[0], seed=1, stop="abc")
    assert "abc" not in result.text
    texts = [decoder.generate(PROMPT, max_new_tokens=40, sampling=SAMPLED[0], seed=s, stop="xy").text for s in range(5)]
    assert all("xy" not in t for t in texts) and any("x" in t or "y" in t or True for t in texts)


# ---------------------------------------------------------------- API arguments: one ValueError naming each
BAD = [
    (dict(prompt=None), "prompt"), (dict(prompt=5), "prompt"), (dict(prompt=np.zeros((2, 2), dtype=np.int64)), "prompt"),
    (dict(prompt=[5.7]), "prompt"), (dict(prompt=["5"]), "prompt"), (dict(prompt=[]), "prompt"), (dict(prompt=""), "prompt"),
    (dict(prompt=[99]), "prompt"), (dict(tree=5), "tree"), (dict(tree="x"), "tree"), (dict(stop=[123]), "stop"),
    (dict(stop=[""]), "stop"), (dict(seed=-1), "seed"), (dict(seed="abc"), "seed"), (dict(seed=1.5), "seed"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens="3"), "max_new_tokens"),
    (dict(num_draft_tokens=99), "num_draft_tokens"), (dict(num_draft_tokens="x"), "num_draft_tokens"),
    (dict(proposer="magic"), "proposer"), (dict(tree="2,2", num_draft_tokens=0), "tree"),
    (dict(sampling="greedy"), "sampling"), (dict(acceptance="maybe"), "acceptance"),
    (dict(stop_token_ids=[999]), "stop_token_ids"), (dict(stop_token_ids="3"), "stop_token_ids"),
    (dict(max_new_tokens=10_000), "max_context"),
]


@pytest.mark.parametrize("kwargs, name", BAD, ids=lambda v: str(v)[:40])
def test_bad_arguments_raise_one_line_value_errors_naming_them(decoder, kwargs, name):
    kwargs = {"prompt": PROMPT, **kwargs}
    for call in (decoder.generate, decoder.stream):  # stream validates at call time, before any next()
        with pytest.raises(ValueError) as info:
            call(**kwargs)
        assert isinstance(info.value, GenerationError)
        assert name in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(temperature="0.5"), dict(top_p=None), dict(repetition_penalty=[1]),
                                    dict(temperature=float("nan")), dict(top_k=2.0)])
def test_bad_sampling_values_are_value_errors(kwargs):
    with pytest.raises(ValueError, match=list(kwargs)[0]):
        SamplingConfig(**kwargs)


# ---------------------------------------------------------------- numerics
def test_tiny_temperature_is_greedy_not_nan(decoder):
    greedy = decoder.generate(PROMPT, max_new_tokens=20, num_draft_tokens=0).token_ids
    for temperature in (1e-38, 1e-300, 5e-324):
        tiny = SamplingConfig(temperature=temperature)
        assert decoder.generate(PROMPT, max_new_tokens=20, sampling=tiny, num_draft_tokens=0, seed=1).token_ids == greedy
        assert decoder.generate(PROMPT, max_new_tokens=20, sampling=tiny, num_draft_tokens=3, proposer="draft", seed=1,
                                acceptance="rejection").token_ids == greedy


def test_extreme_penalties_form_distributions():
    from specdec.sampling.processors import sampling_distribution

    logits = np.array([-3.0, 2.0, -1.0, 0.5], dtype=np.float32)
    for penalty in (1e-30, 1e30, 1e300):
        for temperature in (1e-30, 0.7):
            dist = sampling_distribution(logits, np.arange(4), SamplingConfig(temperature=temperature,
                                                                              repetition_penalty=penalty))
            assert np.isfinite(dist).all() and abs(dist.sum() - 1) < 1e-9


def test_nan_logits_are_an_error_not_the_last_token():
    from specdec.sampling.processors import greedy_token, sample, sampling_distribution

    logits = np.array([np.nan, 1.0, 2.0], dtype=np.float32)
    with pytest.raises(DistributionError):
        sampling_distribution(logits, np.zeros(0, dtype=np.int64), SamplingConfig(temperature=1.0))
    with pytest.raises(DistributionError):
        greedy_token(logits, np.zeros(0, dtype=np.int64), SamplingConfig())
    with pytest.raises(DistributionError):
        sample(np.zeros(3), np.random.default_rng(0))


# ---------------------------------------------------------------- runner bookkeeping
def test_rejected_rows_are_truncated_and_tree_paths_compacted(decoder):
    """After a request, each cache holds exactly the committed sequence (less the pending token)."""
    for mode in MODES[1:]:
        stream = decoder.stream(PROMPT, max_new_tokens=30, seed=0, **mode)
        list(stream)
        sequence = PROMPT + stream.token_ids
        target = decoder.target
        assert target.length == len(sequence) - 1, mode
        assert target.slot_tokens[: target.length].tolist() == sequence[:-1], mode
        assert target.slot_positions[: target.length].tolist() == list(range(target.length)), mode


def test_runner_refuses_impossible_bookkeeping(decoder):
    runner = decoder.target
    runner.reset()
    with pytest.raises(ValueError):
        runner.truncate(3)
    with pytest.raises(ValueError):
        runner.keep_path([2, 1], 0)


def test_closing_a_stream_frees_the_decoder(decoder):
    stream = decoder.stream(PROMPT, max_new_tokens=50, seed=0)
    next(stream)
    stream.close()
    assert decoder.generate(PROMPT, max_new_tokens=5).token_ids
