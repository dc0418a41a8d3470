"""A/B: default auto with the learned cost shape vs the calibrated shape vs target-only, alternating per prompt."""
import json, random, sys, collections, time
from specdec.decoding.decoder import SpeculativeDecoder
from specdec.runners.standard import session_options
from specdec.sampling.processors import SamplingConfig
from specdec.bench.bench import start_cold
session_options(2)
dec = SpeculativeDecoder.load(sys.argv[1], threads=2)
from specdec.decoding import proposers
prompts = [p for p in json.load(open(sys.argv[2])) if p["kind"] == "prose"]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
g = SamplingConfig(temperature=0.0)
c = dec.costs()
print("calibrated", [round(v / c.verify[0], 2) for v in c.verify[:9]], flush=True)
rng = random.Random(7)
rows = []
for rep in range(reps):
    for p in prompts:
        arms = ["backoff", "steady", "target"]
        rng.shuffle(arms)
        for arm in arms:
            start_cold(dec)
            proposers.DRAFT_MAX_PROBE_EVERY = 16 if arm == "steady" else 128
            opt = dict(num_draft_tokens=0) if arm == "target" else dict(proposer="draft")
            r = dec.generate(p["prompt"], max_new_tokens=128, sampling=g, **opt)
            rows.append(dict(rep=rep, id=p["id"], kind=p["kind"], arm=arm, tps=r.stats.tokens_per_s,
                             n=len(r.token_ids), ids=r.token_ids, df=r.stats.draft_forwards, ds=r.stats.draft_seconds))
            print(rep, p["id"], arm, round(r.stats.tokens_per_s, 2), r.stats.draft_forwards, round(r.stats.draft_seconds, 2), flush=True)
json.dump(rows, open("rows.json", "w"))
agg = collections.defaultdict(float)
for r in rows:
    agg[(r["kind"], r["arm"])] += r["tps"]; agg[("all", r["arm"])] += r["tps"]
for kind in ("all", "code", "prose", "edit"):
    t = agg[(kind, "target")]
    print(kind, {a: round(agg[(kind, a)] / t, 3) for a in ("backoff", "steady", "target")})
same = sum(1 for a in rows for b in rows if a["rep"] == b["rep"] and a["id"] == b["id"] and a["arm"] == "backoff" and b["arm"] == "steady" and a["ids"] == b["ids"])
print("learn==fixed outputs", same, "of", len(prompts) * reps)
