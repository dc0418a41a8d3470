"""onnxruntime's CPU provider: every graph form, the cache in host memory."""

from specdec.runners.backends import Backend

BACKEND = Backend("cpu", "onnxruntime's CPU provider", providers=("CPUExecutionProvider",), fused_form=True,
                  rank=10)
