"""The decoder loop on scripted runners (no torch, no onnxruntime): exactness, seeds, stop strings, errors."""

import itertools

import numpy as np
import pytest

from specdec.decoding.request import GenerationError
from specdec.sampling.processors import DistributionError, SamplingConfig

from scripted import forked_map, scripted_decoder

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

    def draw(seed):
        return tuple(decoder.generate(STAT_PROMPT, max_new_tokens=3, sampling=STAT_CONFIG, seed=seed,
                                      acceptance=acceptance, **mode).token_ids)

    for out in forked_map(draw, range(runs)):  # the same `runs` seeded draws, on two cores when there are two
        counts[out] += 1
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


# ---------------------------------------------------------------- stop strings: text == an independent rendering
STOPS = [["k<"], ["<"], ["é"], ["€"], ["\n\n"], ["b", "xyz"], ["zzz"], ["zzz", "<", "k<"]]


def _rendered(codec, token_ids, stop) -> tuple:
    """(text, stopped) the stop rule gives for ``token_ids``, rendered independently of the decoder's text path
    (its IncrementalDecoder / StopStrings): decode every id at once, cut before the earliest stop string."""
    full = codec.decode(token_ids)
    found = [full.find(s) for s in stop if s in full]
    return (full[: min(found)], True) if found else (full, False)


@pytest.mark.parametrize("stop", STOPS, ids=str)
@pytest.mark.parametrize("mode", [dict(num_draft_tokens=0), dict(num_draft_tokens=3, proposer="draft"),
                                  dict(tree="2,2,1")], ids=str)
def test_stream_and_generate_text_is_the_stop_rule_applied_to_target_only_tokens(mode, stop):
    """stream's pieces and generate's text both equal target-only decoding's tokens (no stop strings), decoded in
    one go and cut before the first stop string; generation stops at the token completing it, and no prefix of the
    stream ever shows a stop string."""
    dec = scripted_decoder(seed=2)
    stopped_runs = 0
    for seed in range(6):
        args = dict(max_new_tokens=60, sampling=SamplingConfig(temperature=1.0), seed=seed, stop=stop, **mode)
        reference = dec.generate(PROMPT, max_new_tokens=60, sampling=SamplingConfig(temperature=1.0), seed=seed,
                                 num_draft_tokens=0)
        expected, stops_here = _rendered(dec.codec, reference.token_ids, stop)
        result = dec.generate(PROMPT, **args)
        stream = dec.stream(PROMPT, **args)
        assert not stream.finish_reason  # nothing ran yet
        pieces = list(stream)
        assert "".join(pieces) == expected, (seed, pieces)
        assert result.text == expected, seed
        # the emitted tokens render to the same text, and are the reference's up to the stop
        assert _rendered(dec.codec, result.token_ids, stop) == (expected, stops_here), seed
        assert stream.token_ids == result.token_ids == reference.token_ids[: len(result.token_ids)], seed
        if stops_here:
            stopped_runs += 1
            assert result.finish_reason == stream.finish_reason == "stop", seed
            # which stop string: the one starting earliest in the full text (the first listed on a tie)
            full = dec.codec.decode(reference.token_ids)
            matched = min((full.find(s), order, s) for order, s in enumerate(stop) if s in full)[2]
            assert result.stop_string == stream.stop_string == matched, seed
            # the last token completed the stop string: without it, no stop string is in the text
            assert not any(s in dec.codec.decode(result.token_ids[:-1]) for s in stop), seed
        else:
            assert result.token_ids == reference.token_ids and result.finish_reason == reference.finish_reason
            assert stream.finish_reason == reference.finish_reason, seed
            assert result.stop_string is stream.stop_string is None, seed
        for i in range(1, len(pieces) + 1):  # no piece ever shows a stop string's start that later completes
            assert not any(s in "".join(pieces[:i]) for s in stop)
    if set(stop) & {"k<", "<", "é", "b"}:  # these seeds reach these stop strings ("€", "\n\n", "zzz": never)
        assert stopped_runs, "no run reached the stop string: the case tests nothing"


def test_stop_string_spanning_tokens_never_leaks(decoder):
    """The tester's case: stop "k<" over two tokens ("k", then "<", in different rounds): stream must not show "k"
    before the stop completes. The streamed text equals the target-only tokens decoded at once and cut before "k<" (so no held-back
    "k" was shown and no text was lost). Most seeds reach "k<" as its own token; 86 and 106 reach it as "k" + "<"."""
    dec = scripted_decoder(seed=2)
    stopped = spanning = 0
    for seed in [*range(20), 86, 106]:
        sampling = SamplingConfig(temperature=1.0)
        reference = dec.generate(PROMPT, max_new_tokens=60, sampling=sampling, seed=seed, num_draft_tokens=0)
        expected, stops_here = _rendered(dec.codec, reference.token_ids, ["k<"])
        if stops_here:  # which token completed the stop string: "<" after a "k" token is the spanning case
            ids = reference.token_ids
            last = next(i for i in range(len(ids)) if "k<" in dec.codec.decode(ids[: i + 1]))
            stopped += 1
            spanning += dec.codec.decode(ids[last: last + 1]) == "<" and dec.codec.decode(ids[last - 1: last]) == "k"
        for mode in (dict(num_draft_tokens=0), dict()):  # one token per round (a piece between "k" and "<"); auto
            streamed = "".join(dec.stream(PROMPT, max_new_tokens=60, sampling=sampling, seed=seed, stop=["k<"], **mode))
            assert streamed == expected, (seed, mode)
    assert stopped >= 3 and spanning >= 1, (stopped, spanning)


def test_bare_string_is_one_stop_string(decoder):
    result = decoder.generate(PROMPT, max_new_tokens=40, sampling=SAMPLED[0], seed=1, stop="abc")
    assert "abc" not in result.text
    # "ab" as a bare string stops at "ab" only: its characters "a" and "b" (each its own token) still appear
    texts = [decoder.generate(PROMPT, max_new_tokens=40, sampling=SAMPLED[0], seed=s, stop="ab").text for s in range(8)]
    assert all("ab" not in t for t in texts)
    assert any("a" in t or "b" in t for t in texts), texts
    assert texts == [decoder.generate(PROMPT, max_new_tokens=40, sampling=SAMPLED[0], seed=s, stop=["ab"]).text
                     for s in range(8)]


# ---------------------------------------------------------------- API arguments: one ValueError naming each
BAD = [
    (dict(prompt=None), "prompt"), (dict(prompt=5), "prompt"), (dict(prompt=np.zeros((2, 2), dtype=np.int64)), "prompt"),
    (dict(prompt=[5.7]), "prompt"), (dict(prompt=["5"]), "prompt"), (dict(prompt=[]), "prompt"), (dict(prompt=""), "prompt"),
    (dict(prompt=[99]), "prompt"), (dict(tree=5), "tree"), (dict(tree="x"), "tree"), (dict(stop=[123]), "stop"),
    (dict(stop=[""]), "stop"), (dict(seed=-1), "seed"), (dict(seed="abc"), "seed"), (dict(seed=1.5), "seed"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens="3"), "max_new_tokens"),
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
    """After a request, each cache holds exactly the committed sequence (less the pending token); after a tree
    round whose path went through a later sibling, all but the rows it gave back (recomputed as chain rows by a
    next round: there was none), each a chain row."""
    from specdec.contract.limits import MAX_TREE_NODES

    for mode in MODES[1:]:
        stream = decoder.stream(PROMPT, max_new_tokens=30, seed=0, **mode)
        list(stream)
        sequence = PROMPT + stream.token_ids
        target = decoder.target
        if "tree" in mode:
            assert len(sequence) - 1 - MAX_TREE_NODES <= target.length <= len(sequence) - 1, mode
            assert target.held_prefix(sequence) == target.length, mode  # every kept row is offered again
        else:
            assert target.length == len(sequence) - 1, mode
        assert target.slot_tokens[: target.length].tolist() == sequence[: target.length], mode
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
