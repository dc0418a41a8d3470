"""NVIDIA backends: TensorRT engines built from a bundle's ONNX, device-resident KV caches, memory budgets.

Everything that can be checked without a GPU (profiles, engine records, refusal of unknown
or mismatched engines, backend selection, memory budgets) is pure Python and tested on CPU.
The GPU paths import ``tensorrt`` and ``cuda`` (cuda-python) lazily and only run on a machine
that has them (``tools/check/gpu_check.py``). The ``tensorrt-native`` backend (runners/backends/tensorrt_native.py)
names ``runner.tensorrt_runners``, imported when that provider is asked for.
"""
