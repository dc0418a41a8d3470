"""runners/resident.py: what a load gives back to the OS, and that nothing written is ever dropped.

``release_read_once_pages`` reclaims resident pages of file mappings under a bundle's folder. Pages a process
wrote in a private file mapping live only in memory: discarding them would silently restore the file's bytes.
The test maps a file three ways (read only; read and then written; outside the bundle's folder) and checks that
the first loses its resident pages, the file outside keeps them, and every mapping still reads what it held (a
release by ``MADV_DONTNEED`` that ignored ``Anonymous``, the pages a write copied, fails on the written byte).
"""

import ctypes
import mmap
import os

import numpy as np
import pytest

from specdec.runners.proc_maps import Mapping, parse_smaps, read_smaps
from specdec.runners.resident import read_rows_singly, release_read_once_pages, trim_heap
from paths import TOOLS

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")

SIZE = 4 * 2**20


def _mapping_of(area) -> tuple:
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    for m in read_smaps():
        if m.start <= address < m.end:
            return m.rss_kb, m.swap_kb, m.anonymous_kb
    raise AssertionError("mapping not found")


def _private_map(path):
    with open(path, "r+b") as handle:
        return mmap.mmap(handle.fileno(), SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def test_only_clean_pages_under_the_bundle_are_released_and_every_mapping_reads_the_same(tmp_path):
    bundle, elsewhere = tmp_path / "bundle", tmp_path / "elsewhere"
    bundle.mkdir()
    elsewhere.mkdir()
    content = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    for folder in (bundle, elsewhere):
        (folder / "model.onnx.data").write_bytes(content)
    clean, written = _private_map(bundle / "model.onnx.data"), _private_map(bundle / "model.onnx.data")
    outside = _private_map(elsewhere / "model.onnx.data")
    for area in (clean, written, outside):
        assert area[:] == content  # every page read: resident
    written[12345] = content[12345] ^ 0xFF  # a private copy of one page, only in memory
    assert _mapping_of(clean)[0] * 1024 >= SIZE // 2
    before_outside = _mapping_of(outside)[0]

    released = release_read_once_pages(bundle)
    if released == 0:
        pytest.skip("the kernel refuses MADV_PAGEOUT here (Linux < 5.4): nothing is released")

    assert released >= SIZE // 2
    assert _mapping_of(clean)[0] == 0
    assert _mapping_of(outside)[0] == before_outside
    assert _mapping_of(written)[2] >= 4  # the written page: still in memory (the file's pages may go)
    assert clean[:] == content and outside[:] == content  # dropped pages read back from the file
    assert written[12345] == content[12345] ^ 0xFF and written[:12345] == content[:12345]
    for area in (clean, written, outside):
        area.close()


def _read_mapped_rows(folder, rows: int, stride: int):
    """Map the folder's file (never written), read one byte every ``stride`` bytes (``rows`` of them, as a gather
    reads an embedding's rows), and return (resident bytes of the mapping, the bytes read, the mapping)."""
    area = _private_map(folder / "model.onnx.data")
    if folder.name == "bundle":
        read_rows_singly(folder)
    values = bytes(area[row * stride] for row in range(rows))
    return _mapping_of(area)[0] * 1024, values, area


def test_rows_read_from_a_bundle_mapping_cost_their_own_pages_only(tmp_path):
    """A gather of scattered rows from a mapped file whose pages the page cache holds: outside the bundle each row
    maps its neighbours too (fault-around); after ``read_rows_singly`` a row costs about its own page, and every
    byte reads the same. Without the dropped page cache (the ``posix_fadvise`` call) or without ``MADV_RANDOM``
    (a fault then reads 128 KiB around its page) the bound fails."""
    content = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    for name in ("bundle", "elsewhere"):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "model.onnx.data", "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())  # clean pages: the page cache holds them, and may drop them
    rows, stride, page = 16, SIZE // 16, mmap.PAGESIZE
    outside, outside_values, outside_area = _read_mapped_rows(tmp_path / "elsewhere", rows, stride)
    if outside < 4 * rows * page:
        outside_area.close()
        pytest.skip("this kernel maps single pages on a fault anyway (no fault-around): nothing to show")
    resident, values, area = _read_mapped_rows(tmp_path / "bundle", rows, stride)
    assert resident <= 2 * rows * page, f"{resident} bytes resident for {rows} rows (outside the bundle: {outside})"
    expected = bytes(content[row * stride] for row in range(rows))
    assert values == expected and outside_values == expected
    assert area[:] == content
    for mapped in (area, outside_area):
        mapped.close()


def test_parse_smaps_reads_each_mapping_s_header_and_counters():
    text = ("7f00-7f10 r--p 00002000 fe:00 12 /b/model.onnx.data\nRss: 8 kB\nAnonymous: 0 kB\nSwap: 0 kB\n"
            "VmFlags: rd mr mw me\n7f10-7f20 rw-p 00000000 00:00 0 \nRss: 4 kB\nAnonymous: 4 kB\nSwap: 8 kB\n"
            "7f20-7f30 rw-p 00000000 00:00 0                  [anon:onnxruntime]\n")
    assert parse_smaps(text) == [
        Mapping(0x7F00, 0x7F10, "r--p", 0x2000, 12, "/b/model.onnx.data", 8, 0, 0, ("rd", "mr", "mw", "me")),
        Mapping(0x7F10, 0x7F20, "rw-p", 0, 0, "", 4, 8, 4),
        Mapping(0x7F20, 0x7F30, "rw-p", 0, 0, "[anon:onnxruntime]")]


def test_trim_heap_runs():
    assert trim_heap() in (True, False)


@pytest.mark.integration
@pytest.mark.parametrize("variant", [[], ["--keep-pages", "--numpy-cache"]])
def test_the_load_memory_tool_reports_a_loaded_bundle_and_its_target_at_depth(tiny_bundle, variant):
    import subprocess
    import sys
    
    tool = TOOLS / "measure" / "load_memory.py"
    done = subprocess.run([sys.executable, str(tool), str(tiny_bundle), "--max-context", "256", "--depth", "100",
                           "--threads", "1", *variant], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("loaded (max_context 256): ") and "MiB resident" in lines[0]
    assert lines[1].startswith("target at 100 cached tokens") and "file-backed" in lines[1]


@pytest.mark.integration
def test_the_load_memory_tool_prefills_a_file_s_tokens(tiny_bundle, tmp_path):
    import subprocess
    import sys
    
    text = tmp_path / "prompt.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 12, encoding="utf-8")
    tool = TOOLS / "measure" / "load_memory.py"
    done = subprocess.run([sys.executable, str(tool), str(tiny_bundle), "--max-context", "256", "--threads", "1",
                           "--prefill", str(text)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.splitlines()[1]
    assert line.startswith("target after a prefill of ") and " tokens of prompt.txt (" in line and "file-backed" in line
    assert int(line.split()[5]) > 12  # the file's tokens, not a fixed count


@pytest.mark.integration
def test_load_releases_the_bundle_s_read_once_pages_once(tiny_bundle, monkeypatch):
    """SpeculativeDecoder.load ends with release_after_load(bundle root), once: on the thread that opens the draft's
    session after load returns, else before it returns (removing either call fails this)."""
    import specdec.decoding.decoder as decoder_module

    calls = []
    monkeypatch.setattr(decoder_module, "release_after_load", lambda root: calls.append(root))
    decoder = decoder_module.SpeculativeDecoder.load(tiny_bundle, max_context=128, verify=False)
    if decoder.draft_opening is not None:
        decoder.draft_opening.join(30)
    assert [str(root) for root in calls] == [str(tiny_bundle)]
