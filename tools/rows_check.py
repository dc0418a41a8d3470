"""Does this CPU give a verify pass's rows bit for bit the one-token passes' rows? (greedy identity needs it)

    python tools/rows_check.py BUNDLE [--role target] [--threads N]

Fills the cache with 32 tokens, then runs 5 more once as one pass and once as five one-token passes, and prints
the largest logit difference and whether every row's argmax agrees. 0.0 means speculation's verify rows equal
target-only decoding here; anything else means int4 greedy output can differ from target-only on near-ties (seen
on a 2-core AMD EPYC with AVX2: onnxruntime's one-row MatMulNBits kernel rounds differently from its multi-row one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from specdec.contract.bundle import inside, open_bundle
from specdec.runners.fused import make_runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    spec = open_bundle(args.bundle, verify=False).models()[args.role]
    runner = make_runner(str(inside(args.bundle, spec.onnx_file)), spec, "cpu", 256, 64, args.threads)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 20000, 37)]
    runner.forward(ids[:32], list(range(32)))
    runner.commit(32)
    wide = np.array(runner.forward(ids[32:], list(range(32, 37))))[-5:]
    rows = []
    for position in range(32, 37):
        rows.append(np.array(runner.forward([ids[position]], [position]))[-1])
        runner.commit(1)
    rows = np.stack(rows)
    print(f"{args.bundle.name} {args.role}: max |verify row - one-token row| = {np.abs(wide - rows).max():.3g}, "
          f"argmax equal: {bool((wide.argmax(-1) == rows.argmax(-1)).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
