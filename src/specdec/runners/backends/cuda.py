"""onnxruntime's CUDA provider: the standard graph form, the KV cache in device memory."""

from specdec.runners.backends import Backend

# The CUDA arena grows only by what is requested (no power-of-two jumps): on Jetson's unified memory the default
# strategy can take memory the CPU side needs.
CUDA = ("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})

BACKEND = Backend("cuda", "onnxruntime's CUDA provider (the [gpu] extra)", providers=(CUDA, "CPUExecutionProvider"),
                  device_memory=True, missing="install onnxruntime-gpu", rank=20)
