"""Bytes of weights a one-token pass of a bundle's model streams, as onnxruntime's CPU kernels hold them once packed.

    python tools/measure/pass_bytes.py BUNDLE [--role target] [--gguf FILE]

Per weight form of the model (``ModelSpec.weight_forms``, else its one graph): every initializer a pass reads whole,
the embedding table excepted (a pass gathers one row of it). MatMulNBits at accuracy level 4 packs, per block of
``block_size`` weights, the codes (4 or 8 bits), a float32 scale and a float32 block sum (MLAS ``SQNBitGemm`` int8
compute; zero points fold into the block sum): ``block_size * bits / 8 + 8`` bytes. Other initializers count their own bytes
(MatMulInteger's int8 weights and their scales, norms, biases). ``--gguf``: the same figure for llama.cpp on the GGUF
(every tensor's bytes but the token embedding's), for the bits-per-weight comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper  # noqa: F401  (onnx's dtype table below)

from specdec.contract.bundle import inside
from specdec.contract.manifest import Manifest


def _bytes(tensor) -> int:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(dtype).itemsize


def pass_bytes(onnx_path: Path) -> dict:
    """{"streamed": bytes a one-token pass reads, "weights": MatMul weights counted, "gathered": skipped tables}."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    sizes = {init.name: _bytes(init) for init in model.graph.initializer}
    streamed, counted, gathered, weights = 0, set(), 0, 0
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            k, n, block, bits = attrs["K"], attrs["N"], attrs["block_size"], attrs.get("bits", 4)
            packed = n * (-(-k // block)) * (block * bits // 8 + 8)
            streamed += packed
            weights += n * k
            counted.update(node.input[1:])
        elif node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in sizes:
            gathered += sum(sizes.get(name, 0) for name in node.input if name in sizes and name not in counted)
            counted.update(name for name in node.input if name in sizes)
        elif node.op_type in ("MatMulInteger", "MatMulIntegerToFloat") and node.input[1] in sizes:
            weights += int(np.prod([d for d in next(i.dims for i in model.graph.initializer
                                                    if i.name == node.input[1])]))
    streamed += sum(size for name, size in sizes.items() if name not in counted)
    return {"streamed": streamed, "weights": weights, "gathered": gathered}


def gguf_bytes(path: Path) -> int:
    """A GGUF's tensor bytes but the token embedding's (``token_embd``), which llama.cpp gathers rows of."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if not t.name.startswith("token_embd"))


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
        counts = pass_bytes(inside(args.bundle, path))
        print(f"{args.role} {form}: {counts['streamed'] / 2**20:,.1f} MiB a one-token pass streams "
              f"({counts['gathered'] / 2**20:,.1f} MiB of gathered tables not counted)")
    if args.gguf:
        print(f"GGUF {args.gguf.name}: {gguf_bytes(args.gguf) / 2**20:,.1f} MiB (token_embd not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
