"""What the target's verify passes of each width cost while decoding, against the calibration "auto" plans with.

    python tools/measure/pass_widths.py BUNDLE PROMPTS.json [--ids prose-0,prose-1] [--modes suffix,target]
        [--max-new-tokens 128] [--repeats 2] [--fresh 3] [--threads N]

Decodes each prompt in each mode (modes alternate, every run cold), records every pass the cost model
observes (``decoder.pass_observers``: passes with every row's logits, so no prefill chunk) and prints,
per width, the median pass time and its ratio to the one-token pass, beside the decoder's calibrated ratio
and ``--fresh`` calibrations measured now. Also each run's tokens/s and each mode's total. A calibration
stored in a slower or faster phase of a shared machine shows here as a different shape.

The in-place medians pool passes at every context the runs reach (the one-token row mixes target-only runs
and the rounds that proposed nothing); calibrations time each width at one context (256). A width that ran
only a few times (the count column) says little.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("prompts", help="JSON list of {id, kind, prompt}")
    parser.add_argument("--ids", default="", help="comma list of prompt ids (default: every prompt)")
    parser.add_argument("--modes", default="suffix,target", help="comma list of target, default, suffix, lookup, draft")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fresh", type=int, default=0, help="calibrations to measure now, after the runs")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    from specdec.bench.bench import start_cold
    from specdec.bench.session import SPECDEC_MODES  # the bench's mode names and their generate() options
    from specdec.decoding.cost_model import calibrate
    from specdec.decoding.decoder import CALIBRATED_WIDTH, SpeculativeDecoder
    from specdec.sampling.processors import SamplingConfig

    with open(args.prompts) as handle:
        prompts = json.load(handle)
    if args.ids:
        wanted = args.ids.split(",")
        prompts = [p for p in prompts if p["id"] in wanted]
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in SPECDEC_MODES]
    if unknown or not prompts:
        print(f"unknown mode {unknown[0]!r}" if unknown else "no prompt matches --ids", file=sys.stderr)
        return 2

    times = collections.defaultdict(list)  # width -> seconds of each target pass with every row's logits

    def recording(role, tokens, seconds):
        if role == "target":
            times[tokens].append(seconds)

    decoder = SpeculativeDecoder.load(args.bundle, threads=args.threads)
    decoder.pass_observers.append(recording)
    stored = decoder.costs()
    greedy = SamplingConfig(temperature=0.0)
    totals = collections.defaultdict(float)
    for repeat in range(args.repeats):
        for prompt in prompts:
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                start_cold(decoder)
                result = decoder.generate(prompt["prompt"], max_new_tokens=args.max_new_tokens, sampling=greedy,
                                          **SPECDEC_MODES[mode])
                totals[mode] += result.stats.tokens_per_s
                print(f"{prompt['id']} {mode}: {result.stats.tokens_per_s:.2f} tok/s", flush=True)
    print("sum of tok/s: " + ", ".join(f"{mode} {totals[mode]:.2f}" for mode in modes))
    fresh = [calibrate(decoder.target, decoder.draft, max_tokens=CALIBRATED_WIDTH) for _ in range(args.fresh)]
    one = statistics.median(times[1]) if times.get(1) else None
    print("| width | passes | median ms | vs one-token pass | calibrated (used) |" + " fresh |" * len(fresh))
    print("|---|---|---|---|---|" + "---|" * len(fresh))
    for width in sorted(times):
        median = statistics.median(times[width])
        ratio = f"{median / one:.2f}x" if one else "-"
        cells = [f"{c.verify_cost(width) / c.verify[0]:.2f}x" for c in (stored, *fresh)]
        print(f"| {width} | {len(times[width])} | {median * 1000:.1f} | {ratio} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
