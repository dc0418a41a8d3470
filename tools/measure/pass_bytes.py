"""Bytes of weights a one-token pass of a bundle's model streams, as onnxruntime's CPU kernels hold them once packed.

    python tools/measure/pass_bytes.py BUNDLE [--role target] [--gguf FILE]

Per weight form of the model (``ModelSpec.weight_forms``, else its one graph): ``contract.onnx_paths.one_token_bytes``
(MatMulNBits as MLAS packs it at accuracy level 4: per block of ``block_size`` weights the codes, a float32 scale and
a float32 block sum; every other initializer its own bytes; the tables a pass gathers one row of apart). ``--gguf``:
the same figure for llama.cpp on the GGUF (``bench.weights_read.gguf_bytes``: every tensor's bytes but the token
embedding's), for the bits-per-weight comparison. ``specdec bench`` reports both beside the decode rates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.bench.weights_read import gguf_bytes
from specdec.contract.bundle import inside
from specdec.contract.manifest import Manifest
from specdec.contract.onnx_paths import one_token_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", default="target", choices=["target", "draft"])
    parser.add_argument("--gguf", type=Path, default=None)
    args = parser.parse_args()
    manifest = Manifest.read(args.bundle)
    spec = manifest.models()[args.role]
    for form, path in spec.weight_forms or ((manifest.extra.get("quant_recipe", {}).get("layer_products", "-"),
                                             spec.onnx_file),):
        counts = one_token_bytes(inside(args.bundle, path).read_bytes())
        print(f"{args.role} {form}: {counts['streamed'] / 2**20:,.1f} MiB a one-token pass streams "
              f"({counts['gathered'] / 2**20:,.1f} MiB of gathered tables not counted)")
    if args.gguf:
        size = gguf_bytes(args.gguf)
        print(f"GGUF {args.gguf.name}: " + (f"{size / 2**20:,.1f} MiB (token_embd not counted)" if size is not None
                                             else "needs the gguf package (the [export] extra)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
