"""Device memory and streams through cuda-python: NVIDIA's own thin binding of the CUDA runtime.

Chosen over CuPy or PyTorch because it is a small wheel with no array library of its own, it
exists for Jetson (aarch64) as well as x86_64, and it exposes exactly what the runtime needs:
malloc/free, async copies and streams. Imported lazily; only GPU paths use it.
"""

from __future__ import annotations

import numpy as np


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise ValueError("cuda-python is not installed: pip install cuda-python") from None
    return cudart


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


class DeviceBuffer:
    """One device allocation; offsets in bytes."""

    def __init__(self, nbytes: int):
        self.cudart = _cudart()
        self.nbytes = nbytes
        self.ptr = int(_check(self.cudart.cudaMalloc(max(nbytes, 1))))

    def upload(self, offset: int, array: np.ndarray, stream=0) -> None:
        array = np.ascontiguousarray(array)
        _check(self.cudart.cudaMemcpyAsync(self.ptr + offset, array.ctypes.data, array.nbytes,
                                           self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))

    def download(self, offset: int, out: np.ndarray, stream=0) -> None:
        _check(self.cudart.cudaMemcpyAsync(out.ctypes.data, self.ptr + offset, out.nbytes,
                                           self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))
        _check(self.cudart.cudaStreamSynchronize(stream))

    def copy_within(self, dst: int, src: int, nbytes: int, stream=0) -> None:
        _check(self.cudart.cudaMemcpyAsync(self.ptr + dst, self.ptr + src, nbytes,
                                           self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream))

    def free(self) -> None:
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


def new_stream() -> int:
    cudart = _cudart()
    return int(_check(cudart.cudaStreamCreate()))


def synchronize(stream: int) -> None:
    _check(_cudart().cudaStreamSynchronize(stream))


def free_device_memory() -> int:
    free, _total = _check(_cudart().cudaMemGetInfo())
    return int(free)
