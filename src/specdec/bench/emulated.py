"""A bigger target's pass costs on the real pair: each target pass is stretched (a sleep after it) to the time
another target's measured costs give a pass of its width, so the real pair's proposals, acceptance and outputs
meet, say, a 7B's verify curve and draft/target step ratio.

What it is for: targets whose real weights are not at hand. A random-weight checkpoint at the real shapes gives
true pass costs (``tools/measure/scale_costs.py``) but no acceptance; the real pair gives acceptance but a small target's
costs. Stretching the real target's passes by the ratio of the two measured cost tables lets the default's
choices (draft, suffix or nothing; chain lengths; the draft's prefill skip) be run, not projected, at the bigger
target's prices. The result is an emulation: the bigger model's own acceptance is not the real pair's.

The ratio comes from two ``scale_costs.py`` records of the same form, each in its own run's draft steps (the
same draft model beside both targets): passes of 1..9 tokens at the same depth, and a cold prefill's tokens/s
for wide (prefill-chunk) passes; widths between are interpolated linearly. A pass is stretched by its own
measured time times the ratio, so what grows with depth on the real target grows alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

PREFILL_WIDTH = 64  # the width a cold prefill's tokens/s stands for (the runtime's prefill chunk)


@dataclass(frozen=True)
class CostStretch:
    widths: tuple  # ascending pass widths with a measured ratio
    ratios: tuple  # the other target's pass time over the real target's at each width

    def __post_init__(self):
        if not self.widths or len(self.widths) != len(self.ratios) or list(self.widths) != sorted(set(self.widths)):
            raise ValueError("a cost stretch needs ascending, distinct widths, one ratio each")
        if any(r < 1.0 for r in self.ratios):
            raise ValueError(f"the emulated target must cost at least the real one at every width: {self.ratios}")

    def ratio(self, tokens: int) -> float:
        """The stretch of a pass over ``tokens`` tokens (linear between measured widths, flat outside them)."""
        return float(np.interp(tokens, self.widths, self.ratios))


def cost_stretch(own: dict, other: dict) -> CostStretch:
    """The stretch from two ``tools/measure/scale_costs.py`` records: ``own`` the real target's, ``other`` the emulated
    one's (``target_pass_ms`` per width, ``prefill_tokens_per_s``, ``draft_step_ms``). Both runs measure the same
    draft model, so each record's costs are taken in its own draft steps: what the other target costs beside that
    draft, whatever the machine's speed was during each run (a VM drifts between runs); ValueError naming what is
    missing."""
    for name, record in (("own", own), ("other", other)):
        if not all(record.get(field) for field in ("target_pass_ms", "prefill_tokens_per_s", "draft_step_ms")):
            raise ValueError(f"{name}: a scale_costs.py record with target_pass_ms, prefill_tokens_per_s and "
                             "draft_step_ms (a bundle with a draft)")
    shared = sorted(set(map(int, own["target_pass_ms"])) & set(map(int, other["target_pass_ms"])))
    if not shared:
        raise ValueError("own and other share no measured pass width")
    drift = own["draft_step_ms"] / other["draft_step_ms"]  # the other run's milliseconds in this run's
    widths = [w for w in shared if w < PREFILL_WIDTH]
    ratios = [drift * other["target_pass_ms"][str(w)] / own["target_pass_ms"][str(w)] for w in widths]
    widths.append(PREFILL_WIDTH)
    ratios.append(drift * own["prefill_tokens_per_s"] / other["prefill_tokens_per_s"])
    return CostStretch(tuple(widths), tuple(max(r, 1.0) for r in ratios))


class StretchedRunner:
    """A runner whose ``forward`` takes ``stretch.ratio(width)`` times its own time; everything else is the
    wrapped runner's."""

    def __init__(self, runner, stretch: CostStretch, sleep=time.sleep, clock=time.perf_counter):
        self.runner = runner
        self.stretch = stretch
        self._sleep = sleep
        self._clock = clock

    def forward(self, tokens, positions, parents=None, visible_past=None, last_logits_only: bool = False):
        started = self._clock()
        logits = self.runner.forward(tokens, positions, parents=parents, visible_past=visible_past,
                                     last_logits_only=last_logits_only)
        elapsed = self._clock() - started
        self._sleep(elapsed * (self.stretch.ratio(len(tokens)) - 1.0))
        return logits

    def __getattr__(self, name):
        return getattr(self.runner, name)
