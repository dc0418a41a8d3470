"""Side-by-side benchmarks: modes interleaved per prompt, peers (transformers, onnxruntime-genai, llama.cpp's
llama-server), session traces replayed over HTTP, reports. Imports ``decoding`` and below (servers: subprocesses).
"""
