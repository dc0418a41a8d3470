"""TensorRT engines that ``specdec-export --engine tensorrt`` built and verified for this device
(runners/tensorrt/): no onnxruntime session, the engines' own runners for every model of the bundle."""

from specdec.runners.backends import Backend

BACKEND = Backend("tensorrt-native", "the bundle's TensorRT engines (specdec-export --engine tensorrt)",
                  device_memory=True, bundle_runners="specdec.runners.tensorrt.runner:tensorrt_runners",
                  missing="install tensorrt and cuda-python (the [gpu] extra)", rank=40)
