"""The scripted decoder's outputs in every mode, greedy and seeded, as JSON: to compare two commits token for token.

    git worktree add /tmp/before COMMIT
    PYTHONPATH=/tmp/before/src:/tmp/before/tests python tools/check/scripted_outputs.py before.json
    PYTHONPATH=src:tests python tools/check/scripted_outputs.py after.json && cmp before.json after.json

No model, no onnxruntime: the scripted runners of tests/scripted.py (seconds). A refactor that changes no
behaviour gives the same file.
"""
import json, sys
import numpy as np
from specdec import SamplingConfig
from scripted import scripted_decoder
modes = [dict(num_draft_tokens=0), dict(num_draft_tokens=3, proposer="draft"), dict(num_draft_tokens="auto", proposer="draft"),
         dict(proposer="lookup"), dict(proposer="suffix"), dict(proposer="hybrid"), dict(tree="2,2,1"), dict(tree="auto"),
         dict(num_draft_tokens=4, proposer="draft", acceptance="rejection")]
out = {}
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(0, 14, size=n)] for n in (3, 7, 12, 20, 30)] + [[3, 4, 5, 6] * 6]
for i, mode in enumerate(modes):
    for j, prompt in enumerate(prompts):
        for s, sampling in enumerate((None, SamplingConfig(temperature=0.8, top_p=0.9))):
            dec = scripted_decoder()
            kw = dict(mode)
            if sampling is not None:
                kw.update(sampling=sampling, seed=11 + j)
            if kw.get("acceptance") == "rejection" and sampling is None:
                continue
            r = dec.generate(prompt, max_new_tokens=40, **kw)
            out[f"{i}/{j}/{s}"] = r.token_ids
json.dump(out, open(sys.argv[1], "w"))
print(len(out), "outputs")
