"""One-token decode passes of the same model from several bundles, interleaved: is a quantization recipe slower?

    python tools/measure/pass_ab.py BUNDLE_A BUNDLE_B [...] [--role target] [--context 256[,4096,...]] [--rounds 30]
        [--passes 10] [--threads N] [--widths 1,5] [--weight-form int8] [--json OUT]

Each bundle's ``--role`` model gets a runner (the runtime's own, make_runner) with ``--context`` tokens already in
its cache (a comma list: the cache grows from one depth to the next, each measured in turn). ``--synthetic`` fills
the caches with random rows instead of prefilling random tokens (the same rows in every bundle of one KV type): a
pass's time does not depend on the values, and a 32k-token prefill would take minutes per bundle. Every round runs ``--passes`` passes of each width (``--widths``: tokens per pass, 1 = a decode step,
5 = a verify pass of 4 proposals) on each bundle in a fresh random order, so a burst of load on a shared machine
lands on all bundles alike. Prints per bundle and width the median and the quartiles of the per-round mean pass
time, and its ratio to the first bundle's median at that width.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdec.contract.bundle import inside, open_bundle
from specdec.runners.factory import make_runner
from specdec.runners.huge_pages import collapse_resident


CHUNK = 256  # prefill rows per pass while growing the cache


def _runner(bundle: Path, role: str, max_context: int, threads, weight_form: str | None = None):
    manifest = open_bundle(bundle, verify=False)
    spec = manifest.models()[role]
    forms = dict(spec.weight_forms)
    if weight_form is not None and weight_form not in forms:
        raise SystemExit(f"{bundle}: the {role} has no weight form {weight_form!r} "
                         f"(it has: {', '.join(forms) or 'one'})")
    onnx_file = forms[weight_form] if weight_form is not None else spec.onnx_file
    return make_runner(str(inside(bundle, onnx_file)), spec, "cpu", min(max_context + 64, spec.max_positions),
                       CHUNK, threads)


def _grow(runner, context: int, synthetic: bool) -> None:
    """Fill the cache up to ``context`` tokens (random ids, the same for every bundle)."""
    ids = np.random.default_rng(0).integers(100, 20000, context)
    if synthetic:
        from specdec.runners.runner import KVSnapshot

        runner.restore(KVSnapshot(ids, runner.random_kv(context)), context)
        return
    for start in range(runner.length, context, CHUNK):
        chunk = ids[start:min(start + CHUNK, context)]
        runner.forward(chunk, np.arange(start, start + len(chunk)), last_logits_only=True)
        runner.commit(len(chunk))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--context", default="256", help="comma list of cached tokens, ascending (default 256)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--widths", default="1", help="comma list of tokens per pass (default 1)")
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--synthetic", action="store_true", help="random cache rows instead of a prefill")
    parser.add_argument("--small-pages", action="store_true",
                        help="leave the weights on 4 KiB pages (a load moves them to 2 MiB pages)")
    parser.add_argument("--weight-form", default=None, help="which of each bundle's weight forms (default: the first)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    runners = {str(b): _runner(b, args.role, max(contexts), args.threads, args.weight_form) for b in args.bundles}
    if not args.small_pages:
        collapse_resident()  # every runner's weights on 2 MiB pages, as a load leaves them (runners/huge_pages.py)
    rows = []
    for context in contexts:
        for runner in runners.values():
            _grow(runner, context, args.synthetic)
        rows += _measure(runners, context, widths, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _measure(runners: dict, context: int, widths: list, args) -> list:
    times = {(name, width): [] for name in runners for width in widths}
    order = list(times)
    rng = random.Random(0)
    for _ in range(args.rounds + 2):  # the first two rounds warm up
        rng.shuffle(order)
        for name, width in order:
            runner = runners[name]
            feed, positions = [42] * width, list(range(context, context + width))
            started = time.perf_counter()
            for _ in range(args.passes):
                runner.forward(feed, positions)  # not committed: every pass sees the same cache
            times[name, width].append((time.perf_counter() - started) / args.passes)
    rows = []
    for width in widths:
        base = None
        for name in runners:
            values = sorted(times[name, width][2:])
            median = statistics.median(values)
            base = base or median
            q1, q3 = values[len(values) // 4], values[(3 * len(values)) // 4]
            print(f"{args.role} T={width} @ {context}: {median * 1e3:6.2f} ms (quartiles {q1 * 1e3:.2f}-"
                  f"{q3 * 1e3:.2f}), {median / base:.3f}x  {Path(name).name}", flush=True)
            rows.append({"bundle": Path(name).name, "role": args.role, "context": context, "width": width,
                         "median_ms": round(median * 1e3, 3), "q1_ms": round(q1 * 1e3, 3), "q3_ms": round(q3 * 1e3, 3),
                         "ratio_to_first": round(median / base, 4)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
