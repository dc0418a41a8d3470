"""When speculation pays: expected speedup from measured costs and a running acceptance estimate.

Leviathan et al. 2023 (Fast Inference from Transformers via Speculative Decoding), with a
per-token acceptance rate ``a`` and draft length ``g``:
  expected tokens per round  E(g) = (1 - a^(g+1)) / (1 - a)
  cost of a round            C(g) = g * c_draft + c_verify(g + 1)
  speedup vs target-only     S(g) = E(g) * c_verify(1) / C(g)        (S(0) = 1: plain decoding)
Costs come from timing this machine's own forward passes (``calibrate``), so the choice of g
reflects how the verify cost really grows with T here, and with the context: passes are timed at
256 cached tokens and again at 4,096 (random cache rows: a pass's time does not depend on their
values), and ``Costs.at(context)`` extends each width's cost linearly in the context (attention reads
the whole cache each pass). Pure functions, plus a small per-request controller for
``num_draft_tokens="auto"``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from specdec.runners.runner import fill_random

CALIBRATION_CONTEXT = 256  # cached tokens behind the timed passes of calibrate()
DEEP_CONTEXT = 4096  # and again behind these many: the costs' growth with the context


@dataclass(frozen=True)
class Costs:
    draft_step: float  # seconds for one draft pass over one token
    verify: tuple  # verify[T - 1]: seconds for one target pass over T tokens, T = 1..len(verify)
    context: int = CALIBRATION_CONTEXT  # the cached tokens these costs were timed at
    # seconds more per cached token beyond ``context``: verify_slope[T - 1] for the target's T-token pass (empty:
    # not measured, the costs are taken as flat), draft_slope for the draft's step
    verify_slope: tuple = ()
    draft_slope: float = 0.0

    def __post_init__(self):
        if self.draft_step < 0 or not self.verify or min(self.verify) <= 0:
            raise ValueError("costs must be positive, with at least the T=1 target cost")
        if self.verify_slope and (len(self.verify_slope) != len(self.verify) or min(self.verify_slope) < 0):
            raise ValueError("verify_slope needs one slope >= 0 per verify width")
        if self.draft_slope < 0:
            raise ValueError("draft_slope must be >= 0")

    def at(self, context: int) -> "Costs":
        """The costs of passes after ``context`` cached tokens (never below the measured ones)."""
        extra = context - self.context
        if extra <= 0 or not (self.verify_slope or self.draft_slope):
            return self
        verify = self.verify_slope or (0.0,) * len(self.verify)
        return Costs(self.draft_step + self.draft_slope * extra,
                     tuple(cost + slope * extra for cost, slope in zip(self.verify, verify)), context)

    def verify_cost(self, tokens: int) -> float:
        if tokens <= len(self.verify):
            return self.verify[tokens - 1]
        # beyond the measured range: extend linearly from the last two points
        last, prev = self.verify[-1], self.verify[-2] if len(self.verify) > 1 else self.verify[-1]
        return last + (tokens - len(self.verify)) * max(last - prev, 0.0)

    @property
    def max_gamma(self) -> int:
        return len(self.verify) - 1

    def relative_curve(self) -> list:
        """c_verify(T) / c_verify(1) for T = 1..len(verify)."""
        return [cost / self.verify[0] for cost in self.verify]


def expected_tokens_per_round(acceptance: float, gamma: int) -> float:
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


def per_token_acceptance(accepted: int, rejected_rounds: int) -> float:
    """The per-token acceptance ``a`` of a run: accepted / (accepted + rounds that had a rejection).

    The maximum-likelihood rate of the geometric model above (each draft token accepted with
    probability a until the first rejection, which ends the round). accepted / proposed is
    not it: a rejection stops the round, so the drafts after it are counted as proposed but
    were never tested, and that ratio is biased low for every g > 1.
    """
    if accepted < 0 or rejected_rounds < 0:
        raise ValueError("accepted and rejected_rounds must be >= 0")
    tested = accepted + rejected_rounds
    return accepted / tested if tested else 0.0


def expected_speedup(acceptance: float, gamma: int, costs: Costs) -> float:
    if gamma == 0:
        return 1.0
    round_cost = gamma * costs.draft_step + costs.verify_cost(gamma + 1)
    return expected_tokens_per_round(acceptance, gamma) * costs.verify_cost(1) / round_cost


def best_gamma(acceptance: float, costs: Costs, max_gamma: int | None = None) -> tuple[int, float]:
    """(g, predicted speedup) maximizing the speedup over g = 0..max_gamma; g = 0 means plain decoding."""
    limit = costs.max_gamma if max_gamma is None else max_gamma
    candidates = [(expected_speedup(acceptance, g, costs), -g) for g in range(0, limit + 1)]
    speedup, neg_gamma = max(candidates)
    return -neg_gamma, speedup


class ObservedCosts:
    """The calibrated costs, following the passes a request actually runs (``observe_pass``).

    Alternating two models and growing contexts cost more than isolated calibration runs, and the
    choice of a proposal should see that. Each model's calibrated costs are scaled as a whole by the
    ratio observed/calibrated on the passes that run: while speculating the T=1 target pass hardly
    ever runs, and refreshing only the widths that run would compare a long-context c(g+1) with a
    short-context c(1) (auto would flip to target-only, refresh c(1), flip back, ...). The calibrated
    shape c(T)/c(1) is kept.
    """

    def __init__(self, costs: Costs, decay: float = 0.8):
        self.costs = costs
        self.calibrated = costs  # the shape; self.costs = calibrated x the observed scale of each model
        self.target_scale = self.draft_scale = 1.0
        self.decay = decay

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        """Every width of that model moves by the ratio of this pass to its calibrated cost."""
        keep = self.decay
        calibrated = self.calibrated
        if role == "target" and 1 <= tokens <= len(calibrated.verify):
            ratio = seconds / calibrated.verify[tokens - 1]
            self.target_scale = keep * self.target_scale + (1 - keep) * ratio
        elif role == "draft" and 1 <= tokens <= 2 and calibrated.draft_step > 0:
            ratio = seconds / calibrated.draft_step
            self.draft_scale = keep * self.draft_scale + (1 - keep) * ratio
        else:
            return
        self.costs = Costs(calibrated.draft_step * self.draft_scale,
                           tuple(cost * self.target_scale for cost in calibrated.verify))


# auto: the share of the target's decode seconds the draft's probe rounds may spend (a decoder's ProbeBudget)
DRAFT_PROBE_SHARE = 0.03


class ProbeBudget:
    """What the draft model's probe rounds may spend: ``share`` of the target's decode seconds, earned as they
    are spent and carried across requests (one budget per decoder, shared by its forks: thread-safe).

    A probe round runs the draft where the estimates say it loses, to learn whether it has started to win; it
    costs the draft's catch-up over every token committed since it last ran, which after a long prompt read
    lazily or many suffix rounds is many one-token passes' worth. The budget holds those probes to a fixed
    share of decode time whatever the prompt length and the round count (``share`` None: no limit). The credit
    holds at most ``share`` of ``window`` seconds: a long stretch where the draft wins on its merits does not
    bank probes for the next losing one, and a probe dearer than that cap (a draft far behind) never runs."""

    def __init__(self, share: float | None = DRAFT_PROBE_SHARE, window: float = 60.0):
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"the probe share must be in [0, 1], got {share!r}")
        self.share = share
        self.window = window
        self.credit = 0.0  # seconds the next probes may spend
        self._lock = threading.Lock()

    def earn(self, seconds: float) -> None:
        if self.share is not None:
            with self._lock:
                self.credit = min(self.credit + self.share * seconds, self.share * self.window)

    def spend(self, seconds: float) -> bool:
        """Take ``seconds`` from the credit if it holds them; False (nothing taken): not now."""
        if self.share is None:
            return True
        with self._lock:
            if self.credit < seconds:
                return False
            self.credit -= seconds
            return True

    def reset(self) -> None:
        with self._lock:
            self.credit = 0.0


class AutoDraftLength:
    """Chooses g for each round from the costs and a running acceptance estimate.

    The estimate is the maximum-likelihood rate of the geometric acceptance model over
    exponentially decayed counts: accepted / (accepted + rejections). When the bound says
    speculation loses, rounds run target-only and every ``probe_every`` rounds one probe
    round at g=1 refreshes the estimate (acceptance changes along a text: code vs prose).
    ``max_probe_every`` > ``probe_every``: each probe that leaves speculation losing doubles the wait for the
    next, up to that many rounds, and a round that speculates on its merits resets it (a draft model's probe
    is not free: the draft first reads every token committed since it last ran). With a ``budget``
    (``ProbeBudget``) a due probe also waits until the budget holds its estimated cost (``probe_cost``); the
    budget earns from the target passes this controller sees.
    The costs follow the passes the request actually runs (``ObservedCosts``).
    """

    def __init__(self, costs: Costs, max_gamma: int = 8, prior_acceptance: float = 0.7, prior_weight: float = 2.0,
                 decay: float = 0.9, probe_every: int = 16, min_gain: float = 1.02, cost_decay: float = 0.8,
                 max_probe_every: int | None = None, budget: ProbeBudget | None = None):
        self.observed = ObservedCosts(costs, cost_decay)
        self.max_gamma = min(max_gamma, costs.max_gamma)
        self.accepted = prior_acceptance * prior_weight
        self.rejected = (1.0 - prior_acceptance) * prior_weight
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every or probe_every)
        self.probe_wait = probe_every  # rounds without speculation before the next probe
        self.min_gain = min_gain  # speculation must promise at least this ratio to be tried
        self.rounds_without_draft = 0
        self.probing = False  # the latest choose() is a probe round: g=1 to refresh the estimate
        self.budget = budget

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, lag: int = 0) -> int:
        """This round's g (0: no draft); ``probing`` says whether it is a probe round. ``lag``: committed tokens
        the draft has not read (what a probe round would make it catch up on)."""
        gamma, speedup = best_gamma(self.acceptance, self.costs, self.max_gamma)
        self.probing = False
        if gamma > 0 and speedup >= self.min_gain:
            self.rounds_without_draft = 0
            self.probe_wait = self.probe_every
            return gamma
        self.rounds_without_draft += 1
        if self.rounds_without_draft >= self.probe_wait and (
                self.budget is None or self.budget.spend(self.probe_cost(lag))):
            self.rounds_without_draft = 0
            self.probe_wait = min(2 * self.probe_wait, self.max_probe_every)
            self.probing = True
            return 1
        return 0

    def tokens_per_second(self, gamma: int, extra_seconds: float = 0.0) -> float:
        """Expected emitted tokens per second of a round with ``gamma`` proposals, at the current estimates."""
        cost = gamma * self.costs.draft_step + self.costs.verify_cost(gamma + 1) + extra_seconds
        return expected_tokens_per_round(self.acceptance, gamma) / cost

    def probe_cost(self, lag: int) -> float:
        """Estimated seconds a probe round adds to a target-only round: the draft's pass over ``lag`` tokens and
        its proposal, and the target's second row."""
        costs = self.costs
        return (self.draft_catch_up(lag) + costs.draft_step + costs.verify_cost(2) - costs.verify_cost(1))

    def draft_catch_up(self, lag: int) -> float:
        """Extra seconds of the draft's first pass when it must first read ``lag`` tokens it has not seen
        (those committed by lookup rounds), beyond the 1-2 tokens of a round after a draft round. The
        target's relative cost curve stands in for the draft's."""
        if lag <= 1:
            return 0.0
        relative = self.costs.verify_cost(lag + 1) / self.costs.verify_cost(2)
        return self.costs.draft_step * max(relative - 1.0, 0.0)

    @property
    def costs(self) -> Costs:
        return self.observed.costs

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        self.observed.observe_pass(role, tokens, seconds)
        if role == "target" and self.budget is not None:
            self.budget.earn(seconds)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < proposed else 0.0)


def fill_context(runner, context: int) -> None:
    """Reset the runner and give it ``context`` committed slots (token 0): random keys/values where the runner can
    take a cache's rows (``fill_random``: what a timed pass reads costs the same whatever the values, and a prefill
    of 256 tokens took a first load 1-2 s per weight form), else through its own passes."""
    if _can_fill_fast(runner, context):
        fill_random(runner, context)
        return
    runner.reset()
    while runner.length < context:
        count = min(runner.max_step_tokens, context - runner.length)
        runner.forward([0] * count, range(runner.length, runner.length + count))
        runner.commit(count)


class CalibrationStopped(RuntimeError):
    """``calibrate``'s ``stop`` said to stop (a request arrived while an idle server measured again)."""


def time_passes(runner, widths, repeats: int, stop=None, rounds: dict | None = None) -> list:
    """Median seconds of a pass of each of ``widths`` new tokens after the runner's committed slots (nothing
    is committed: every pass overwrites the same rows). The widths take turns, ``repeats`` rounds, so a burst
    of load on a shared machine lands on every width alike instead of on the one being timed. ``rounds``
    (``{width: n}``) times a width in its first n rounds only (a wide pass costs many narrow ones). ``stop``: a
    function asked before each pass; when it returns true, CalibrationStopped is raised."""
    start = runner.length
    times = [[] for _ in widths]
    for round_index in range(repeats):
        for index, tokens in enumerate(widths):
            if rounds is not None and round_index >= rounds.get(tokens, repeats):
                continue
            if stop is not None and stop():
                raise CalibrationStopped("stopped")
            begin = time.perf_counter()
            runner.forward([0] * tokens, range(start, start + tokens))
            times[index].append(time.perf_counter() - begin)
    return [float(np.median(row)) for row in times]


def monotone(verify) -> tuple:
    """c(T) never below c(T - 1): a pass over T rows does all the work of one over T - 1 (and more), so a
    cheaper wider pass is measurement noise, which would otherwise lure the planner to that width."""
    return tuple(float(cost) for cost in np.maximum.accumulate(np.asarray(verify, dtype=float)))


def calibrate(target, draft, max_tokens: int = 9, context: int = CALIBRATION_CONTEXT, repeats: int = 5,
              deep_context: int = DEEP_CONTEXT, stop=None) -> Costs:
    """Measure this machine's costs on the loaded runners (draft may be None), at ``context`` cached tokens, and
    their growth up to ``deep_context`` (when the caches hold it and the runners can take a cache's rows).

    Widths 1..9 are timed each; wider ones (suffix trees verify up to ``max_tokens``) at 17 and 33, the
    rest interpolated linearly between them. ``stop``: asked before each timed pass (``time_passes``)."""
    context = min(context, target.max_context - max_tokens - 1)
    widths = calibration_widths(max_tokens)
    runners = [runner for runner in (target, draft) if runner is not None]
    deep = deep_context if all(_can_fill_fast(r, deep_context + max_tokens + 1) for r in runners) else None
    deep = deep if deep is not None and deep > context else None

    def timed_at(runner, fill, wanted) -> list:
        fill(runner)
        time_passes(runner, wanted, 1, stop)  # warm-up (first runs allocate)
        return time_passes(runner, wanted, repeats, stop)

    try:
        shallow = lambda runner: fill_context(runner, context)  # noqa: E731
        verify = monotone(np.interp(np.arange(1, max_tokens + 1), widths, timed_at(target, shallow, widths)))
        draft_step = timed_at(draft, shallow, [1])[0] if draft is not None else 0.0
        if deep is None:
            return Costs(draft_step=draft_step, verify=verify, context=context)
        filled = lambda runner: fill_random(runner, deep)  # noqa: E731
        deeper = monotone(np.interp(np.arange(1, max_tokens + 1), widths, timed_at(target, filled, widths)))
        slope = tuple(max(0.0, (far - near) / (deep - context)) for near, far in zip(verify, deeper))
        draft_slope = 0.0
        if draft is not None:
            draft_slope = max(0.0, (timed_at(draft, filled, [1])[0] - draft_step) / (deep - context))
    finally:
        for runner in runners:
            runner.reset()
    return Costs(draft_step=draft_step, verify=verify, context=context, verify_slope=slope, draft_slope=draft_slope)


def _can_fill_fast(runner, slots: int) -> bool:
    if runner.max_context < slots:
        return False
    try:
        runner.kv_layout(1)
    except NotImplementedError:
        return False
    return True


def calibration_widths(max_tokens: int) -> list:
    """The pass widths ``calibrate`` times: every width up to 9, then 17, 33, ... (each about twice the last)
    up to ``max_tokens``."""
    widths = list(range(1, min(max_tokens, 9) + 1))
    while widths[-1] < max_tokens:
        widths.append(min(max_tokens, 2 * widths[-1] - 1))
    return widths
