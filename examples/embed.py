"""Minimal embedding of specdec in an app: runtime only (numpy, onnxruntime, tokenizers)."""

import sys

from specdec import SamplingConfig, SpeculativeDecoder

decoder = SpeculativeDecoder.load(sys.argv[1], provider="cpu")
result = decoder.generate("def fibonacci(n):", max_new_tokens=64,
                          sampling=SamplingConfig(temperature=0.0), num_draft_tokens=4)
print(result.text)
print(f"{result.stats.tokens_per_s:.1f} tok/s, acceptance {result.stats.acceptance_rate:.2f}")
