"""Memory under a flood of distinct requests: the process's RSS and the suffix store, every N requests.

    python tools/measure/suffix_flood.py BUNDLE [--requests 1000] [--new-tokens 8] [--suffix-cache MiB] [--every 100]

Each request is a different short prompt, decoded greedily with the default proposer (its output joins the
shared suffix store). A small ``--suffix-cache`` makes the store fill and drop its oldest outputs within
the run. Prints one JSON line per sample: requests done, RSS MiB, the store's tokens, bytes and evictions.
"""

import argparse
import json
import resource
import time


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("bundle")
parser.add_argument("--requests", type=int, default=1000)
parser.add_argument("--new-tokens", type=int, default=8)
parser.add_argument("--suffix-cache", type=float, default=0.015, metavar="MiB")
parser.add_argument("--every", type=int, default=100)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()

from specdec import SpeculativeDecoder  # noqa: E402  (after argparse: --help stays fast)

decoder = SpeculativeDecoder.load(args.bundle, threads=args.threads, suffix_cache_mib=args.suffix_cache)
started = time.perf_counter()
generated = 0
for i in range(args.requests + 1):
    if i % args.every == 0:
        print(json.dumps({"requests": i, "rss_mib": round(rss_mib(), 1), "new_tokens": generated,
                          "seconds": round(time.perf_counter() - started, 1), **decoder.suffix_cache.stats()}),
              flush=True)
    if i == args.requests:
        break
    result = decoder.generate(f"# {i * 7919 % 10007}: a Python function named f{i} that returns", seed=0,
                              max_new_tokens=args.new_tokens)
    generated += len(result.token_ids)
