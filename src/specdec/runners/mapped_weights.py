"""A model's weight file mapped by specdec and handed to onnxruntime tensor by tensor, so a load's peak memory is the
packed weights, not the packed weights and the whole file.

onnxruntime maps a model's external-data file and keeps each initializer mapped until the session is made. Packing
reads every weight, so at the end of a session's creation the whole file is resident beside the packed copies,
then let go at once. Measured (2-core Zen 5, onnxruntime 1.32, the real 1.5B target's int8-rows form, 1.6 GB file):
2,946 MiB resident at the peak against 1,576 MiB once the session is made; the process's high-water mark is what
a user's memory monitor (and ``specdec bench``'s peak RSS) shows.

Here the process maps each data file itself (read-only, shared), gives onnxruntime every external initializer of
the top graph of 1 MiB or more as an ``OrtValue`` over the mapping (``SessionOptions.add_initializer``: onnxruntime
reads it in place, never copies it), and while the session is made a thread drops the mapped pages every
``DROP_SECONDS`` (``madvise(MADV_DONTNEED)``). A page read again afterwards faults the same bytes back from the
page cache, so no byte onnxruntime reads can change: the mapping is read-only (nothing can have written a page)
and is the process's own for the session's whole life (its addresses cannot be reused by another mapping
meanwhile, which is why this is not done to onnxruntime's own mappings). The file's pages stay in the page cache
for the next load.

After the load (``release_after_load``) every mapped page is dropped again, and the tables a pass gathers rows of
(the embedding: initializers a Gather / GatherBlockQuantized node reads) fault single pages (``MADV_RANDOM``, their
file range's cached copy dropped), as ``runners/resident.py`` does for onnxruntime's own mappings.

CPU sessions only (a GPU provider copies the weights to the device anyway). Off with ``SPECDEC_MAP_WEIGHTS=0``;
tensors under ``MAPPED_MIN_BYTES`` and of a type numpy has no array for (none in a specdec bundle) are left to
onnxruntime.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from specdec.contract.onnx_paths import external_tensors
from specdec.runners.proc_maps import PAGE, madvise

log = logging.getLogger(__name__)

DROP_SECONDS = 0.02  # how often pages are dropped while a session is made (~40 MB read between drops here)
# smaller tensors (norms, biases, scales: read by every pass) are left to onnxruntime, which reads them onto its heap:
# over the file mapping, each on pages of its own, a one-token pass ran 1-6% slower (the weights read are the same)
MAPPED_MIN_BYTES = 2**20
_MADV_RANDOM, _MADV_DONTNEED = 1, 4
# TensorProto.DataType -> numpy (the types an initializer can be mapped as)
_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
          10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every MappedWeights still referenced (release_after_load walks them)


def enabled() -> bool:
    return os.environ.get("SPECDEC_MAP_WEIGHTS", "1") != "0"


def read_singly(advise, pieces: list) -> None:
    """Make later reads of mapped file ranges fault single pages: ``MADV_RANDOM`` on each piece's addresses (no
    read-around; a hint, harmless on whatever the range holds now) and the page cache's unmapped copy of its file
    range dropped (no cached neighbours to map around a fault). ``advise``: ``proc_maps.madvise()``; ``pieces``:
    (address, length, file path, file offset) each."""
    by_file: dict = {}
    for address, length, path, offset in pieces:
        start = address - address % PAGE
        advise(start, address + length - start, _MADV_RANDOM)
        by_file.setdefault(path, []).append((offset, length))
    for path in sorted(by_file):
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:  # the file went away: the mapping keeps its pages, nothing to drop
            continue
        try:
            for offset, length in by_file[path]:
                os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_DONTNEED)  # mapped pages are never dropped
        finally:
            os.close(descriptor)


class MappedWeights:
    """The external initializers of one ONNX model over the process's own read-only mappings of its data files.

    Keep it referenced as long as the session made from it (``attach``): onnxruntime reads the mapping in place."""

    def __init__(self, onnx_path: str | Path):
        folder = Path(onnx_path).parent
        tensors, gathered = external_tensors(Path(onnx_path).read_bytes())
        self.files: dict = {}  # path -> np.memmap of the whole file (uint8)
        self.arrays: dict = {}  # initializer name -> its array (a view of the mapping)
        self.gathered: list = []  # (path, offset, length) of the tables passes gather rows of
        for tensor in tensors:
            dtype = _NUMPY.get(tensor.data_type)
            if dtype is None or tensor.length < MAPPED_MIN_BYTES:
                continue
            path = str(folder / tensor.location)
            if path not in self.files:
                self.files[path] = np.memmap(path, dtype=np.uint8, mode="r")
            mapping = self.files[path]
            elements = int(np.prod(tensor.dims, dtype=np.int64))
            if tensor.offset + tensor.length > mapping.size or tensor.length != elements * np.dtype(dtype).itemsize:
                raise ValueError(f"{onnx_path}: initializer {tensor.name} does not fit its data file")
            view = mapping[tensor.offset: tensor.offset + tensor.length]
            self.arrays[tensor.name] = view.view(dtype).reshape(tensor.dims)
            if tensor.name in gathered:
                self.gathered.append((path, tensor.offset, tensor.length))
        _LIVE.add(self)

    def add_to(self, options) -> None:
        """Give onnxruntime each mapped tensor in place of reading it from the file."""
        import onnxruntime as ort

        self._values = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.arrays.values()]
        for name, value in zip(self.arrays, self._values):
            options.add_initializer(name, value)

    def drop_pages(self) -> int:
        """Unmap every resident page of the mappings (the bytes stay in the file and the page cache); returns the
        number of mappings the kernel accepted (0 where madvise is missing)."""
        advise = madvise()
        if advise is None:
            return 0
        done = 0
        for mapping in self.files.values():
            if mapping.size == 0:
                continue
            address = mapping.ctypes.data
            start = address - address % PAGE
            done += advise(start, address + mapping.size - start, _MADV_DONTNEED) == 0
        return done

    def make_session(self, make):
        """``make()`` (the onnxruntime session over these tensors) while a thread drops the pages it has read."""
        stop = threading.Event()

        def drop_while_packing():
            while not stop.wait(DROP_SECONDS):
                self.drop_pages()

        dropper = threading.Thread(target=drop_while_packing, name="specdec-drop-weight-pages", daemon=True)
        dropper.start()
        try:
            session = make()
        finally:
            stop.set()
            dropper.join()
            self.drop_pages()
        session.specdec_mapped_weights = self  # the mapping lives as long as the session that reads it
        return session

    def read_rows_singly(self) -> int:
        """The gathered tables fault single pages: ``MADV_RANDOM`` on their ranges and their file ranges' cached
        copies dropped (a gathered row then costs its own pages, not 64-128 KiB around it). Returns the tables."""
        advise = madvise()
        if advise is None or not hasattr(os, "posix_fadvise"):
            return 0
        read_singly(advise, [(self.files[path].ctypes.data + offset, length, path, offset)
                             for path, offset, length in self.gathered])
        return len(self.gathered)


def mapped_ranges() -> list:
    """[start, end) addresses of every live MappedWeights mapping (runners/resident.py leaves them to their owner)."""
    ranges = []
    for weights in list(_LIVE):
        for mapping in weights.files.values():
            if mapping.size:
                ranges.append((mapping.ctypes.data, mapping.ctypes.data + mapping.size))
    return ranges


def release_mapped(root: str | Path) -> tuple[int, int]:
    """After a load: every live mapping of a file under ``root`` drops its pages and reads its gathered tables
    singly. Returns (mappings dropped, gathered tables)."""
    inside = str(Path(root).resolve()) + os.sep
    dropped = tables = 0
    for weights in list(_LIVE):
        if any(str(Path(path).resolve()).startswith(inside) for path in weights.files):
            dropped += weights.drop_pages()
            tables += weights.read_rows_singly()
    return dropped, tables
