"""The prepared GPU check: run it on a machine with an NVIDIA GPU, TensorRT and onnxruntime-gpu.

    pip install torch==2.13.0 -e ".[export,test,gpu]" tensorrt && python tools/check/gpu_check.py [--tiny-only]

1. a tiny pair: export (float16), build TensorRT engines, compare logits of ORT-CPU, ORT-CUDA and
   TensorRT on one prefill + verify, and greedy outputs of every backend vs target-only on CPU;
   the same for a float16 int4-qdq bundle (TensorRT's int4 weight-only form);
2. the real pair (unless --tiny-only; needs the [pair] extra): float16 bundle + engines, then a
   speed table: target-only vs speculative on ORT-CUDA and native TensorRT.
Budget: about 8 minutes on a data-centre GPU. Prints a Markdown table at the end.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

PROMPT = "def quicksort(items):\n    "


def export(target, draft, out, dtype, quant="none"):
    from specdec.export.bundle import ExportOptions, export_bundle

    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, dtype=dtype, quant=quant, parity=False))


def build(bundle):
    from specdec.runners.tensorrt.profiles import ProfileLimits
    from specdec.runners.tensorrt.build import build_engines

    build_engines(bundle, ProfileLimits(max_context=1024, max_verify=16, max_prefill=64))


def speeds(bundle, providers, max_new):
    from specdec import SpeculativeDecoder

    rows, outputs = [], {}
    for provider in providers:
        decoder = SpeculativeDecoder.load(bundle, provider=provider, max_context=1024)
        decoder.generate(PROMPT, max_new_tokens=8, num_draft_tokens=0)  # warm-up
        for mode in (0, 4, "auto"):
            result = decoder.generate(PROMPT, max_new_tokens=max_new, num_draft_tokens=mode)
            outputs[(provider, mode)] = result.token_ids
            rows.append((provider, mode, result.stats.tokens_per_s, result.stats.acceptance_rate))
    return rows, outputs


def logits_parity(bundle, providers):
    from specdec import SpeculativeDecoder

    reference = None
    errors = {}
    for provider in providers:
        decoder = SpeculativeDecoder.load(bundle, provider=provider, max_context=1024)
        runner = decoder.target
        runner.reset()
        ids = decoder.codec.encode(PROMPT)
        logits = np.array(runner.forward(ids, range(len(ids))))
        if reference is None:
            reference = logits
        errors[provider] = float(np.abs(logits - reference).max())
    return errors


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny-only", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    from tiny_models import build_noisy_copy, build_tiny_model

    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="specdec-gpu-"))
    providers = ["cpu", "cuda", "tensorrt-native"]
    target = build_tiny_model(work / "t", "llama", seed=0)
    draft = build_noisy_copy(target, work / "d", noise=0.005, seed=1)
    export(target, draft, work / "tiny", "float16")
    build(work / "tiny")
    print("tiny logits max abs error vs ORT-CPU:", logits_parity(work / "tiny", providers))
    rows, outputs = speeds(work / "tiny", providers, 64)
    baseline = outputs[("cpu", 0)]
    mismatches = [key for key, ids in outputs.items() if ids != baseline]
    print("tiny greedy outputs identical to CPU target-only:", not mismatches, mismatches)
    # int4 weight-only for TensorRT: DequantizeLinear(int4, block 32) + MatMul, float16 activations
    export(target, draft, work / "tiny-int4", "float16", quant="int4-qdq")
    build(work / "tiny-int4")
    _, int4_outputs = speeds(work / "tiny-int4", providers, 64)
    int4_baseline = int4_outputs[("cpu", 0)]
    int4_mismatches = [key for key, ids in int4_outputs.items() if ids != int4_baseline]
    print("tiny int4-qdq greedy outputs identical to its CPU target-only:", not int4_mismatches, int4_mismatches)
    mismatches += int4_mismatches
    if not args.tiny_only:
        from specdec.export.pair import DEFAULT_PAIR, pair_sources

        real_target, real_draft = pair_sources(DEFAULT_PAIR)
        export(real_target, real_draft, work / "real", "float16")
        build(work / "real")
        rows, outputs = speeds(work / "real", ["cuda", "tensorrt-native"], args.max_new_tokens)
    print("\n| backend | draft tokens | tok/s | acceptance |\n|---|---|---|---|")
    for provider, mode, rate, acceptance in rows:
        print(f"| {provider} | {mode} | {rate:.1f} | {acceptance:.2f} |")
    print(f"\n(total {time.time() - started:.0f} s)")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
