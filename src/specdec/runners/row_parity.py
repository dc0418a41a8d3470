"""Whether a runner's one-token pass gives the same logits, bit for bit, as a row of a wider pass.

Greedy speculation is token-identical to target-only decoding only if it does: the verify pass's rows must
equal the one-token passes target-only decoding runs. Export checks it on the export machine (parity scenario
``rows_vs_decode``); the CPU a bundle runs on can differ (onnxruntime's one-row MatMulNBits kernel rounds
unlike its multi-row one on a 2-core AMD EPYC with AVX2, not on an AVX-512 Xeon), so ``check_one_row`` asks
the loaded runner. ``Runner.pad_one_row`` is the cure: one-token passes then run as two rows.
"""

from __future__ import annotations

import numpy as np

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
