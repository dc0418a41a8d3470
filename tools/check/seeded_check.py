"""Seeded sampling on a bundle: does every mode return target-only's sampled tokens, and how often do proposals pass?

    python tools/check/seeded_check.py BUNDLE --prompts prompts.json [--temperature 0.7] [--max-new-tokens 64]

Prints, per mode: how many prompts give exactly target-only's tokens with the same seed, the
acceptance (accepted / proposed) and the per-token acceptance (accepted / (accepted + rejections)),
and one digest of all outputs (run it in several fresh processes: the digests must agree).
"""

from __future__ import annotations

import argparse
import hashlib
import json

from specdec import SamplingConfig, SpeculativeDecoder

MODES = {
    "target-only": dict(num_draft_tokens=0),
    "auto": dict(num_draft_tokens="auto"),  # the default: hybrid proposals, auto lengths
    "lookup": dict(num_draft_tokens="auto", proposer="lookup"),
    "auto-draft": dict(num_draft_tokens="auto", proposer="draft"),
    "g2": dict(num_draft_tokens=2, proposer="draft"),
    "tree": dict(tree="2,2,1"),
    "g2-rejection": dict(num_draft_tokens=2, proposer="draft", acceptance="rejection"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    args = parser.parse_args()
    modes = {name: MODES[name] for name in ["target-only"] + [m for m in args.modes.split(",") if m != "target-only"]}
    prompts = json.load(open(args.prompts))[: args.limit]
    decoder = SpeculativeDecoder.load(args.bundle)
    sampling = SamplingConfig(temperature=args.temperature)
    outputs = {mode: [] for mode in modes}
    counts = {mode: [0, 0, 0] for mode in modes}  # accepted, proposed, rejected rounds
    for item in prompts:
        for mode, kwargs in modes.items():
            result = decoder.generate(item["prompt"], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, **kwargs)
            outputs[mode].append(result.token_ids)
            stats = result.stats
            counts[mode][0] += stats.accepted
            counts[mode][1] += stats.proposed
            counts[mode][2] += stats.rejected_rounds
    base = outputs["target-only"]
    print(f"temperature {args.temperature}, seed {args.seed}, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    print("| mode | == target-only sampled tokens | acceptance | per-token acceptance |\n|---|---|---|---|")
    for mode in modes:
        same = sum(a == b for a, b in zip(outputs[mode], base))
        accepted, proposed, rejected = counts[mode]
        rate = f"{accepted / proposed:.3f}" if proposed else "-"
        token_rate = f"{accepted / (accepted + rejected):.3f}" if accepted + rejected else "-"
        print(f"| {mode} | {same}/{len(base)} | {rate} | {token_rate} |")
    digest = hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()[:16]
    print(f"digest of every output: {digest}")


if __name__ == "__main__":
    main()
