"""Side-by-side benchmarks: modes interleaved per prompt, peers (transformers, onnxruntime-genai), reports.
Imports ``decoding`` and below.
"""
