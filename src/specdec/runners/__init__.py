"""One model pass into a preallocated KV cache: the runner protocol and its KV bookkeeping, the standard and
fused onnxruntime runners, masks, memory budgets, TensorRT (``runners.tensorrt``). Imports ``contract``.
"""
