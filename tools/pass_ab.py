"""One-token decode passes of the same model from several bundles, interleaved: is a quantization recipe slower?

    python tools/pass_ab.py BUNDLE_A BUNDLE_B [...] [--role target] [--context 256] [--rounds 30] [--passes 10]
        [--threads N] [--widths 1,5]

Each bundle's ``--role`` model gets a runner (the runtime's own, make_runner) with ``--context`` tokens already in
its cache. Every round runs ``--passes`` passes of each width (``--widths``: tokens per pass, 1 = a decode step,
5 = a verify pass of 4 proposals) on each bundle in a fresh random order, so a burst of load on a shared machine
lands on all bundles alike. Prints per bundle and width the median and the quartiles of the per-round mean pass
time, and its ratio to the first bundle's median at that width.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdec.contract.bundle import inside, open_bundle
from specdec.runners.fused import make_runner


def _runner(bundle: Path, role: str, context: int, threads):
    manifest = open_bundle(bundle, verify=False)
    spec = manifest.models()[role]
    runner = make_runner(str(inside(bundle, spec.onnx_file)), spec, "cpu", context + 64, 64, threads)
    ids = np.random.default_rng(0).integers(100, 20000, context)
    for start in range(0, context, 64):
        chunk = ids[start:start + 64]
        runner.forward(chunk, np.arange(start, start + len(chunk)))
        runner.commit(len(chunk))
    return runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--widths", default="1", help="comma list of tokens per pass (default 1)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    runners = {str(b): _runner(b, args.role, args.context, args.threads) for b in args.bundles}
    times = {(name, width): [] for name in runners for width in widths}
    order = list(times)
    rng = random.Random(0)
    for _ in range(args.rounds + 2):  # the first two rounds warm up
        rng.shuffle(order)
        for name, width in order:
            runner = runners[name]
            feed, positions = [42] * width, list(range(args.context, args.context + width))
            started = time.perf_counter()
            for _ in range(args.passes):
                runner.forward(feed, positions)  # not committed: every pass sees the same cache
            times[name, width].append((time.perf_counter() - started) / args.passes)
    for width in widths:
        base = None
        for name in runners:
            values = sorted(times[name, width][2:])
            median = statistics.median(values)
            base = base or median
            q1, q3 = values[len(values) // 4], values[(3 * len(values)) // 4]
            print(f"{args.role} T={width} @ {args.context}: {median * 1e3:6.2f} ms (quartiles {q1 * 1e3:.2f}-"
                  f"{q3 * 1e3:.2f}), {median / base:.3f}x  {Path(name).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
