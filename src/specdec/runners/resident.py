"""Memory a load leaves resident and no pass reads again: reclaimed once the sessions are made.

Three kinds, measured on the real int4 pair (1.5B target, 0.5B draft; Linux, glibc, onnxruntime 1.32):

- **Read-once pages of the bundle's weight files.** onnxruntime maps a model's external data file and reads
  every initializer a kernel packs into its own buffer at session creation. The packed weights it keeps; for
  MatMulNBits the original block scales stay mapped (a float32 per 32 weights: 194 MiB of the target's
  float32 scales and 59 MiB of the draft's) and resident, although the kernels compute from their packed copy.
  ``release_read_once_pages`` asks the kernel to reclaim the resident pages of every mapping of a file inside the
  bundle (``madvise(MADV_PAGEOUT)``, Linux 5.4+): clean file pages are dropped (a later read, if any, brings the
  file's bytes back), and a page the process wrote is never discarded (the kernel swaps it out or keeps it), so
  no output can change, even if a mapping went away and its addresses were reused after ``/proc/self/smaps`` was
  read. Mappings holding written pages (``Anonymous`` or ``Swap`` not 0) are skipped anyway: nothing to gain.
  Where ``MADV_PAGEOUT`` is refused (older kernels; files the process may not write) nothing is released.
  Linux only (``/proc/self/smaps``, ``madvise``).
- **Pages around each row a pass gathers.** The embedding's table (GatherBlockQuantized: 4-bit rows and their
  corrections, 167 MiB in the 1.5B target) stays mapped, and a prompt reads one row per token. A fault on a mapped
  file maps up to 64 KiB of the neighbouring pages the page cache holds (Linux's fault-around), and a fault that
  reads the disk reads 128 KiB around the page: one gathered row costs the process 16-32 pages. Measured on the
  real target, a 7,419-token prompt left 105 MiB of the table resident (8 MiB with the reads below).
  ``read_rows_singly`` marks every large mapping of a bundle file ``MADV_RANDOM`` (no read-around) and drops the page
  cache's copy of those mappings' byte ranges (``posix_fadvise(POSIX_FADV_DONTNEED)``: a later read comes from the
  disk), so the table's resident pages follow the rows read. Both are hints: no byte changes. The rest of the files
  (the weights onnxruntime packed into its own buffers) stays in the page cache, which no process's resident
  memory counts: the next load packs them from memory, not from the disk (the 1.5B int8-rows target's session in
  1.75 s instead of 3.0-3.3 s after its file's pages were dropped; 2-core Xeon, onnxruntime 1.32).
- **Free heap.** A load's temporaries (the check passes' buffers, the graph's unpacked copies) leave free blocks
  inside glibc's heap that it keeps (90 MiB after loading the pair). ``trim_heap`` is glibc's ``malloc_trim``.

Measured effect (2-core Xeon, 32,768-token context, a 26,697-token prompt served): see docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from specdec.runners.mapped_weights import mapped_ranges, read_singly, release_mapped
from specdec.runners.proc_maps import libc, madvise, with_libc

log = logging.getLogger(__name__)

# mappings at least this big fault single pages: the tables a pass gathers rows of (the 1.5B target's embedding: 111
# and 2 x 28 MiB). Smaller ones (norms, scales: read whole by every pass) keep read-around, so their first read after
# the dropped page cache costs a few reads, not one per page (measured: a first 7k-token prefill 1.04x slower)
SPARSE_MAPPING_BYTES = 2**20
_MADV_PAGEOUT = 21


def _bundle_mappings(root: str | Path):
    """(``madvise(address, length, advice)``, the ``Mapping`` records of files under ``root`` that onnxruntime mapped),
    or None where the platform lacks /proc/self/smaps or madvise. The mappings specdec made itself (mapped_weights.py)
    are left out: their owner releases them."""
    found = with_libc("madvise")
    if found is None:
        return None
    _, mappings = found
    inside = str(Path(root).resolve()) + os.sep
    own = mapped_ranges()
    return madvise(), [mapping for mapping in mappings if mapping.path.startswith(inside)
                               and not any(start < mapping.end and mapping.start < end for start, end in own)]


def release_read_once_pages(root: str | Path) -> int:
    """Reclaim the resident pages of mappings of files under ``root`` that hold no page this process wrote; returns
    the bytes the kernel accepted to reclaim (0 where the platform lacks /proc/self/smaps or MADV_PAGEOUT)."""
    found = _bundle_mappings(root)
    if found is None:
        return 0
    advise, mappings = found
    released = 0
    for mapping in mappings:
        if mapping.rss_kb == 0 or mapping.anonymous_kb or mapping.swap_kb:
            continue
        if advise(mapping.start, mapping.end - mapping.start, _MADV_PAGEOUT) == 0:
            released += mapping.rss_kb * 1024
        else:
            log.debug("madvise(%s, MADV_PAGEOUT) refused: errno %d", mapping.path, ctypes.get_errno())
            return released  # the kernel or the file's permissions refuse it: so will the rest
    return released


def read_rows_singly(root: str | Path) -> int:
    """Make later reads of the bundle's mapped tables fault single pages (no read-around, no cached neighbours to
    map around them): ``MADV_RANDOM`` on each mapping of a file under ``root`` of SPARSE_MAPPING_BYTES or more,
    then the page cache's unmapped copies of those mappings' byte ranges dropped (the rest of the file stays cached
    for the next load). Returns the number of files (0 where the platform lacks either call)."""
    found = _bundle_mappings(root) if hasattr(os, "posix_fadvise") else None
    if found is None:
        return 0
    advise, mappings = found
    # a table a pass gathers rows of; a small tensor is read whole
    sparse = [(m.start, m.end - m.start, m.path, m.offset) for m in mappings if m.end - m.start >= SPARSE_MAPPING_BYTES]
    read_singly(advise, sparse)
    return len({path for _, _, path, _ in sparse})


def trim_heap() -> bool:
    """Give glibc's free heap pages back to the OS (``malloc_trim(0)``); False where there is no such call."""
    c_library = libc()
    if c_library is None or not hasattr(c_library, "malloc_trim"):
        return False
    return bool(c_library.malloc_trim(0))


def release_after_load(root: str | Path) -> None:
    """All of the above, once a bundle's sessions are made and checked (before any request runs), and the same for the
    weight files specdec mapped itself (mapped_weights.py)."""
    own_files, own_tables = release_mapped(root)
    released = release_read_once_pages(root)
    singly = read_rows_singly(root) + own_tables
    trimmed = trim_heap()
    log.info("after load: %d MiB of weight-file pages no pass reads released%s%s%s", released >> 20,
             f"; the pages of {own_files} weight files specdec maps dropped" if own_files else "",
             f"; later reads of {singly} mapped files or tables fault single pages" if singly else "",
             "; free heap trimmed" if trimmed else "")
