"""Resident memory of a loaded bundle, and of its target at depth: what `specdec serve` holds before and during a long prompt.

usage: python tools/measure/load_memory.py BUNDLE [--max-context 32768] [--depth 26600] [--threads 2]
                                   [--weight-form nbits|int8] [--keep-pages] [--keep-cache-pages] [--numpy-cache] [--passes N]
                                   [--calibrate] [--prefill FILE] [--read-around]

Loads the bundle as the server does (``SpeculativeDecoder.load``) and prints the process's resident memory
(VmRSS, anonymous, file-backed, and the peak so far: VmHWM) after the load; with ``--depth``, the target's cache is then filled with that many
random rows (``runners.runner.fill_random``) and one 64-token prefill chunk, one decode step and one 5-token
verify pass run at that depth, and the memory is printed again. For A/Bs of what the runtime gives back:
``--keep-pages`` skips ``runners/resident.release_after_load`` (the weight files' read-once pages, single-page
reads of the mapped files, the load's free heap); ``--keep-cache-pages`` keeps the cache pages the load's row check and the calibration wrote
(``Runner.release_cache`` only empties the cache); ``--calibrate`` measures the pass costs after the load (as a first ``auto`` request on a new
machine does; never stored) and prints the memory again; ``--numpy-cache`` allocates the KV caches with numpy's zeros instead of ``kv_store.cache_zeros`` (on
transparent huge pages where the OS uses them). Run one variant per process. ``--passes N`` also times N
one-token steps, N 5-token verify passes and N 64-token chunks at that depth (nothing committed; medians): that
giving back memory costs no speed. ``--prefill FILE`` instead prefills the target with the file's tokens, as a
request's prompt (the embedding gathers one row per token: the single-page reads of ``--keep-pages``' A/B), and
prints the memory and the seconds; ``--read-around`` keeps the kernel's read-around and fault-around on the mapped
weight files (skips ``runners/resident.read_rows_singly``; warm the page cache first, as an export or a verified load
does: ``cat BUNDLE/*/model.onnx.data > /dev/null``). ``SPECDEC_MAP_WEIGHTS=0`` in the environment lets onnxruntime
map the weight files itself (``runners/mapped_weights.py``'s A/B: the load's peak).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def resident() -> str:
    status = Path("/proc/self/status").read_text()
    mib = {key: int(re.search(key + r":\s+(\d+)", status).group(1)) // 1024
           for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    return (f"{mib['VmRSS']} MiB resident ({mib['RssAnon']} anonymous, {mib['RssFile']} file-backed; "
            f"peak {mib['VmHWM']} MiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--depth", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-pages", action="store_true")
    parser.add_argument("--numpy-cache", action="store_true")
    parser.add_argument("--passes", type=int, default=0)
    parser.add_argument("--keep-cache-pages", action="store_true")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--prefill", type=Path, default=None, metavar="FILE")
    parser.add_argument("--read-around", action="store_true")
    parser.add_argument("--weight-form", choices=("nbits", "int8"), default=None)
    args = parser.parse_args()
    if not Path("/proc/self/status").exists():
        print("needs Linux's /proc/self/status", file=sys.stderr)
        return 2
    import specdec.decoding.decoder as decoder_module
    import specdec.runners.folded as folded
    import specdec.runners.fused as fused
    import specdec.runners.kv_store as kv_store
    from specdec.runners.runner import Runner, fill_random

    if args.keep_pages:
        decoder_module.release_after_load = lambda root: None
    if args.read_around:
        import specdec.runners.resident as resident_module

        import specdec.runners.mapped_weights as mapped_module

        resident_module.read_rows_singly = lambda root: 0
        mapped_module.MappedWeights.read_rows_singly = lambda self: 0
    if args.keep_cache_pages:
        Runner.release_cache = Runner.reset
    if args.numpy_cache:
        for module in (folded, fused, kv_store):
            module.cache_zeros = lambda shape, dtype: np.zeros(shape, dtype)
    decoder = decoder_module.SpeculativeDecoder.load(args.bundle, threads=args.threads, max_context=args.max_context,
                                                     verify=False, weight_form=args.weight_form)
    if decoder.draft_opening is not None:  # the draft's session, and the pages released after it
        decoder.draft_opening.join()
    print(f"loaded (max_context {args.max_context}): {resident()}", flush=True)
    if args.calibrate:
        decoder.wrap_target(lambda runner: runner)  # forget any stored costs: measured now, not stored
        decoder.costs()
        print(f"after calibrating: {resident()}", flush=True)
    if args.prefill is not None:
        from specdec.decoding.rounds import catch_up

        ids = decoder.codec.encode(args.prefill.read_text(encoding="utf-8"))[: args.max_context]
        begin = time.perf_counter()
        catch_up(decoder.target, ids, leave=0)
        print(f"target after a prefill of {len(ids)} tokens of {args.prefill.name} "
              f"({time.perf_counter() - begin:.1f} s): {resident()}")
    if args.depth:
        target = decoder.target
        fill_random(target, args.depth)
        target.forward([42] * 64, range(args.depth, args.depth + 64), last_logits_only=True)
        target.forward([42], [args.depth])
        target.forward([42] * 5, range(args.depth, args.depth + 5))
        print(f"target at {args.depth} cached tokens, after a 64-token chunk, a step and a verify: {resident()}")
        for width in (1, 5, 64) if args.passes else ():
            times = []
            for _ in range(args.passes):
                begin = time.perf_counter()
                target.forward([42] * width, range(args.depth, args.depth + width), last_logits_only=width == 64)
                times.append(time.perf_counter() - begin)
            print(f"{width}-token pass at {args.depth}: median {statistics.median(times) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
