"""onnxruntime's TensorRT provider (CUDA for the nodes TensorRT does not take): the standard graph form."""

from specdec.runners.backends import Backend
from specdec.runners.backends.cuda import CUDA

BACKEND = Backend("tensorrt", "onnxruntime's TensorRT provider (the [gpu] extra and TensorRT)",
                  providers=(("TensorrtExecutionProvider", {"trt_max_workspace_size": 1 << 30}), CUDA,
                             "CPUExecutionProvider"),
                  device_memory=True, missing="install onnxruntime-gpu (and TensorRT)", rank=30)
