"""The process's memory mappings as Linux lists them (``/proc/self/smaps``), and the C library that advises on them.

One parser for what ``resident.py`` (the bundle's file mappings: pages to reclaim, tables to read row by row) and
``huge_pages.py`` (the anonymous mappings to back with 2 MiB pages) read. Nothing here changes memory.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

SMAPS = "/proc/self/smaps"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# start-end perms offset device inode [path]
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) \S+ (\d+)\s*(.*)$")
_COUNTERS = {"Rss:": "rss_kb", "Swap:": "swap_kb", "Anonymous:": "anonymous_kb"}

_LIBC: list = []


def libc():
    """The C library the process already links (None where ctypes cannot open it)."""
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def madvise():
    """The C library's ``madvise(address, length, advice)`` with its argument types set; None where it has none."""
    c_library = libc()
    if c_library is None or not hasattr(c_library, "madvise"):
        return None
    c_library.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return c_library.madvise


@dataclass(frozen=True)
class Mapping:
    """One mapping of an smaps (or maps) text; the counters are 0 and ``vm_flags`` empty where the text has none."""
    start: int
    end: int
    perms: str  # "rw-p": read, write, execute, private (p) or shared (s)
    offset: int  # into the mapped file
    inode: int  # 0: no file (anonymous memory, the heap, the stack)
    path: str  # the file, "[heap]", "[stack]", "[anon:name]", or ""
    rss_kb: int = 0
    swap_kb: int = 0
    anonymous_kb: int = 0  # pages of the mapping the process wrote (a file mapping's copied-on-write pages)
    vm_flags: tuple = ()  # "rd", "wr", ..., "nh" (MADV_NOHUGEPAGE)


def parse_smaps(text: str) -> list:
    """Every mapping of an smaps (or maps) text, in order, as ``Mapping`` records."""
    found = []  # (header fields, the fields after the header: counters and VmFlags) per mapping
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            start, end, perms, offset, inode, path = head.groups()
            found.append(((int(start, 16), int(end, 16), perms, int(offset, 16), int(inode), path.strip()), {}))
        elif found and line.strip():
            field, *values = line.split()
            if field in _COUNTERS:
                found[-1][1][_COUNTERS[field]] = int(values[0])
            elif field == "VmFlags:":
                found[-1][1]["vm_flags"] = tuple(values)
    return [Mapping(*header, **fields) for header, fields in found]


def with_libc(*calls: str) -> tuple | None:
    """(the C library, this process's mappings now) where the library has every one of ``calls`` (``"madvise"``,
    ``"mincore"``) and the platform has ``/proc/self/smaps``; None otherwise."""
    c_library = libc()
    if c_library is None or not all(hasattr(c_library, call) for call in calls):
        return None
    mappings = read_smaps()
    return None if mappings is None else (c_library, mappings)


def read_smaps() -> list | None:
    """This process's mappings now; None where the platform has no ``/proc/self/smaps``."""
    if not os.path.exists(SMAPS):
        return None
    with open(SMAPS) as smaps:
        return parse_smaps(smaps.read())
