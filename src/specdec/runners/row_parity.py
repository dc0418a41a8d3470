"""Whether a runner's one-token pass gives the same logits, bit for bit, as a row of a wider pass.

Greedy speculation is token-identical to target-only decoding only if it does: the verify pass's rows must
equal the one-token passes target-only decoding runs. Export checks it on the export machine (parity scenario
``rows_vs_decode``); the CPU a bundle runs on can differ (onnxruntime's one-row MatMulNBits kernel rounds
unlike its multi-row one on a 2-core AMD EPYC with AVX2, not on an AVX-512 Xeon), so ``check_one_row`` asks
the loaded runner. ``Runner.pad_one_row`` is the cure: one-token passes then run as two rows.
"""

from __future__ import annotations

import numpy as np

from specdec.runners.runner import fill_random

PREFIX = 8  # cached tokens behind the compared passes
WIDE = 5  # the verify pass compared against
TOKENS = (220, 284, 198)  # ids below any vocabulary size a bundle has (a space, " =", a newline in Qwen's)


def row_gaps(runner) -> dict | None:
    """Largest |logit| difference of a one-token pass (as this runner runs it: padded or not) and of a two-row
    pass from the first row of a ``WIDE``-row verify pass, and whether each pass's argmax agrees with it; None
    when the cache is too small to tell. Runs on the runner's cache and resets it (call before serving)."""
    if runner.max_context < PREFIX + WIDE + 1 or runner.max_step_tokens < WIDE:
        return None
    vocab = runner.spec.vocab_size
    ids = [TOKENS[i % len(TOKENS)] % vocab for i in range(PREFIX + WIDE)]
    try:
        runner.reset()
        runner.forward(ids[:PREFIX], range(PREFIX))
        runner.commit(PREFIX)
        one = np.array(runner.forward(ids[PREFIX : PREFIX + 1], [PREFIX]), dtype=np.float64)[0]
        two = np.array(runner.forward(ids[PREFIX : PREFIX + 2], [PREFIX, PREFIX + 1]), dtype=np.float64)[0]
        wide = np.array(runner.forward(ids[PREFIX:], range(PREFIX, PREFIX + WIDE)), dtype=np.float64)[0]
    finally:
        runner.reset()
    return {"one_row": float(np.abs(one - wide).max()), "two_rows": float(np.abs(two - wide).max()),
            "argmax_equal": bool(one.argmax() == wide.argmax() == two.argmax())}


def check_one_row(runner) -> bool | None:
    """True when a one-token pass and a two-row pass give the first row of a verify pass bit for bit (``row_gaps``
    both 0); None when the cache is too small to tell."""
    gaps = row_gaps(runner)
    return None if gaps is None else gaps["one_row"] == 0.0 and gaps["two_rows"] == 0.0


WIDTHS = (64, 32, 20, 16, 8)  # pass widths tried
DEEP = 1024  # a second check behind this many (random) cache rows: the kernels' split can move with the depth


def _rows_of_pass(runner, ids: list, start: int, width: int) -> tuple:
    """(first row's logits, the keys/values the pass wrote for its first two slots) of a ``width``-row pass after
    ``start`` cached slots; the cache is left at ``start``."""
    logits = np.array(runner.forward(ids[:width], range(start, start + width)), dtype=np.float64)[0]
    runner.commit(2)
    rows = runner.snapshot().rows[..., start : start + 2, :].copy()
    runner.truncate(start)
    return logits, rows


def exact_width(runner, widths=WIDTHS) -> int | None:
    """The widest pass (of ``widths``) whose rows equal a two-row pass's bit for bit, at a shallow and at a deep
    cache; None when this runner cannot tell (no snapshots, too small a cache). A wide pass's rows can round
    differently: onnxruntime's threaded SGEMM splits the attention's product by its row count (seen on a 2-core
    Xeon with AVX-512: a target pass of 32 or more tokens, 6 x 32 folded rows), and rows a prefill chunk wrote
    must equal the ones decoding wrote, or a warm cache would change the output. Resets the runner."""
    widths = [w for w in widths if w <= runner.max_step_tokens]
    if not widths or runner.max_context < PREFIX + max(widths) + 1:
        return None
    vocab = runner.spec.vocab_size
    ids = [TOKENS[i % len(TOKENS)] % vocab for i in range(PREFIX + max(widths))]
    starts = [PREFIX] + ([DEEP] if runner.max_context >= DEEP + max(widths) + 1 else [])
    try:
        runner.kv_layout(1)
    except NotImplementedError:
        return None
    best = max(widths)
    try:
        for start in starts:
            runner.reset()
            if start == PREFIX:
                runner.forward(ids[:PREFIX], range(PREFIX))
                runner.commit(PREFIX)
            else:
                fill_random(runner, start)
            reference = _rows_of_pass(runner, ids[PREFIX:], start, 2)
            for width in sorted(w for w in widths if w <= best):  # narrowest first: the first that rounds apart
                wide = _rows_of_pass(runner, ids[PREFIX:], start, width)
                if not (np.array_equal(reference[0], wide[0]) and np.array_equal(reference[1], wide[1])):
                    best = max((w for w in widths if w < width), default=None)
                    break
            if best is None:
                break
    finally:
        runner.reset()
    return best

