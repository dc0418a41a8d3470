"""A shuffled A/B of decoder settings (specdec.bench.arms): arms from a JSON file, prompts from a prompt set.

    python tools/measure/ab_arms.py BUNDLE ARMS.json PROMPTS.json --baseline target [--kinds prose,code] [--repeats 2]
        [--max-new-tokens 128] [--threads 2] [--seed 11] [--stretch OWN.json OTHER.json] --out DIR

ARMS.json: {"name": {"options": {generate() keyword arguments}, "settings": {"probe_budget.share": null,
"specdec.decoding.proposers.draft:DRAFT_MAX_PROBE_EVERY": 16}}, ...}. Writes DIR/rows.json (every run, with its
token ids) and DIR/summary.md (each arm against the baseline, per prompt kind). ``--stretch``: every target pass
stretched to another target's measured costs (two ``tools/measure/scale_costs.py`` records: this bundle's, the other
target's; specdec.bench.emulated), an emulation of the real pair's acceptance at a bigger target's prices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from specdec.bench.arms import arms_markdown, parse_arms, run_arms, summarize_arms
from specdec.bench.bench import load_prompts, provenance
from specdec.bench.emulated import StretchedRunner, cost_stretch
from specdec.decoding.decoder import SpeculativeDecoder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("arms")
    parser.add_argument("prompts")
    parser.add_argument("--baseline", required=True, help="the arm the others are compared with")
    parser.add_argument("--kinds", default="", help="only prompts of these kinds (comma-separated)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--stretch", nargs=2, metavar=("OWN", "OTHER"), default=None,
                        help="scale_costs.py records: stretch target passes from OWN's costs to OTHER's")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        spec = json.loads(Path(args.arms).read_text())
        arms = parse_arms(spec)
        if args.baseline not in {arm.name for arm in arms}:
            raise ValueError(f"--baseline: {args.baseline!r} is not one of the arms")
        prompts = load_prompts(args.prompts, None)
        kinds = set(filter(None, args.kinds.split(",")))
        prompts = [p for p in prompts if not kinds or p.get("kind") in kinds]
        if not prompts:
            raise ValueError("--kinds: no prompt of those kinds")
        stretch = None
        if args.stretch:
            own, other = (json.loads(Path(name).read_text()) for name in args.stretch)
            stretch = cost_stretch(own, other)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    decoder = SpeculativeDecoder.load(args.bundle, threads=args.threads)
    if stretch is not None:
        decoder.wrap_target(lambda runner: StretchedRunner(runner, stretch))
    decoder.costs()  # calibrate (or load the stored costs) before any timed run
    rows = run_arms(decoder, prompts, arms, args.repeats, args.max_new_tokens, args.seed,
                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    summary = summarize_arms(rows, args.baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(args.bundle, args.threads), "arms": spec, "rows": rows}
    if stretch is not None:
        record["stretch"] = {"widths": stretch.widths, "ratios": stretch.ratios,
                             "costs": dataclasses.asdict(decoder.costs())}
    (out / "rows.json").write_text(json.dumps(record))
    (out / "summary.md").write_text(arms_markdown(summary, args.baseline))
    print(arms_markdown(summary, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
