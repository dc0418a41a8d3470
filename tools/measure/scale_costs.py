"""What a (large) bundle costs on this machine: load, memory, exactness, pass costs, prefill.

    python tools/measure/scale_costs.py BUNDLE [--context 256] [--widths 1,2,3,4,5,6,7,8,9] [--repeats 7]
        [--prefill 512] [--threads N] [--json OUT]

Loads BUNDLE (``--max-context`` = context + 1,024), then: greedy decoding of two prompts in target-only, draft
chain (g=3) and the default mode, token for token (random-weight targets: the draft's proposals are mostly
rejected, which still exercises every verify path); the target's pass over T tokens for each ``--widths`` T and
the draft's step after ``--context`` cached tokens (random cache rows; widths interleaved, ``--repeats`` rounds;
median); a cold prefill of ``--prefill`` prompt tokens (tokens/s); the process's resident memory after load and
its peak (VmHWM). Prints one JSON object (also to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdec import SpeculativeDecoder
from specdec.runners.runner import fill_random

PROMPTS = ("def quicksort(items):\n", "The three laws of thermodynamics are")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pass_costs(runner, context: int, widths: list, repeats: int) -> list:
    fill_random(runner, context)
    times = {width: [] for width in widths}
    for round_ in range(repeats + 1):
        for width in widths:
            started = time.perf_counter()
            runner.forward([42] * width, range(context, context + width))
            if round_:  # the first round warms up
                times[width].append(time.perf_counter() - started)
    runner.reset()
    return [statistics.median(times[width]) for width in widths]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    started = time.perf_counter()
    decoder = SpeculativeDecoder.load(args.bundle, max_context=max(args.context, args.prefill) + 1024,
                                      threads=args.threads, verify=False)
    report = {"bundle": args.bundle.name, "load_seconds": round(time.perf_counter() - started, 1),
              "rss_after_load_mib": round(_rss_mib())}
    same = []
    for prompt in PROMPTS:
        runs = {name: decoder.generate(prompt, max_new_tokens=args.max_new_tokens, **mode).token_ids
                for name, mode in (("target", dict(num_draft_tokens=0)),
                                   ("draft_g3", dict(num_draft_tokens=3, proposer="draft")), ("default", {}))}
        same.append(runs["draft_g3"] == runs["target"] == runs["default"])
    report["greedy_equals_target_only"] = same
    target = _pass_costs(decoder.target, args.context, widths, args.repeats)
    report["target_pass_ms"] = {str(w): round(t * 1e3, 2) for w, t in zip(widths, target)}
    report["target_pass_ratio"] = {str(w): round(t / target[0], 3) for w, t in zip(widths, target)}
    if decoder.draft is not None:
        draft = _pass_costs(decoder.draft, args.context, [1], args.repeats)[0]
        report["draft_step_ms"] = round(draft * 1e3, 2)
        report["draft_step_ratio"] = round(draft / target[0], 3)
    ids = np.random.default_rng(0).integers(100, 20000, args.prefill).tolist()
    stats = decoder.generate(ids, max_new_tokens=1, num_draft_tokens=0).stats
    report["prefill_tokens_per_s"] = round(args.prefill / stats.prefill_seconds, 1)
    report["rss_mib"] = round(_rss_mib())
    report["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
