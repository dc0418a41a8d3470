"""The packed weights on 2 MiB pages: a pass that streams them misses the TLB 512 times less often.

onnxruntime packs a model's weights into buffers it allocates through the C library's malloc, and where the
system's transparent huge pages are ``madvise`` (most distributions' default) those buffers sit on 4 KiB pages: a
one-token pass of the 1.5B target streams 1.2-1.4 GiB, about 330,000 pages, every pass. Measured on the real pair
(2-core AMD Zen 5, onnxruntime 1.32, two runners of one model in one process, alternated; results
2026-12-07-huge-pages-zen5): the runner a process makes first (the target, in a load) ran its one-token passes 2-8%
slower than a second one, whose buffers reuse memory the first load freed; with its memory on 2 MiB pages the
first ran 4-8% faster than that second one: 6-13% faster than as it was.

Once a load's sessions are made, ``collapse_resident`` asks the kernel to back every 2 MiB range of the process's
private anonymous memory whose pages are all resident with one huge page (``madvise(MADV_COLLAPSE)``, Linux 6.1+).
The bytes do not change, and neither does resident memory: a range with a page not resident (a KV cache's unused
rows, freed heap) is left as it is, so nothing is backed that was not. The copy takes one core 0.2 s (the draft)
to 6 s (the pair, while the kernel compacts free memory), so the load hands it to a thread of the lowest priority
(``collapse_in_background``) and returns; the thread waits while a request runs (``requests_running``), and a
measurement of pass costs waits for it first (``settle``). (A huge
page is the kernel's PMD size: 2 MiB on x86-64 and on 4 KiB-page ARM kernels such as Jetson's.)

Nothing happens where the platform has no ``/proc/self/smaps`` or ``madvise``, where transparent huge pages are
``never``, where the kernel refuses ``MADV_COLLAPSE`` (before 6.1), or with ``SPECDEC_HUGE_PAGES=0`` in the
environment. A later free inside a huge page (a session closed, the heap trimmed) splits it again: the kernel's
business, and correct either way.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from contextlib import contextmanager

import numpy as np

from specdec.runners.proc_maps import PAGE as _PAGE
from specdec.runners.proc_maps import Mapping, madvise, with_libc

log = logging.getLogger(__name__)



def _pmd_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as size:
            return int(size.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _pmd_size()
_MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def anonymous_mappings(mappings: list) -> list:
    """(start, end) of each private, writable, anonymous ``Mapping`` (the heap included; the stack, files, shared
    memory and mappings marked ``MADV_NOHUGEPAGE`` not: the KV caches, kv_store.py)."""
    return [(m.start, m.end) for m in mappings if _anonymous(m) and "nh" not in m.vm_flags]


def _anonymous(mapping: Mapping) -> bool:
    return mapping.perms == "rw-p" and mapping.inode == 0 and (
        mapping.path in ("", "[heap]") or (mapping.path.startswith("[anon:") and mapping.path.endswith("]")))


def resident_runs(start: int, resident,  # resident: [pages] bool, page i of the mapping at start + i * page
                  page: int = _PAGE, huge: int = HUGE_PAGE, exclude: frozenset = frozenset()) -> list:
    """(address, length) of each run of whole ``huge``-aligned ranges of a mapping at ``start`` whose pages are all
    resident (``mincore``'s answer per page) and whose address is not in ``exclude``, neighbours merged."""
    per_huge = huge // page
    first = (-start % huge) // page  # the first page on a huge boundary
    whole = (len(resident) - first) // per_huge
    if whole <= 0:
        return []
    full = np.asarray(resident[first:first + whole * per_huge], dtype=bool).reshape(whole, per_huge).all(axis=1)
    if exclude:
        full &= ~np.isin(start + first * page + np.arange(whole) * huge, list(exclude))
    runs, begin = [], None
    for index, dense in enumerate(np.append(full, False)):
        if dense and begin is None:
            begin = index
        elif not dense and begin is not None:
            runs.append((start + first * page + begin * huge, (index - begin) * huge))
            begin = None
    return runs


def enabled() -> bool:
    """Whether loads move packed weights to 2 MiB pages here (Linux with transparent huge pages, not switched off)."""
    if os.environ.get("SPECDEC_HUGE_PAGES", "1").strip() in ("0", "false", "no", "off"):
        return False
    try:
        with open(_THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:  # not Linux, or no transparent huge pages at all
        return False


def _resident_mappings(c_library, mappings: list):
    """(start, [pages] resident flags) of each piece (64 huge pages at most) of the anonymous ``mappings``."""
    c_library.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    step = 64 * HUGE_PAGE  # asked about in pieces: a byte per page of GiBs would be a buffer of MiBs
    for start, end in anonymous_mappings(mappings):
        edges = [start, *range((start // step + 1) * step, end, step), end]  # inner edges on huge boundaries
        for begin, stop in zip(edges, edges[1:]):
            length = stop - begin
            if length < HUGE_PAGE:
                continue
            vector = (ctypes.c_ubyte * (length // _PAGE))()
            if c_library.mincore(begin, length, vector) == 0:  # else the mapping went away meanwhile
                yield begin, np.frombuffer(vector, dtype=np.uint8) & 1


def resident_ranges() -> frozenset:
    """Addresses of the 2 MiB ranges of anonymous memory wholly resident now (a tool's ``exclude``: memory that
    existed before a runner was made)."""
    found = with_libc("mincore")
    if found is None:
        return frozenset()
    return frozenset(address + offset for start, resident in _resident_mappings(*found)
                     for address, length in resident_runs(start, resident) for offset in range(0, length, HUGE_PAGE))


def collapse_resident(exclude: frozenset = frozenset(), before_piece=None) -> tuple:
    """Back every wholly resident 2 MiB range of this process's anonymous memory (but the addresses in ``exclude``)
    with a huge page; returns (bytes the kernel collapsed, seconds). (0, 0.0) where it is off or unsupported.
    ``before_piece``: called before each call of at most ``PIECE`` bytes (the background thread waits there while a
    request runs)."""
    found = with_libc("madvise", "mincore") if enabled() else None
    if found is None:
        return 0, 0.0
    c_library, mappings = found
    advise = madvise()
    begin = time.perf_counter()
    collapsed, refused = 0, 0
    for start, resident in _resident_mappings(c_library, mappings):
        for run, run_length in resident_runs(start, resident, exclude=exclude):
            for address in range(run, run + run_length, PIECE):
                length = min(PIECE, run + run_length - address)
                if before_piece is not None:
                    before_piece()
                if advise(address, length, _MADV_COLLAPSE) == 0:
                    collapsed += length
                else:  # EINVAL: a kernel before 6.1; EAGAIN / ENOMEM: no free huge page now: left on 4 KiB pages
                    refused = ctypes.get_errno()
    if refused and not collapsed:
        log.debug("madvise(MADV_COLLAPSE) refused (%s): the weights stay on 4 KiB pages", errno.errorcode.get(refused))
    return collapsed, time.perf_counter() - begin


_STATE = {"thread": None, "again": False, "requests": 0, "settling": 0}
_LOCK = threading.Lock()
_QUIET = threading.Condition(_LOCK)  # notified when a request ends or a settle begins
# a collapse call copies at most this much (~10-20 ms of one core here), so a request arriving meanwhile waits that long
PIECE = 16 * HUGE_PAGE


@contextmanager
def requests_running():
    """While a request runs the background collapse waits between pieces: the copy reads and writes memory as fast as
    a pass streams its weights, and beside a prefill it made the first request after a load 1.5x slower (time to
    first token of a 1,245-token chat prompt on the real pair: 6.8-7.6 s against 4.6-4.9 s without the collapse,
    2-core Zen 5). It moves what is left once no request runs; ``settle`` lets it run regardless."""
    with _LOCK:
        _STATE["requests"] += 1
    try:
        yield
    finally:
        with _QUIET:
            _STATE["requests"] -= 1
            _QUIET.notify_all()


def _wait_while_requests_run() -> None:
    with _QUIET:
        while _STATE["requests"] > 0 and _STATE["settling"] == 0:
            _QUIET.wait()


def collapse_in_background() -> None:
    """``collapse_resident`` on a daemon thread (once more after the running one, if one runs)."""
    with _LOCK:
        running = _STATE["thread"]
        if running is not None and running.is_alive():
            _STATE["again"] = True
            return
        thread = threading.Thread(target=_collapse_until_done, name="specdec-huge-pages", daemon=True)
        _STATE["thread"] = thread
        thread.start()


def _collapse_until_done() -> None:
    try:  # the lowest priority: the copy runs while passes leave a core idle, not beside them (Linux: per thread)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    while True:
        collapsed, seconds = collapse_resident(before_piece=_wait_while_requests_run)
        if collapsed:
            log.info("%d MiB of packed weights and buffers on 2 MiB pages (%.2f s)", collapsed >> 20, seconds)
        with _LOCK:
            if not _STATE["again"]:
                return
            _STATE["again"] = False


def settle() -> None:
    """Wait until no background collapse runs (a pass timed beside one would be timed slow); the collapse does not
    wait for running requests meanwhile (a request may be what settles: a first ``auto`` request's calibration)."""
    with _QUIET:
        _STATE["settling"] += 1
        _QUIET.notify_all()
    try:
        while True:  # a collapse asked for meanwhile may have started a new thread
            with _LOCK:
                thread = _STATE["thread"]
            if thread is None or not thread.is_alive():
                return
            thread.join()
    finally:
        with _LOCK:
            _STATE["settling"] -= 1
