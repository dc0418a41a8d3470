"""Perplexity of a float-KV bundle with its cache rows quantized to int8 after each pass: which int8 layout to build.

    python tools/measure/kv_quant_emulate.py BUNDLE --text eval.txt [--role target] [--context 512] [--chunks 3]
        [--segment 16] [--configs none,kv,kv@32,k,v,kv~1] [--calibration long.txt]

After every committed pass the new rows of the cache are quantized and read back in place (symmetric int8, scale
max|x| / 127), so later passes attend to int8 rows; rows inside one pass are still read as computed (short
``--segment`` passes come closer to a cache that quantizes before attending). A config names what is quantized:
``none``, ``k``, ``v`` or ``kv``; ``@B`` a scale per block of B values instead of per row (llama.cpp's q8_0: 32);
``~A`` keys smoothed before quantizing (divided by each channel's largest magnitude over the first 512 tokens (at most
``--context``) of ``--calibration``, to the power A, and multiplied back). Prints one JSON line per config.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specdec.bench.perplexity import perplexity_of, tokenize_like_llama
from specdec.contract.bundle import inside, open_bundle
from specdec.runners import kv_int8
from specdec.runners.factory import make_runner


def read_back(rows: np.ndarray, block: int) -> np.ndarray:
    """rows [..., D] float32 -> the same rows quantized to int8 (per row, or per ``block`` values) and read back, by
    the int8 cache's own rule (runners/kv_int8.py) applied to rows or to blocks."""
    shape = rows.shape
    values = rows.reshape(shape[:-1] + (shape[-1] // block, block)) if block else rows
    return kv_int8.dequantize_rows(*kv_int8.quantize_rows(values)).reshape(shape)


class QuantizedRows:
    """A runner whose committed rows are quantized in place (``kinds``: 0 keys, 1 values)."""

    def __init__(self, runner, kinds, block, smoothing):
        self.runner, self.kinds, self.block, self.smoothing = runner, kinds, block, smoothing
        self.max_context, self.max_step_tokens = runner.max_context, runner.max_step_tokens

    def reset(self):
        self.runner.reset()

    def forward(self, *args, **kwargs):
        return self.runner.forward(*args, **kwargs)

    def commit(self, count):
        start = self.runner.length
        self.runner.commit(count)
        cache = self.runner.cache  # [layers, 2, 1, kv_heads, slots, D]
        for kind in self.kinds:
            rows = cache[:, kind, :, :, start:start + count].astype(np.float32)
            if kind == 0 and self.smoothing is not None:
                rows = read_back(rows / self.smoothing, self.block) * self.smoothing
            else:
                rows = read_back(rows, self.block)
            cache[:, kind, :, :, start:start + count] = rows.astype(cache.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--text", required=True, type=Path)
    parser.add_argument("--role", default="target", choices=["target", "draft"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--segment", type=int, default=16)
    parser.add_argument("--configs", default="none,kv,kv@32")
    parser.add_argument("--calibration", type=Path, help="text whose first 512 tokens set the key smoothing (~A)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    manifest = open_bundle(args.bundle, verify=False)
    spec = manifest.models()[args.role]
    if spec.kv_dtype not in ("float32", "float16"):
        parser.error(f"the {args.role}'s cache is {spec.kv_dtype}: the emulation quantizes a float cache")
    tokenizer = Tokenizer.from_file(str(inside(args.bundle, manifest.tokenizer_file)))
    ids, add_bos = tokenize_like_llama(tokenizer, args.text.read_text(), spec.bos_token_id)
    runner = make_runner(str(inside(args.bundle, spec.onnx_file)), spec, "cpu", args.context, args.segment, args.threads)
    for config in args.configs.split(","):
        what, _, alpha = config.partition("~")
        what, _, block = what.partition("@")
        smoothing = None
        if alpha:
            if args.calibration is None:
                parser.error(f"{config} needs --calibration")
            calibration, _ = tokenize_like_llama(tokenizer, args.calibration.read_text(), spec.bos_token_id)
            runner.reset()
            length = min(512, args.context) // args.segment * args.segment
            for start in range(0, length, args.segment):
                runner.forward(np.array(calibration[start:start + args.segment]), np.arange(start, start + args.segment))
                runner.commit(args.segment)
            keys = runner.cache[:, 0, :, :, :length].astype(np.float32)
            runner.reset()
            smoothing = np.maximum(np.abs(keys).max(-2, keepdims=True), 1e-6) ** float(alpha)
        kinds = {"none": (), "k": (0,), "v": (1,), "kv": (0, 1)}[what]
        result = perplexity_of(QuantizedRows(runner, kinds, int(block or 0), smoothing), ids, args.role, add_bos,
                               spec.bos_token_id, args.context, args.chunks, args.segment)
        print(json.dumps({"config": config, "role": args.role, "perplexity": result.perplexity, "chunks": args.chunks,
                          "segment": args.segment}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
