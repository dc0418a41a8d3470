"""One-token target passes by the folded runner's view step (``FoldedRunner.chunk``: a pass attends over its total
rounded up to it), several steps in turn on ONE runner (two runners differ by ~1 ms a pass by where their memory
landed): after each change of step an untimed pass binds the views again, then a timed one; and whether their
logits are bit-equal (they must be: the columns past the total add exact zeros).

    python tools/measure/view_chunk.py BUNDLE [--weight-form nbits] [--chunks 256,32] [--contexts 100,300,700,1500]
        [--repeats 25] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_profile import _fill  # noqa: E402  (the same random context as graph_profile's passes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--weight-form", default=None)
    parser.add_argument("--chunks", default="256,32")
    parser.add_argument("--contexts", default="100,300,700,1500")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from specdec.contract.manifest import Manifest
    from specdec.runners.factory import make_runner
    from specdec.runners.huge_pages import collapse_resident

    spec = Manifest.read(args.bundle).target
    onnx_file = dict(spec.weight_forms)[args.weight_form] if args.weight_form else spec.onnx_file
    chunks = [int(c) for c in args.chunks.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    runner = make_runner(str(args.bundle / onnx_file), spec, "cpu", max(contexts) + 128, 64, args.threads)
    collapse_resident()  # its weights on 2 MiB pages, as a load leaves them (runners/huge_pages.py)
    rng = np.random.default_rng(0)
    for context in contexts:
        _fill(runner, context, rng)
        times, logits = {chunk: [] for chunk in chunks}, {}
        for repeat in range(args.repeats + 1):
            for chunk in chunks if repeat % 2 else chunks[::-1]:
                runner.chunk = chunk
                runner.forward([42], [context])  # untimed: binds the views for this step
                start = time.perf_counter()
                out = runner.forward([42], [context])
                times[chunk].append(time.perf_counter() - start)
                logits[chunk] = np.array(out, copy=True)
        equal = all(np.array_equal(logits[chunks[0]], logits[chunk]) for chunk in chunks)
        line = ", ".join(f"step {chunk}: {1000 * statistics.median(times[chunk][1:]):.2f} ms" for chunk in chunks)
        print(f"{context} cached tokens: {line}; logits bit-equal: {equal}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
