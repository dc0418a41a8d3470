"""One check for bundles whose graphs change how passes compute (a KV type, a weight form): greedy speculation in
every mode is target-only decoding, and coupled seeded sampling in every mode is target-only's seeded sample."""

from __future__ import annotations

MODES = [dict(num_draft_tokens=3, proposer="draft"), dict(tree="2,2,1", proposer="draft"),
         dict(num_draft_tokens="auto"), dict(num_draft_tokens=2, proposer="suffix")]
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"


def assert_every_mode_is_target_only(bundle, **load) -> None:
    from specdec import SamplingConfig, SpeculativeDecoder

    decoder = SpeculativeDecoder.load(bundle, **load)
    baseline = decoder.generate(PROMPT, max_new_tokens=40, num_draft_tokens=0).token_ids
    config = SamplingConfig(temperature=0.9, top_k=8)
    sampled = {seed: decoder.generate(PROMPT, max_new_tokens=24, sampling=config, num_draft_tokens=0,
                                      seed=seed).token_ids for seed in (0, 1)}
    for mode in MODES:
        assert decoder.generate(PROMPT, max_new_tokens=40, **mode).token_ids == baseline, mode
        for seed, expected in sampled.items():
            out = decoder.generate(PROMPT, max_new_tokens=24, sampling=config, seed=seed, acceptance="coupled", **mode)
            assert out.token_ids == expected, (mode, seed)
