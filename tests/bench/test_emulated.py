"""The stretched target (specdec.bench.emulated): another target's measured pass costs on the real pair."""

import pytest

from specdec.bench.emulated import PREFILL_WIDTH, CostStretch, StretchedRunner, cost_stretch

OWN = {"target_pass_ms": {"1": 50.0, "2": 60.0, "5": 80.0}, "prefill_tokens_per_s": 80.0, "draft_step_ms": 20.0}
OTHER = {"target_pass_ms": {"1": 200.0, "2": 210.0, "5": 400.0, "9": 700.0}, "prefill_tokens_per_s": 16.0,
         "draft_step_ms": 20.0}


def test_the_stretch_is_the_ratio_of_the_two_records_at_shared_widths_and_at_prefill():
    stretch = cost_stretch(OWN, OTHER)
    assert stretch.widths == (1, 2, 5, PREFILL_WIDTH)
    assert stretch.ratios == pytest.approx((4.0, 3.5, 5.0, 5.0))


def test_each_record_is_read_in_its_own_run_s_draft_steps():
    # the other run's machine was 1.25x faster (its draft step 16 ms): its target costs 1.25x more in this run
    faster = dict(OTHER, draft_step_ms=16.0)
    assert cost_stretch(OWN, faster).ratios == pytest.approx((5.0, 4.375, 6.25, 6.25))


def test_widths_between_are_interpolated_and_outside_flat():
    stretch = CostStretch((1, 3, 64), (4.0, 2.0, 6.0))
    assert stretch.ratio(1) == 4.0
    assert stretch.ratio(2) == pytest.approx(3.0)
    assert stretch.ratio(3) == 2.0
    assert stretch.ratio(33.5) == pytest.approx(4.0)
    assert stretch.ratio(64) == stretch.ratio(500) == 6.0


@pytest.mark.parametrize("widths, ratios", [((), ()), ((2, 1), (1.5, 1.5)), ((1, 2), (1.5,)), ((1, 2), (0.9, 2.0))])
def test_a_malformed_stretch_is_refused(widths, ratios):
    with pytest.raises(ValueError):
        CostStretch(widths, ratios)


def test_a_record_without_costs_is_refused_by_name():
    with pytest.raises(ValueError, match="other"):
        cost_stretch(OWN, {"target_pass_ms": {"1": 3.0}})


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Runner:
    """A pass over T tokens takes 10 ms x T on the fake clock."""

    def __init__(self, clock):
        self.clock = clock
        self.length = 7

    def forward(self, tokens, positions, parents=None, visible_past=None, last_logits_only=False):
        self.clock.now += 0.01 * len(tokens)
        return list(tokens)


def test_a_pass_is_stretched_to_its_width_s_ratio_of_its_own_time():
    clock, slept = _Clock(), []
    runner = StretchedRunner(_Runner(clock), CostStretch((1, 5), (4.0, 2.0)), sleep=slept.append, clock=clock)
    assert runner.forward([1], [0]) == [1]
    assert runner.forward([1, 2, 3, 4, 5], range(5)) == [1, 2, 3, 4, 5]
    # own 10 ms stretched to 40 ms; own 50 ms stretched to 100 ms: the sleeps are the differences
    assert slept == pytest.approx([0.03, 0.05])
    assert runner.length == 7  # everything else is the wrapped runner's


@pytest.mark.integration
def test_a_stretched_target_changes_time_never_output(tiny_bundle):
    """wrap_target puts the stretched runner in the target's place: greedy output is unchanged (default mode and
    target-only), and the costs auto prices are measured again on the stretched passes."""
    from specdec.decoding.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(tiny_bundle, max_context=256, verify=False)
    decoder.wrap_target(lambda runner: runner)  # calibrated here, not on this machine's stored costs
    plain = decoder.costs()
    before = [decoder.generate("def f(x):", max_new_tokens=12, num_draft_tokens=n).token_ids for n in ("auto", 0)]
    decoder.wrap_target(lambda runner: StretchedRunner(runner, CostStretch((1, 64), (3.0, 3.0))))
    assert isinstance(decoder.target, StretchedRunner)
    after = [decoder.generate("def f(x):", max_new_tokens=12, num_draft_tokens=n).token_ids for n in ("auto", 0)]
    assert after == before
    assert decoder.costs().verify[0] > 2.0 * plain.verify[0]  # measured on passes that take 3x their time
