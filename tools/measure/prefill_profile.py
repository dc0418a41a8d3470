"""Prefill throughput by chunk size: how many prompt tokens per second each model computes when the prompt is
fed in passes of C tokens (the decoder's PREFILL_CHUNK), on the runtime's own runner.

    python tools/measure/prefill_profile.py BUNDLE [--tokens 1024] [--chunks 32,64,128,256] [--repeats 3] [--threads N]

The chunk sizes take turns in a random order per repeat (a burst of load lands on all of them alike);
each run prefills the same token ids from an empty cache. Prints tokens/s per (model, chunk), median of
the repeats.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def prefill_seconds(runner, ids: list, chunk: int) -> float:
    runner.reset()
    begin = time.perf_counter()
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        runner.forward(part, range(start, start + len(part)), last_logits_only=True)  # as the decoder's catch_up
        runner.commit(len(part))
    return time.perf_counter() - begin


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", default="32,64,128,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    from specdec.contract.bundle import inside, open_bundle
    from specdec.runners.factory import make_runner

    chunks = [int(c) for c in args.chunks.split(",")]
    root = Path(args.bundle)
    manifest = open_bundle(root)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(100, 20000, args.tokens)]
    for role, spec in manifest.models().items():
        runner = make_runner(str(inside(root, spec.onnx_file)), spec, "cpu", args.tokens + 1, max(chunks),
                             args.threads)
        prefill_seconds(runner, ids[: max(chunks) * 2], max(chunks))  # warm-up: first runs allocate
        times = {chunk: [] for chunk in chunks}
        for _ in range(args.repeats):
            order = list(chunks)
            random.Random(len(times[chunks[0]])).shuffle(order)
            for chunk in order:
                times[chunk].append(prefill_seconds(runner, ids, chunk))
        row = ", ".join(f"chunk {c}: {args.tokens / statistics.median(times[c]):.1f} tok/s" for c in chunks)
        print(f"{role}: {row}", flush=True)
        del runner
    return 0


if __name__ == "__main__":
    sys.exit(main())
