"""Where a model's KV cache lives: host memory (numpy) or device memory (CUDA), one allocation each.

Layout ``[layers, 2 (key, value), batch=1, max_context, kv_heads, head_dim]``, so the rows of
slots [a, b) of one layer's keys are one contiguous byte range: the runtime binds pointers
into the cache (past = a prefix, new rows = the range after it) and nothing is copied.

Every host cache is allocated by ``cache_zeros``: pages the OS backs only when written, 4 KiB at a time;
``release_pages`` gives them all back (after the load's and the calibration's passes over random rows).
"""

from __future__ import annotations

import mmap

import numpy as np


def cache_zeros(shape: tuple, dtype) -> np.ndarray:
    """A zeroed array whose memory the OS backs a 4 KiB page at a time, as rows are written.

    A cache is many per-layer (per-head) regions of max_context rows, each written from its start. numpy asks
    for transparent huge pages on arrays of 4 MiB and more (Linux THP ``madvise`` or ``always``), so the first row
    written in a region brought in a whole 2 MiB page: measured on the 0.5B draft at a 32k context, 190 MiB
    resident after a one-token pass (96 regions), for a few KiB of rows. ``MADV_NOHUGEPAGE`` on an anonymous
    mapping keeps resident memory to the rows a request used. Where the platform lacks it: numpy's zeros."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype)
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_NOHUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: nothing to turn off
        pass
    return np.frombuffer(area, dtype=dtype).reshape(shape)  # the array holds the mapping (its base)


def cache_mapping(array: np.ndarray) -> mmap.mmap | None:
    """The anonymous mapping under a ``cache_zeros`` array (or a view of one); None for any other array."""
    holder = array
    while isinstance(holder, np.ndarray):
        holder = holder.base
    holder = holder.obj if isinstance(holder, memoryview) else holder
    return holder if isinstance(holder, mmap.mmap) else None


def release_pages(array: np.ndarray) -> bool:
    """Give the pages of a ``cache_zeros`` array back to the OS: they read as zeros again, as a fresh cache's, and
    are backed again only where rows are written. False (nothing done) for an array not made by ``cache_zeros``."""
    area = cache_mapping(array)
    if area is None or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    area.madvise(mmap.MADV_DONTNEED)  # a private anonymous mapping: dropped pages come back zero-filled
    return True


def release_slots(array: np.ndarray, slot_axis: int, start: int) -> int:
    """Give back the pages of slots ``start`` on of a ``cache_zeros`` array (they read as zeros again), every
    region of the axes before ``slot_axis`` (a layer's keys, a KV head's rows) alike; pages that also hold a slot
    before ``start`` stay. Returns the bytes given back (0: an array not made by ``cache_zeros``)."""
    area = cache_mapping(array)
    if area is None or not hasattr(mmap, "MADV_DONTNEED") or not array.flags.c_contiguous:
        return 0
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    base, page = root.ctypes.data, mmap.PAGESIZE
    released = 0
    for index in np.ndindex(array.shape[:slot_axis]):
        region = array[index]  # [slots, ...] contiguous
        if start >= region.shape[0]:
            continue
        low = region.ctypes.data + start * region.strides[0]
        high = region.ctypes.data + region.nbytes
        low, high = -(-low // page) * page, high // page * page
        if high > low:
            area.madvise(mmap.MADV_DONTNEED, low - base, high - low)
            released += high - low
    return released


class HostKV:
    device_type = "cpu"

    def __init__(self, layers: int, max_context: int, kv_heads: int, head_dim: int, dtype):
        self.array = cache_zeros((layers, 2, 1, max_context, kv_heads, head_dim), dtype)
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
