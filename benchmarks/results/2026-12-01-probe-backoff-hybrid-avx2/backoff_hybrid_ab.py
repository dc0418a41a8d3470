"""A/B: the default (auto hybrid) with draft probes backed off (16, 32, 64, 128 rounds) vs every 16 rounds vs
target-only, arms shuffled per prompt, one decoder, every run cold (empty caches and suffix store).

    python backoff_hybrid_ab.py BUNDLE PROSE.json PROSE_REPEATS CODE.json CODE_REPEATS OUT.json
"""
import collections
import json
import random
import sys

from specdec.bench.bench import start_cold
from specdec.decoding import proposers
from specdec.decoding.decoder import SpeculativeDecoder
from specdec.sampling.processors import SamplingConfig

dec = SpeculativeDecoder.load(sys.argv[1], threads=2)
sets = [(json.load(open(sys.argv[2])), int(sys.argv[3])),
        ([p for p in json.load(open(sys.argv[4])) if p["kind"] == "code"], int(sys.argv[5]))]
greedy = SamplingConfig(temperature=0.0)
costs = dec.costs()
print("calibrated", [round(v / costs.verify[0], 2) for v in costs.verify[:9]], "draft",
      round(costs.draft_step / costs.verify[0], 2), flush=True)
rng = random.Random(11)
rows = []
for prompts, repeats in sets:
    for rep in range(repeats):
        for p in prompts:
            arms = ["backoff", "steady", "target"]
            rng.shuffle(arms)
            for arm in arms:
                start_cold(dec)
                proposers.DRAFT_MAX_PROBE_EVERY = 16 if arm == "steady" else 128
                options = dict(num_draft_tokens=0) if arm == "target" else {}
                r = dec.generate(p["prompt"], max_new_tokens=128, sampling=greedy, **options)
                s = r.stats
                rows.append(dict(rep=rep, id=p["id"], kind=p["kind"], arm=arm, tokens=s.new_tokens,
                                 seconds=s.decode_seconds, draft_seconds=s.draft_seconds, df=s.draft_forwards,
                                 tf=s.target_forwards, ids=r.token_ids))
                print(rep, p["id"], arm, round(s.tokens_per_s, 2), s.draft_forwards, round(s.draft_seconds, 2),
                      flush=True)
json.dump(rows, open(sys.argv[6], "w"))
tokens, seconds, draft = collections.defaultdict(int), collections.defaultdict(float), collections.defaultdict(float)
for r in rows:
    for kind in (r["kind"], "all"):
        tokens[kind, r["arm"]] += r["tokens"]
        seconds[kind, r["arm"]] += r["seconds"]
        draft[kind, r["arm"]] += r["draft_seconds"]
for kind in ("all", "code", "prose"):
    base = tokens[kind, "target"] / seconds[kind, "target"]
    print(kind, {a: round(tokens[kind, a] / seconds[kind, a] / base, 3) for a in ("backoff", "steady", "target")},
          "draft s", {a: round(draft[kind, a], 1) for a in ("backoff", "steady")})
same = sum(1 for a in rows for b in rows if (a["rep"], a["id"]) == (b["rep"], b["id"]) and a["arm"] == "backoff"
           and b["arm"] == "steady" and a["ids"] == b["ids"])
print("backoff == steady outputs", same, "of", sum(1 for r in rows if r["arm"] == "target"))
