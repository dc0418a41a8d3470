"""How often does a draft's top token equal a target's on a fixed text? (teacher-forced, every pairing of bundles)

    python tools/measure/draft_agreement.py BUNDLE_A BUNDLE_B [...] --text FILE [--tokens 4096] [--context 512]
        [--threads N] [--json OUT]

Greedy acceptance measured by `specdec bench` runs on the target's own output, so two targets are compared on two
different texts. This tool scores every bundle's target and draft on the same text instead (chunks of
``--context`` tokens from an empty cache, every position) and prints, for each (target of A, draft of B), the
share of positions where the two argmaxes agree over the tokenizer's ids, and how often the targets agree with
each other. A proxy for the acceptance of a greedy proposal, free of the generated text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specdec.contract.bundle import inside, open_bundle
from specdec.runners.factory import make_runner

SEGMENT = 128  # tokens per pass


def top_tokens(bundle: Path, role: str, tokens: np.ndarray, context: int, threads) -> np.ndarray:
    """[N] the role's argmax after each of ``tokens`` ([N] int64, N a multiple of ``context``), chunk by chunk."""
    manifest = open_bundle(bundle, verify=False)
    spec = manifest.models()[role]
    runner = make_runner(str(inside(bundle, spec.onnx_file)), spec, "cpu", context, SEGMENT, threads)
    words = Tokenizer.from_file(str(inside(bundle, manifest.tokenizer_file))).get_vocab_size()
    rows = []
    for start in range(0, len(tokens), context):
        runner.reset()
        for at in range(0, context, SEGMENT):
            ids = tokens[start + at:start + min(at + SEGMENT, context)]
            logits = runner.forward(ids, np.arange(at, at + len(ids)))
            runner.commit(len(ids))
            rows.append(logits[:, :words].argmax(-1))
    return np.concatenate(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--text", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    first = args.bundles[0]
    tokenizer = Tokenizer.from_file(str(inside(first, open_bundle(first, verify=False).tokenizer_file)))
    ids = tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False).ids
    count = min(args.tokens, len(ids)) // args.context * args.context
    if count == 0:
        parser.error(f"--text has {len(ids)} tokens, fewer than one --context of {args.context}")
    tokens = np.asarray(ids[:count], np.int64)
    tops = {(bundle, role): top_tokens(bundle, role, tokens, args.context, args.threads)
            for bundle in args.bundles for role in ("target", "draft")}
    result = {"text": str(args.text.name), "tokens": count, "context": args.context, "pairs": [], "targets": []}
    for target in args.bundles:
        for draft in args.bundles:
            share = float((tops[target, "target"] == tops[draft, "draft"]).mean())
            result["pairs"].append({"target": str(target), "draft": str(draft), "agreement": share})
            print(f"target {target}  draft {draft}: {share:.4f}")
    for other in args.bundles[1:]:
        share = float((tops[first, "target"] == tops[other, "target"]).mean())
        result["targets"].append({"a": str(first), "b": str(other), "agreement": share})
        print(f"targets {first} / {other}: {share:.4f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
