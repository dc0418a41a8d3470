"""Packed weights on 2 MiB pages (runners/huge_pages.py): only wholly resident ranges are collapsed, so resident
memory never grows, and the bytes never change. The live checks need Linux 6.1+ with transparent huge pages not
``never``; elsewhere they skip and the pure parts still run."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from specdec.runners import huge_pages
from specdec.runners.huge_pages import HUGE_PAGE, anonymous_mappings, resident_runs
from specdec.runners.proc_maps import parse_smaps

PAGE = 4096
PAGES = (2 << 20) // PAGE
MIB2 = 2 << 20


def test_runs_cover_only_whole_aligned_ranges_whose_pages_are_all_resident():
    def runs(start, resident, **more):
        return resident_runs(start, resident, page=PAGE, huge=MIB2, **more)

    start = 3 * MIB2 - 5 * PAGE  # five pages before a huge boundary
    resident = np.ones(5 + 4 * PAGES + 7, dtype=bool)  # four whole ranges after them, seven pages past
    assert runs(start, resident) == [(3 * MIB2, 4 * MIB2)]
    assert runs(start, resident, exclude=frozenset({4 * MIB2})) == [(3 * MIB2, MIB2), (5 * MIB2, 2 * MIB2)]
    resident[5 + PAGES + 100] = False  # a hole in the second range: it is left, its neighbours stay
    assert runs(start, resident) == [(3 * MIB2, MIB2), (5 * MIB2, 2 * MIB2)]
    assert runs(start, resident[:5 + PAGES - 1]) == []  # no whole range
    assert runs(0, np.zeros(2 * PAGES, dtype=bool)) == []


def test_only_private_writable_anonymous_mappings_are_candidates():
    """The heap and anonymous mappings; not a file, shared memory, the stack, a reserve without access, or a
    mapping marked MADV_NOHUGEPAGE (the KV caches: resident memory follows the context in use)."""
    def mapping(line: str, flags: str = "rd wr mr mw me ac") -> str:
        return f"{line}\nSize:  1024 kB\nRss:  1024 kB\nVmFlags: {flags}"

    smaps = "\n".join([
        mapping("55d0c0000000-55d0c2000000 rw-p 00000000 00:00 0                          [heap]"),
        mapping("7f0000000000-7f0004000000 rw-p 00000000 00:00 0 "),
        mapping("7f0004000000-7f0008000000 ---p 00000000 00:00 0 ", "mr mw me ac"),
        mapping("7f0008000000-7f000c000000 rw-p 00000000 00:00 0                          [anon:onnxruntime]"),
        mapping("7f000c000000-7f0010000000 rw-s 00000000 00:01 1234                       /dev/zero (deleted)"),
        mapping("7f0010000000-7f0014000000 rw-p 00001000 fd:01 5678                       /bundle/model.onnx.data"),
        mapping("7f0014000000-7f0018000000 rw-p 00000000 00:00 0 ", "rd wr mr mw me ac nh"),
        mapping("7ffc00000000-7ffc00100000 rw-p 00000000 00:00 0                          [stack]"),
    ])
    assert anonymous_mappings(parse_smaps(smaps)) == [(0x55d0c0000000, 0x55d0c2000000), (0x7f0000000000, 0x7f0004000000),
                                         (0x7f0008000000, 0x7f000c000000)]


def _smaps_of(address: int) -> dict:
    """Rss / AnonHugePages (kB) of the mapping holding ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head in ("Rss:", "AnonHugePages:"):
                fields[head[:-1]] = int(line.split()[1])
    return fields


def _private(size: int) -> tuple:
    """An anonymous private mapping of ``size`` bytes on 4 KiB pages and its address."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, np.frombuffer(region, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("planted", [False, True])
def test_dense_memory_moves_to_huge_pages_and_sparse_memory_stays_as_it_was(monkeypatch, planted):
    """A touched mapping is collapsed with its bytes unchanged; a mapping with one page touched per 2 MiB keeps
    its resident size. Planted: every range collapsed whatever is resident must grow the sparse one."""
    monkeypatch.delenv("SPECDEC_HUGE_PAGES", raising=False)  # tests/conftest.py switches it off for other tests
    if not os.path.exists("/proc/self/smaps") or not huge_pages.enabled():
        pytest.skip("no transparent huge pages here")
    dense, dense_at = _private(8 * HUGE_PAGE)
    sparse, sparse_at = _private(8 * HUGE_PAGE)
    kept, kept_at = _private(8 * HUGE_PAGE)  # touched, but marked as the KV caches are
    kept.madvise(mmap.MADV_NOHUGEPAGE)
    np.frombuffer(kept, dtype=np.uint8)[:] = 1
    values = np.frombuffer(dense, dtype=np.uint8)
    values[:] = np.arange(values.size, dtype=np.uint64).astype(np.uint8)
    expected = values.copy()
    np.frombuffer(sparse, dtype=np.uint8)[::HUGE_PAGE] = 7
    before = _smaps_of(sparse_at)["Rss"]
    if planted:
        real = huge_pages.resident_runs
        monkeypatch.setattr(huge_pages, "resident_runs",
                            lambda start, resident, **kw: real(start, np.ones_like(resident), **kw))
    collapsed, _ = huge_pages.collapse_resident()
    if collapsed == 0:
        pytest.skip("the kernel does not collapse ranges on request (MADV_COLLAPSE, Linux 6.1+)")
    assert _smaps_of(dense_at)["AnonHugePages"] >= 6 * HUGE_PAGE // 1024  # its aligned interior at least
    assert np.array_equal(values, expected)
    assert (_smaps_of(sparse_at)["Rss"] == before) != planted
    assert _smaps_of(kept_at)["AnonHugePages"] == 0
    del values
    for region in (dense, sparse, kept):
        region.close()


def test_the_environment_switches_it_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    assert huge_pages.collapse_resident() == (0, 0.0)
    huge_pages.collapse_in_background()
    huge_pages.settle()


@pytest.mark.integration
def test_a_load_moves_its_memory_once_its_sessions_are_made(tiny_bundle, monkeypatch):
    """The load hands the move to its thread after the sessions are made (the draft's too, when it opens on a
    thread of its own), and the key its pass costs are stored under says which pages they were measured on."""
    from specdec.decoding import decoder as decoding

    calls = []
    monkeypatch.setattr(decoding, "collapse_in_background", lambda: calls.append(True))
    monkeypatch.delenv("SPECDEC_HUGE_PAGES", raising=False)
    loaded = decoding.SpeculativeDecoder.load(tiny_bundle)
    if loaded.draft_opening is not None:
        loaded.draft_opening.join()
    assert calls == [True]
    assert ('"pages": "2 MiB"' in loaded._calibration_key) == huge_pages.enabled()


def _background_collapse(monkeypatch, pieces: int) -> list:
    """collapse_in_background over a stand-in collapse of ``pieces`` pieces: returns the list it appends to."""
    done: list = []

    def collapse(exclude=frozenset(), before_piece=None):
        for piece in range(pieces):
            before_piece()
            done.append(piece)
        return 0, 0.0

    monkeypatch.setattr(huge_pages, "collapse_resident", collapse)
    huge_pages.settle()  # nothing of an earlier test still running
    return done


def test_the_background_collapse_waits_while_a_request_runs_and_settle_never_waits_for_a_request(monkeypatch):
    """A request that starts first holds the copy back at its first piece until it ends; a settle inside a request
    (a first ``auto`` request's calibration) lets the copy finish instead of waiting forever. Planted: a gate that
    does not wait lets the pieces run beside the request."""
    import threading
    import time

    done = _background_collapse(monkeypatch, pieces=3)
    with huge_pages.requests_running():
        huge_pages.collapse_in_background()
        time.sleep(0.2)
        assert done == []  # held back while the request runs
    huge_pages.settle()
    assert done == [0, 1, 2]

    done = _background_collapse(monkeypatch, pieces=2)
    with huge_pages.requests_running():
        huge_pages.collapse_in_background()
        settling = threading.Thread(target=huge_pages.settle, daemon=True)
        settling.start()
        settling.join(timeout=5)
        assert not settling.is_alive() and done == [0, 1]  # settled inside the request

    done = _background_collapse(monkeypatch, pieces=2)
    monkeypatch.setattr(huge_pages, "_wait_while_requests_run", lambda: None)  # planted: no gate
    with huge_pages.requests_running():
        huge_pages.collapse_in_background()
        time.sleep(0.2)
        assert done == [0, 1]  # what the first check above would have seen with this gate: it fails there
