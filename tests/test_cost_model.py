"""Cost model: the Leviathan et al. bound on fake costs, best draft length, the auto controller."""

import pytest

from specdec.runtime.cost_model import AutoDraftLength, Costs, best_gamma, expected_speedup, expected_tokens_per_round

# onnxruntime-genai's int4 curve on this machine (issue 7): T=2 1.13x, T=3 1.40x, T=5 1.91x, T=8 2.70x
GENAI = Costs(draft_step=0.37, verify=(1.0, 1.13, 1.40, 1.65, 1.91, 2.18, 2.44, 2.70, 2.95))
FLAT = Costs(draft_step=0.1, verify=(1.0,) * 9)  # memory-bound: T tokens cost like one


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_speedup_of_plain_decoding_is_one():
    assert expected_speedup(0.9, 0, GENAI) == 1.0


def test_issue_example_best_chain_is_about_1_2x_at_g1():
    gamma, speedup = best_gamma(0.8, GENAI)
    assert gamma == 1
    assert 1.1 < speedup < 1.3


def test_flat_verify_cost_favours_long_drafts():
    gamma, speedup = best_gamma(0.8, FLAT)
    assert gamma >= 4 and speedup > 2.0


def test_low_acceptance_falls_back_to_plain_decoding():
    assert best_gamma(0.2, GENAI) == (0, 1.0)


def test_cost_extrapolates_beyond_measured_range():
    assert GENAI.verify_cost(10) == pytest.approx(2.95 + 0.25)
    with pytest.raises(ValueError):
        Costs(draft_step=0.1, verify=())


def test_auto_controller_tracks_acceptance_and_probes():
    auto = AutoDraftLength(GENAI, prior_acceptance=0.9, probe_every=4)
    assert auto.choose() >= 1
    for _ in range(20):
        auto.observe(proposed=2, accepted=0)
    assert auto.acceptance < 0.1
    choices = [auto.choose() for _ in range(8)]
    assert choices.count(0) == 6 and choices.count(1) == 2  # target-only, with a probe every 4th round
    for _ in range(30):
        auto.observe(proposed=4, accepted=4)
    assert auto.acceptance > 0.9 and auto.choose() >= 1


def test_auto_mode_is_greedy_exact(tiny_decoder):
    prompt = "def add(a, b):\n    return"
    baseline = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
    result = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens="auto")
    assert result.token_ids == baseline.token_ids
    assert len(tiny_decoder.costs().verify) == 9


def test_draft_catch_up_charges_the_tokens_the_draft_has_not_read():
    auto = AutoDraftLength(GENAI)
    assert auto.draft_catch_up(0) == auto.draft_catch_up(1) == 0.0
    # 5 unread tokens: the first draft pass reads 6 instead of ~2 (relative cost 2.18 / 1.13 per the curve)
    assert auto.draft_catch_up(5) == pytest.approx(0.37 * (2.18 / 1.13 - 1.0))
    assert auto.tokens_per_second(2, extra_seconds=auto.draft_catch_up(5)) < auto.tokens_per_second(2)
