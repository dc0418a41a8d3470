"""Timing by a wrapper: a runner whose passes are timed into the request's stats and its proposal plan.

The rounds call ``forward`` / ``commit`` / ``truncate`` / ``keep_path`` on whatever runner they
are given; wrapping it here keeps every timing and pass count in one place.
"""

from __future__ import annotations

import time


class TimedRunner:
    def __init__(self, runner, role: str, on_pass):
        self.runner = runner
        self.role = role  # "target" | "draft"
        self.on_pass = on_pass  # (role, tokens, seconds, all_logits) -> None

    def forward(self, tokens, positions, parents=None, visible_past=None, last_logits_only: bool = False):
        begin = time.perf_counter()
        logits = self.runner.forward(tokens, positions, parents=parents, visible_past=visible_past,
                                     last_logits_only=last_logits_only)
        # a pass that skipped the other rows' lm_head is cheaper than the verify pass of its width
        self.on_pass(self.role, len(tokens), time.perf_counter() - begin, not last_logits_only)
        return logits

    @property
    def length(self) -> int:
        return self.runner.length

    @property
    def exact_width(self) -> int | None:
        return self.runner.exact_width

    def commit(self, count: int) -> None:
        self.runner.commit(count)

    def truncate(self, length: int) -> None:
        self.runner.truncate(length)

    def keep_path(self, sources, first_slot: int) -> None:
        self.runner.keep_path(sources, first_slot)

    def restore(self, snapshot, count: int) -> None:
        self.runner.restore(snapshot, count)

    def held_prefix(self, token_ids) -> int:
        return self.runner.held_prefix(token_ids)

    def first_inexact(self, start: int) -> int | None:
        return self.runner.first_inexact(start)

    def reset(self) -> None:
        self.runner.reset()
