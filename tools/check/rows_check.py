"""Does this CPU give a verify pass's rows bit for bit the one-token passes' rows? (greedy identity needs it)

    python tools/check/rows_check.py BUNDLE [--role target] [--threads N] [--exact-rows]

Prints what the decoder checks at load (``runners/row_parity.py``): the largest logit difference of a one-token
pass and of a two-row pass from a five-row verify pass's first row, and whether their argmaxes agree. 0.0 means
speculation's verify rows equal target-only decoding here; anything else means int4 greedy output can differ from
target-only on near-ties (seen on a 2-core AMD EPYC with AVX2: onnxruntime's one-row MatMulNBits kernel rounds
differently from its multi-row one). ``--exact-rows``: one-token passes padded to two rows, as the decoder's cure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.contract.bundle import inside, open_bundle
from specdec.runners.factory import make_runner
from specdec.runners.row_parity import row_gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--exact-rows", action="store_true")
    args = parser.parse_args()
    spec = open_bundle(args.bundle, verify=False).models()[args.role]
    runner = make_runner(str(inside(args.bundle, spec.onnx_file)), spec, "cpu", 256, 64, args.threads)
    runner.pad_one_row = args.exact_rows
    gaps = row_gaps(runner)
    if gaps is None:
        print(f"{args.bundle.name} {args.role}: the cache is too small to compare a verify pass's rows", file=sys.stderr)
        return 2
    print(f"{args.bundle.name} {args.role}: max |verify row - one-token row| = {gaps['one_row']:.3g}, "
          f"two-row {gaps['two_rows']:.3g}, argmax equal: {gaps['argmax_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
