"""One model's passes with its packed weights on 4 KiB pages and on 2 MiB pages, alternated in one process.

    python tools/measure/page_size_ab.py BUNDLE [--role target] [--weight-form nbits] [--context 128[,4096]]
        [--widths 1,5] [--rounds 24] [--passes 5] [--threads N]
    python tools/measure/page_size_ab.py BUNDLE --prompts PROMPTS.json [--weight-form int8] [--max-new-tokens 128]

Three runners of the same model file: ``first`` and ``second`` made one after the other and left on 4 KiB pages,
then ``huge``, whose newly resident memory (its packed weights, its cache) is moved to 2 MiB pages
(runners/huge_pages.py: what a load does). The runner a process makes first is the target of a load; the one made
after it often runs faster (its buffers reuse memory the first load freed), so both are shown. Every round runs
``--passes`` passes of each runner and width in a fresh random order; prints the median of the per-round means
and the ratios to ``first``.

With ``--prompts`` (a bench prompt set): two whole decoders instead, the first with its memory moved to 2 MiB
pages once loaded, the second loaded after it and left on 4 KiB pages (a second load reuses memory the first freed
and runs faster than a first load would on 4 KiB pages: the comparison understates the gain); each prompt
generates target-only, then with the default proposers, on both (their order alternating by prompt); prints
tokens/s per prompt, whether the tokens are the same, and the median and geometric mean of the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdec.contract.bundle import inside, open_bundle
from specdec.runners.factory import make_runner
from specdec.runners.huge_pages import collapse_resident, resident_ranges, settle
from specdec.runners.runner import KVSnapshot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--weight-form", default=None, help="which of the model's weight forms (default: the first)")
    parser.add_argument("--context", default="128", help="comma list of cached tokens, ascending")
    parser.add_argument("--widths", default="1")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompts", type=Path, help="compare two whole decoders on this bench prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.prompts is not None:
        return decoders(args)
    spec = open_bundle(args.bundle, verify=False).models()[args.role]
    forms = dict(spec.weight_forms)
    if args.weight_form is not None and args.weight_form not in forms:
        parser.error(f"the {args.role} has no weight form {args.weight_form!r}")
    onnx_file = forms[args.weight_form] if args.weight_form else spec.onnx_file
    contexts = [int(c) for c in args.context.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    rows = np.random.default_rng(0).integers(100, 20000, max(contexts))

    def made(context: int):
        runner = make_runner(str(inside(args.bundle, onnx_file)), spec, "cpu", max(contexts) + max(widths) + 1,
                             max(widths), args.threads)
        runner.restore(KVSnapshot(rows[:context], runner.random_kv(context)), context)
        return runner

    runners = {"first": made(contexts[0]), "second": made(contexts[0])}
    before = resident_ranges()
    runners["huge"] = made(contexts[0])
    collapsed, seconds = collapse_resident(exclude=before)
    print(f"{args.role} ({onnx_file}): {collapsed >> 20} MiB of the third runner's memory on 2 MiB pages in "
          f"{seconds:.2f} s", flush=True)
    rng = random.Random(0)
    for context in contexts:
        for runner in runners.values():
            runner.restore(KVSnapshot(rows[:context], runner.random_kv(context)), context)
        times = {(name, width): [] for name in runners for width in widths}
        order = list(times)
        for _ in range(args.rounds + 2):  # two rounds warm up
            rng.shuffle(order)
            for name, width in order:
                feed, positions = [42] * width, list(range(context, context + width))
                started = time.perf_counter()
                for _ in range(args.passes):
                    runners[name].forward(feed, positions)
                times[name, width].append((time.perf_counter() - started) / args.passes)
        for width in widths:
            medians = {name: statistics.median(times[name, width][2:]) for name in runners}
            print(f"T={width} @ {context}: " + ", ".join(f"{name} {1e3 * m:.2f} ms" for name, m in medians.items())
                  + f"; second/first {medians['second'] / medians['first']:.3f}, huge/first "
                  f"{medians['huge'] / medians['first']:.3f}, huge/second {medians['huge'] / medians['second']:.3f}",
                  flush=True)
    return 0


def decoders(args) -> int:
    from specdec.decoding.decoder import SpeculativeDecoder

    def loaded():
        decoder = SpeculativeDecoder.load(args.bundle, threads=args.threads, weight_form=args.weight_form)
        if decoder.draft_sessions is not None:
            decoder.draft_sessions.get()  # opened on a thread: made before its memory is moved or timed
        settle()  # the load's own background move ran (and found the switch off)
        return decoder

    os.environ["SPECDEC_HUGE_PAGES"] = "0"  # the loads' own moves off: the tool moves the first decoder's memory
    huge = loaded()
    os.environ["SPECDEC_HUGE_PAGES"] = "1"
    collapsed, seconds = collapse_resident()
    os.environ["SPECDEC_HUGE_PAGES"] = "0"
    print(f"{collapsed >> 20} MiB of the first decoder's memory on 2 MiB pages in {seconds:.2f} s", flush=True)
    plain = loaded()
    prompts = json.loads(args.prompts.read_text())
    for mode, options in (("target only", {"num_draft_tokens": 0}), ("default", {})):
        ratios = []
        for index, item in enumerate(prompts):
            order = (("4k", plain), ("2M", huge)) if index % 2 == 0 else (("2M", huge), ("4k", plain))
            results = {name: decoder.generate(item["prompt"], max_new_tokens=args.max_new_tokens, **options)
                       for name, decoder in order}
            speeds = {name: result.stats.tokens_per_s for name, result in results.items()}
            ratios.append(speeds["2M"] / speeds["4k"])
            print(f"{mode}: {item['id'][:30]:30s} {item.get('kind', ''):6s} 4 KiB {speeds['4k']:6.2f} tok/s, 2 MiB "
                  f"{speeds['2M']:6.2f}, {ratios[-1]:.3f}x, same tokens: "
                  f"{results['4k'].token_ids == results['2M'].token_ids}", flush=True)
        print(f"{mode}: 2 MiB / 4 KiB pages, median {statistics.median(ratios):.3f}x, geometric mean "
              f"{statistics.geometric_mean(ratios):.3f}x over {len(ratios)} prompts", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
