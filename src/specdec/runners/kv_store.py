"""Where a model's KV cache lives: host memory (numpy) or device memory (CUDA), one allocation each.

Layout ``[layers, 2 (key, value), batch=1, max_context, kv_heads, head_dim]``, so the rows of
slots [a, b) of one layer's keys are one contiguous byte range: the runtime binds pointers
into the cache (past = a prefix, new rows = the range after it) and nothing is copied.
"""

from __future__ import annotations

import numpy as np


class HostKV:
    device_type = "cpu"

    def __init__(self, layers: int, max_context: int, kv_heads: int, head_dim: int, dtype):
        self.array = np.zeros((layers, 2, 1, max_context, kv_heads, head_dim), dtype=dtype)
        self.row_bytes = kv_heads * head_dim * self.array.itemsize
        self.base = self.array.ctypes.data
        self.max_context = max_context

    def pointer(self, layer: int, kind: int, slot: int) -> int:
        return self.base + ((layer * 2 + kind) * self.max_context + slot) * self.row_bytes

    def move_rows(self, sources, first_slot: int) -> None:
        for offset, slot in enumerate(sources):
            if slot != first_slot + offset:
                self.array[:, :, :, first_slot + offset] = self.array[:, :, :, slot]


class DeviceKV:
    """The same layout in one CUDA allocation (cuda-python); rows move device to device."""

    device_type = "cuda"

    def __init__(self, layers: int, max_context: int, kv_heads: int, head_dim: int, dtype, stream: int = 0):
        from specdec.runners.cuda_memory import DeviceBuffer

        self.layers = layers
        self.max_context = max_context
        self.row_bytes = kv_heads * head_dim * np.dtype(dtype).itemsize
        self.buffer = DeviceBuffer(layers * 2 * max_context * self.row_bytes)
        self.base = self.buffer.ptr
        self.stream = stream

    def pointer(self, layer: int, kind: int, slot: int) -> int:
        return self.base + ((layer * 2 + kind) * self.max_context + slot) * self.row_bytes

    def move_rows(self, sources, first_slot: int) -> None:
        for offset, slot in enumerate(sources):
            target = first_slot + offset
            if slot == target:
                continue
            for plane in range(self.layers * 2):
                start = plane * self.max_context * self.row_bytes
                self.buffer.copy_within(start + target * self.row_bytes, start + slot * self.row_bytes,
                                        self.row_bytes, self.stream)
