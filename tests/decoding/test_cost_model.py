"""Cost model: the Leviathan et al. bound on fake costs, best draft length, the auto controller."""

import numpy as np
import pytest

from specdec.decoding.cost_model import (AutoDraftLength, Costs, ProbeBudget, best_gamma, expected_speedup,
                                         expected_tokens_per_round)

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


def test_probes_back_off_while_they_find_speculation_losing_and_reset_when_it_wins():
    """With backoff the waits between probes double (16, 32, 64, then 64 again at the cap); a round that speculates
    on its merits brings the next wait back to 16. Without it (the lookup controllers) a probe every 16 rounds."""
    def probe_rounds(auto, rounds):
        return [index for index in range(rounds) if auto.choose() and auto.probing]

    backoff = AutoDraftLength(GENAI, prior_acceptance=0.05, probe_every=16, max_probe_every=64)
    assert probe_rounds(backoff, 240) == [15, 47, 111, 175, 239]
    for _ in range(30):
        backoff.observe(proposed=4, accepted=4)
    assert backoff.choose() >= 1 and not backoff.probing  # speculation wins again on its merits
    for _ in range(40):
        backoff.observe(proposed=2, accepted=0)
    assert probe_rounds(backoff, 16) == [15]  # the wait starts again at 16
    steady = AutoDraftLength(GENAI, prior_acceptance=0.05, probe_every=16)
    assert probe_rounds(steady, 64) == [15, 31, 47, 63]


def test_the_draft_controller_backs_off_its_probes():
    """The plan's draft controller probes with backoff (its probe makes the draft read what it missed); lookup's
    controllers, whose probes cost only a wider verify pass, do not."""
    from specdec.decoding.proposers import ProposerResources, make_proposer
    from specdec.decoding.proposers.draft import DRAFT_MAX_PROBE_EVERY
    from specdec.decoding.options import GenerationOptions
    from specdec.decoding.request import Request
    from specdec.sampling.processors import SamplingConfig

    greedy = SamplingConfig(temperature=0.0)
    resources = ProposerResources(64, draft=object(), costs=lambda: GENAI)
    options = GenerationOptions(max_new_tokens=8, sampling=greedy)
    draft = make_proposer(Request((1, 2, 3), options, "draft"), resources)
    assert draft.auto.max_probe_every == DRAFT_MAX_PROBE_EVERY > draft.auto.probe_every
    lookup = make_proposer(Request((1, 2, 3), options, "lookup"), resources)
    assert lookup.autos and all(auto.max_probe_every == auto.probe_every for auto in lookup.autos.values())


def test_the_probe_budget_earns_a_share_and_spends_only_what_it_holds():
    budget = ProbeBudget(0.05)
    budget.earn(10.0)
    assert budget.credit == pytest.approx(0.5)
    assert not budget.spend(0.6) and budget.credit == pytest.approx(0.5)  # refused: nothing taken
    assert budget.spend(0.4) and budget.credit == pytest.approx(0.1)
    budget.reset()
    assert budget.credit == 0.0
    budget.earn(3600.0)  # an hour of decoding banks no more than the share of the window
    assert budget.credit == pytest.approx(0.05 * budget.window)
    unlimited = ProbeBudget(None)
    assert unlimited.spend(1e9)
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="probe share"):
            ProbeBudget(share)


def test_a_due_probe_waits_for_the_budget_and_probes_stay_within_their_share():
    """The round wait says a probe is due; with a budget it runs only once the budget holds its estimated cost,
    so the probes' estimated seconds stay within the share of the target seconds observed, and a draft that
    lags further (a dearer catch-up) probes later. Without a budget the due probe runs at once."""
    def run(budget, lag, rounds=400):
        auto = AutoDraftLength(GENAI, prior_acceptance=0.05, probe_every=16, max_probe_every=64, budget=budget)
        probes, spent, earned = [], 0.0, 0.0
        for index in range(rounds):
            cost = auto.probe_cost(lag)
            if auto.choose(lag) and auto.probing:
                probes.append(index)
                spent += cost
            auto.observe_pass("target", 1, GENAI.verify[0])
            earned += GENAI.verify[0]
        return probes, spent, earned

    free, _, _ = run(None, 40)
    assert free[:3] == [15, 47, 111]
    near, spent, earned = run(ProbeBudget(0.03, window=1e4), 8)  # GENAI's costs are in units of one pass
    far, far_spent, _ = run(ProbeBudget(0.03, window=1e4), 40)
    assert run(ProbeBudget(0.03, window=100.0), 40)[0] == []  # a probe dearer than the capped credit never runs
    assert near and far and near[0] > free[0] and far[0] > near[0]
    assert spent <= 0.03 * earned and far_spent <= 0.03 * earned
    assert len(far) < len(near) <= len(free)


def test_the_decoder_owns_one_probe_budget_its_forks_and_plans_share(tiny_decoder, monkeypatch):
    from specdec.bench.bench import start_cold
    from specdec.decoding.cost_model import DRAFT_PROBE_SHARE
    from specdec.decoding.proposers.draft import DraftChain

    budget = tiny_decoder.probe_budget
    assert budget.share == DRAFT_PROBE_SHARE
    assert tiny_decoder.fork().probe_budget is budget
    seen = []
    original = DraftChain.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.auto.budget if self.auto is not None else None)

    monkeypatch.setattr(DraftChain, "__init__", spy)
    budget.reset()  # the fixture is shared: credit from earlier tests must not pass the check below
    tiny_decoder.generate("def add(a, b):\n    return", max_new_tokens=8, num_draft_tokens="auto", proposer="draft")
    monkeypatch.undo()
    assert seen == [budget]
    assert budget.credit > 0.0  # the request's target passes earned credit
    start_cold(tiny_decoder)
    assert budget.credit == 0.0  # a bench run starts without earlier runs' credit


def test_auto_mode_is_greedy_exact(tiny_decoder):
    prompt = "def add(a, b):\n    return"
    baseline = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
    result = tiny_decoder.generate(prompt, max_new_tokens=40, num_draft_tokens="auto")
    assert result.token_ids == baseline.token_ids
    assert len(tiny_decoder.costs().verify) == 33  # widths up to a full suffix tree plus the pending token


def test_draft_catch_up_charges_the_tokens_the_draft_has_not_read():
    auto = AutoDraftLength(GENAI)
    assert auto.draft_catch_up(0) == auto.draft_catch_up(1) == 0.0
    # 5 unread tokens: the first draft pass reads 6 instead of ~2 (relative cost 2.18 / 1.13 per the curve)
    assert auto.draft_catch_up(5) == pytest.approx(0.37 * (2.18 / 1.13 - 1.0))
    assert auto.tokens_per_second(2, extra_seconds=auto.draft_catch_up(5)) < auto.tokens_per_second(2)


# ---------------------------------------------------------------- per-token acceptance, costs at long context

def test_per_token_acceptance_is_the_geometric_mle_not_accepted_over_proposed():
    """g=2 rounds with a = 0.8: accepted/proposed is biased low, accepted/(accepted + rejections) recovers a."""
    import numpy as np

    from specdec.decoding.cost_model import per_token_acceptance

    rng = np.random.default_rng(0)
    a, gamma, rounds = 0.8, 2, 20000
    accepted = rejections = 0
    for _ in range(rounds):
        run = 0
        while run < gamma and rng.random() < a:
            run += 1
        accepted += run
        rejections += run < gamma
    assert per_token_acceptance(accepted, rejections) == pytest.approx(a, abs=0.01)
    assert accepted / (gamma * rounds) < a - 0.05  # the old estimator: (a + a^2) / 2 = 0.72
    with pytest.raises(ValueError):
        per_token_acceptance(-1, 0)


def _context_costs(tokens: int, context: int) -> float:
    """A fake machine: every pass grows alike with the cached context (attention reads it all)."""
    return (1.0 + 0.3 * (tokens - 1)) * (1.0 + context / 800)


def _draft_cost(context: int) -> float:
    return 0.3 * (1.0 + context / 800)


def _auto_run(auto: AutoDraftLength, start: int, end: int) -> list:
    """Decode from ``start`` to ``end`` cached tokens with the fake costs; returns the g chosen each round
    (acceptance stays at the prior: only the costs move)."""
    context, choices = start, []
    while context < end:
        gamma = auto.choose()
        choices.append(gamma)
        for step in range(gamma):
            auto.observe_pass("draft", 1, _draft_cost(context + step))
        auto.observe_pass("target", gamma + 1, _context_costs(gamma + 1, context))
        context += gamma + 1 if gamma else 1  # every draft accepted (the estimate is not updated)
    return choices


def test_auto_keeps_its_choice_as_the_context_grows():
    """Costs that scale alike at every width: the best g never changes, so auto must not flip to
    target-only at long contexts (it did when only the widths it ran were refreshed and c(1) kept
    its context-256 value)."""
    calibrated = Costs(draft_step=_draft_cost(256), verify=tuple(_context_costs(t, 256) for t in range(1, 10)))
    auto = AutoDraftLength(calibrated, prior_acceptance=0.75)
    first = auto.choose()
    assert first >= 1
    choices = _auto_run(auto, 256, 1900)
    assert set(choices) == {first}, f"auto changed its choice: {sorted(set(choices))}"
    long = Costs(draft_step=_draft_cost(1900), verify=tuple(_context_costs(t, 1900) for t in range(1, 10)))
    assert auto.costs.relative_curve() == pytest.approx(long.relative_curve())
    assert auto.costs.verify[0] == pytest.approx(long.verify[0], rel=0.05)  # c(1) followed, never run


def test_observed_passes_scale_every_width_of_that_model():
    """A target pass at 2x its calibrated cost moves c(1)..c(9) by the same factor; the draft's step apart."""
    auto = AutoDraftLength(GENAI, cost_decay=0.0)  # no memory: the latest pass sets the scale
    auto.observe_pass("target", 3, 2.0 * GENAI.verify[2])
    assert auto.costs.verify == pytest.approx(tuple(2.0 * c for c in GENAI.verify))
    assert auto.costs.draft_step == pytest.approx(GENAI.draft_step)
    auto.observe_pass("draft", 1, 3.0 * GENAI.draft_step)
    assert auto.costs.draft_step == pytest.approx(3.0 * GENAI.draft_step)
    auto.observe_pass("target", 40, 99.0)  # a prefill chunk wider than the curve: no information on its shape
    assert auto.costs.verify[0] == pytest.approx(2.0)


def test_calibration_interleaves_widths_and_keeps_wider_passes_at_least_as_costly():
    """Widths take turns (a burst of load lands on all of them, not on the one being timed), and a wider
    pass measured cheaper than a narrower one (noise: it does all of the narrower one's work) is raised to it."""
    from specdec.decoding.cost_model import monotone, time_passes

    class Recorder:
        length = 7

        def __init__(self):
            self.widths = []

        def forward(self, ids, positions):
            assert list(positions) == list(range(7, 7 + len(ids)))  # always after the committed slots
            self.widths.append(len(ids))

    runner = Recorder()
    assert len(time_passes(runner, [1, 2, 3], repeats=3)) == 3
    assert runner.widths == [1, 2, 3] * 3
    runner.widths = []
    assert len(time_passes(runner, [1, 2, 64], repeats=3, rounds={64: 1})) == 3  # the wide pass in round one only
    assert runner.widths == [1, 2, 64, 1, 2, 1, 2]
    assert monotone([1.0, 1.2, 1.1, 1.5, 1.4]) == (1.0, 1.2, 1.2, 1.5, 1.5)
    assert monotone([1.0, 1.1, 1.3]) == (1.0, 1.1, 1.3)


class _ClockRunner:
    """A fake runner on a fake clock: a pass of T tokens after ``length`` cached ones advances the clock by
    ``base(T) + slope(T) * length`` (attention reads the whole cache); restore/kv_layout/random_kv like a host cache."""

    def __init__(self, clock, base, slope, max_context=8192):
        self.clock, self.base, self.slope = clock, base, slope
        self.max_context, self.max_step_tokens, self.length = max_context, 64, 0

    def forward(self, ids, positions, **_):
        self.clock[0] += self.base(len(ids)) + self.slope(len(ids)) * self.length

    def commit(self, count):
        self.length += count

    def reset(self):
        self.length = 0

    def kv_layout(self, count):
        return (1, 1, count, 1), np.float32

    def random_kv(self, count):
        return np.zeros((1, 1, count, 1), np.float32)

    def restore(self, snapshot, count):
        self.length = count


@pytest.mark.parametrize("planted", [False, True])
def test_calibration_measures_how_costs_grow_with_the_context(monkeypatch, planted):
    """Passes whose cost grows linearly with the cache: calibrate recovers each width's growth and the draft's, and
    ``at(context)`` prices a pass at 16k as the machine would. Planted: a calibration that times only at 256
    (what auto did before) must miss the growth and fail."""
    from specdec.decoding import cost_model

    clock = [0.0]
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    target = _ClockRunner(clock, lambda t: 0.03 + 0.005 * t, lambda t: 3e-6 + 4e-7 * t)
    draft = _ClockRunner(clock, lambda t: 0.01, lambda t: 1.5e-6)
    deep = cost_model.CALIBRATION_CONTEXT if planted else cost_model.DEEP_CONTEXT
    costs = cost_model.calibrate(target, draft, max_tokens=9, deep_context=deep)
    at = costs.at(16384)
    want = [0.03 + 0.005 * t + (3e-6 + 4e-7 * t) * 16384 for t in range(1, 10)]
    assert (at.verify == pytest.approx(want, rel=1e-6)) != planted
    assert (at.draft_step == pytest.approx(0.01 + 1.5e-6 * 16384, rel=1e-6)) != planted
    assert costs.at(100) is costs and target.length == draft.length == 0  # no extrapolation below; caches reset


def test_a_timed_context_is_random_rows_where_a_runner_takes_them_else_its_own_passes():
    """``fill_context`` (the weight forms' and the pass costs' measurements): a runner that takes a cache's rows gets
    random ones and runs no pass (a 256-token prefill per form made a first load 4 s longer); one that cannot
    (``kv_layout`` raises NotImplementedError, as a device cache does) is filled through its own passes."""
    from specdec.decoding.cost_model import fill_context

    class Passes(_ClockRunner):
        def __init__(self, takes_rows):
            super().__init__([0.0], lambda t: 0.0, lambda t: 0.0)
            self.takes_rows, self.passes = takes_rows, []

        def forward(self, ids, positions, **_):
            self.passes.append(len(ids))

        def kv_layout(self, count):
            if not self.takes_rows:
                raise NotImplementedError("a device cache")
            return super().kv_layout(count)

    rows, passes = Passes(True), Passes(False)
    fill_context(rows, 256)
    fill_context(passes, 256)
    assert rows.length == passes.length == 256
    assert rows.passes == [] and passes.passes == [64, 64, 64, 64]


def test_costs_at_a_context_and_their_validation():
    costs = Costs(draft_step=0.01, verify=(0.03, 0.04), context=256, verify_slope=(1e-6, 2e-6), draft_slope=5e-7)
    deeper = costs.at(1256)
    assert deeper.verify == pytest.approx((0.031, 0.042)) and deeper.draft_step == pytest.approx(0.0105)
    assert deeper.context == 1256 and Costs(0.01, (0.03,)).at(99999).verify == (0.03,)  # unmeasured: flat
    for bad in (dict(verify_slope=(1e-6,)), dict(verify_slope=(-1.0, 0.0)), dict(draft_slope=-1.0)):
        with pytest.raises(ValueError):
            Costs(draft_step=0.01, verify=(0.03, 0.04), **bad)


def test_the_stored_costs_keep_their_growth(tmp_path):
    from specdec.decoding.calibration_store import load_costs, save_costs

    costs = Costs(draft_step=0.01, verify=(0.03, 0.04), context=256, verify_slope=(1e-6, 2e-6), draft_slope=5e-7)
    save_costs("key", costs, tmp_path / "costs.json")
    assert load_costs("key", tmp_path / "costs.json") == costs
