"""Quantize a float32 bundle's models with one int4 recipe into a new bundle, without exporting again.

    python tools/inputs/quant_variant.py FLOAT_BUNDLE OUT [--role target|draft|both] [--method rtn|rtn-asym|k-quant]
        [--lm-head-bits 4|8] [--block-size N] [--accuracy-level 4]
    python tools/inputs/quant_variant.py FLOAT_BUNDLE OUT --method gguf     # the GGUF's own blocks, from the GGUFs
                                                                     # the manifest records (sha256 checked)

FLOAT_BUNDLE: a ``specdec-export --quant none`` bundle (fused graph): its ONNX is exactly what the exporter
hands to quantization, so a variant equals what ``specdec-export --quant int4`` with the same recipe writes
(parity notes aside). The roles not quantized are copied. OUT gets a
manifest with fresh hashes; ``specdec eval OUT`` and ``tools/measure/graph_profile.py OUT`` then measure the recipe.
Quantization runs in this process: ``/usr/bin/time -v`` around this tool gives its peak RSS.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from specdec.bench.llama_server import gguf_from_manifest
from specdec.contract.manifest import MANIFEST_NAME, Manifest
from specdec.export.bundle import hash_tree
from specdec.export.quantize import LM_HEAD_BITS, QUANT_METHODS, QuantRecipe, quantize_onnx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--role", choices=["target", "draft", "both"], default="both")
    parser.add_argument("--method", choices=QUANT_METHODS, default=QuantRecipe.method)
    parser.add_argument("--lm-head-bits", type=int, choices=LM_HEAD_BITS, default=QuantRecipe.lm_head_bits)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--draft-method", choices=QUANT_METHODS, default=None, help="the draft's, if not --method")
    parser.add_argument("--draft-block-size", type=int, default=None, help="the draft's, if not --block-size")
    parser.add_argument("--accuracy-level", type=int, default=4)
    args = parser.parse_args()
    manifest = Manifest.read(args.bundle)
    if any(spec.quant != "none" or spec.graph != "fused" for spec in manifest.models().values()):
        print("quant_variant: error: give a float32 bundle in the fused form (specdec-export --quant none)",
              file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"quant_variant: error: {args.out} exists", file=sys.stderr)
        return 2
    roles = ("target", "draft") if args.role == "both" else (args.role,)
    recipes = {"target": QuantRecipe(args.method, args.lm_head_bits),  # a draft without float scales, as exported
               "draft": QuantRecipe(args.draft_method or args.method, args.lm_head_bits, float_scales=False)}
    blocks = {"target": args.block_size, "draft": args.draft_block_size or args.block_size}
    uses_gguf = any(recipes[role].method.startswith("gguf") for role in roles)
    ggufs = dict(zip(("target", "draft"), gguf_from_manifest(str(args.bundle)))) if uses_gguf else {}
    staging = args.out.with_name(f".{args.out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    # copies, not hard links: onnx refuses to load external data that has several links (a later variant of the
    # same float bundle would fail), and the float bundle stays the only owner of its files
    quantized = {Path(spec.onnx_file).parts[0] for role, spec in manifest.models().items() if role in roles}
    shutil.copytree(args.bundle, staging, ignore=lambda folder, names: quantized if Path(folder) == args.bundle else [])
    specs = {}
    for role, spec in manifest.models().items():
        if role not in roles:
            continue
        started = time.monotonic()
        recipe = recipes[role]
        carried = quantize_onnx(args.bundle / spec.onnx_file, staging / spec.onnx_file, "int4", args.accuracy_level,
                                isolated=False, block_size=blocks[role], recipe=recipe,
                                gguf_path=ggufs.get(role) and Path(ggufs[role]))
        specs[role] = replace(spec, quant="int4")
        print(f"{role}: {recipe.method}, lm_head {recipe.lm_head_bits}-bit, block {blocks[role]}: "
              f"{time.monotonic() - started:.0f} s {carried or ''}", file=sys.stderr)
    new = replace(manifest, **specs, files=hash_tree(staging),
                  extra={**manifest.extra, "quant_variant": {role: {**recipes[role].to_dict(), "block_size": blocks[role]}
                                                             for role in roles}})
    (staging / MANIFEST_NAME).write_text(new.to_json())
    staging.rename(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
