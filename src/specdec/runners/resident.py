"""Memory a load leaves resident and no pass reads again: given back to the OS once the sessions are made.

Two kinds, measured on the real int4 pair (1.5B target, 0.5B draft; Linux, glibc, onnxruntime 1.32):

- **Read-once pages of the bundle's weight files.** onnxruntime maps a model's external data file and reads
  every initializer a kernel packs into its own buffer at session creation. The packed weights it keeps; for
  MatMulNBits the original block scales stay mapped (about 0.2 of a byte per weight: 194 MiB of the target's
  float32 scales and 59 MiB of the draft's) and resident, although the kernels compute from their packed copy.
  ``release_read_once_pages`` drops the resident pages of every mapping of a file inside the bundle that holds
  no page the process wrote (a write to a private file mapping makes an anonymous copy of the page, so
  ``Anonymous`` 0; ``Private_Dirty`` also counts file pages not yet written back to disk, which are the file's
  own bytes): a later read, if any, brings the same bytes back from the file, so no output can change. Linux
  only (``/proc/self/smaps``, ``madvise``).
- **Free heap.** A load's temporaries (the check passes' buffers, the graph's unpacked copies) leave free blocks
  inside glibc's heap that it keeps (90 MiB after loading the pair). ``trim_heap`` is glibc's ``malloc_trim``.

Measured effect (2-core Xeon, 32,768-token context, a 26,697-token prompt served): see docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def file_mappings(smaps_text: str) -> list:
    """(start, end, path, resident kB, private dirty kB, anonymous kB) of each mapping in a smaps text."""
    mappings, current = [], None
    for line in smaps_text.splitlines():
        head = _MAPPING.match(line)
        if head:
            current = [int(head.group(1), 16), int(head.group(2), 16), head.group(3).strip(), 0, 0, 0]
            mappings.append(current)
            continue
        if current is None:
            continue
        for index, field in ((3, "Rss:"), (4, "Private_Dirty:"), (5, "Anonymous:")):
            if line.startswith(field):
                current[index] = int(line.split()[1])
    return [tuple(mapping) for mapping in mappings]


def release_read_once_pages(root: str | Path) -> int:
    """Drop the resident pages of mappings of files under ``root`` that hold no page this process wrote; returns
    the bytes released (0 where the platform lacks /proc/self/smaps or madvise)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise") or not os.path.exists("/proc/self/smaps"):
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    inside = str(Path(root).resolve()) + os.sep
    with open("/proc/self/smaps") as smaps:
        mappings = file_mappings(smaps.read())
    released = 0
    for start, end, path, resident, _dirty, anonymous in mappings:
        if not path.startswith(inside) or resident == 0 or anonymous:
            continue
        if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += resident * 1024
        else:
            log.debug("madvise(%s) failed: errno %d", path, ctypes.get_errno())
    return released


def trim_heap() -> bool:
    """Give glibc's free heap pages back to the OS (``malloc_trim(0)``); False where there is no such call."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


def release_after_load(root: str | Path) -> None:
    """Both of the above, once a bundle's sessions are made and checked (before any request runs)."""
    released = release_read_once_pages(root)
    trimmed = trim_heap()
    log.info("after load: %d MiB of weight-file pages no pass reads released%s", released >> 20,
             "; free heap trimmed" if trimmed else "")
