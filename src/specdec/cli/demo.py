"""``specdec demo``: the main job on the default real pair, end to end (runtime + export: lives above both).

Exports the pinned Qwen2.5-Coder pair as int4 the first time (needs the ``[export,pair]``
extras), then completes a code prompt with speculative decoding and with target-only
decoding, and prints both speeds. Greedy, so both outputs must be the same tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROMPT = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number, computed iteratively."""
'''


def default_bundle() -> Path:
    from specdec.contract.bundle import cache_dir

    return cache_dir() / "bundles" / "qwen2.5-coder-int4"


def ensure_bundle(bundle: Path) -> None:
    if (bundle / "manifest.json").is_file():
        return
    try:
        from specdec.export.bundle import ExportOptions, Progress, export_bundle
        from specdec.export.pair import DEFAULT_PAIR, pair_sources
    except ImportError as exc:
        raise ValueError(f"{exc.name} is missing: the first run exports the pair, pip install -e '.[export,pair]'") from None
    progress = Progress()
    progress(f"no bundle at {bundle}: exporting the default pair ({DEFAULT_PAIR}, int4); this takes several minutes")
    target, draft = pair_sources(DEFAULT_PAIR, progress)
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=bundle, quant="int4"), progress)


def add_demo_parser(commands) -> None:
    demo = commands.add_parser("demo", help="export the default real pair if needed, complete code, compare speeds")
    demo.add_argument("--bundle", default=None, help="bundle folder (default: the cache's qwen2.5-coder-int4)")
    demo.add_argument("--max-new-tokens", type=int, default=128)


def cmd_demo(args) -> int:
    from specdec.decoding.decoder import SpeculativeDecoder
    from specdec.sampling.processors import SamplingConfig

    bundle = Path(args.bundle) if args.bundle else default_bundle()
    ensure_bundle(bundle)
    decoder = SpeculativeDecoder.load(bundle)
    greedy = SamplingConfig(temperature=0.0)
    print(PROMPT, end="")
    speculative = None
    for piece in decoder.stream(PROMPT, max_new_tokens=args.max_new_tokens, sampling=greedy,
                                num_draft_tokens="auto", proposer="hybrid"):
        print(piece, end="", flush=True)
    print()
    speculative = decoder.generate(PROMPT, max_new_tokens=args.max_new_tokens, sampling=greedy,
                                   num_draft_tokens="auto", proposer="hybrid")
    baseline = decoder.generate(PROMPT, max_new_tokens=args.max_new_tokens, sampling=greedy, num_draft_tokens=0)
    ratio = speculative.stats.tokens_per_s / max(baseline.stats.tokens_per_s, 1e-9)
    print(f"\nspeculative (auto, hybrid): {speculative.stats.tokens_per_s:.1f} tok/s, "
          f"acceptance {speculative.stats.acceptance_rate:.2f}", file=sys.stderr)
    print(f"target only:                {baseline.stats.tokens_per_s:.1f} tok/s", file=sys.stderr)
    print(f"speedup {ratio:.2f}x; outputs identical: {speculative.token_ids == baseline.token_ids}", file=sys.stderr)
    return 0
