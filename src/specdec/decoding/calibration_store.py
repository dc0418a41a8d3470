"""Measured pass costs on disk, so ``auto`` calibrates once per machine, not once per process or worker.

An entry is keyed by everything the costs depend on: the bundle's identity (the hash of its manifest,
which hashes every file), the CPU model, the onnxruntime version, the provider, the thread count and the
calibration's shape. A later process with the same key starts ``auto`` at once. A file that is missing,
malformed or of another layout is ignored (and rewritten on the next save); a wrong entry is dropped.

Costs measured while other processes used the CPU are not stored (``OtherLoad``): they are the machine's costs
under that load, right for the process that measured them, wrong for every later one. On a 2-core VM a busy
loop beside the calibration made a one-token pass 2.3x dearer and a two-token pass 1.9x, so the stored c(2)
equalled c(1) and ``auto`` ran one-token drafts on prose where they lose.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

from specdec.contract.bundle import cache_dir
from specdec.decoding.cost_model import Costs

log = logging.getLogger(__name__)
FILE_NAME = "pass-costs.json"
LAYOUT = 3  # 2: the costs' growth with the context (verify_slope, draft_slope); 3: measured on a quiet CPU (OtherLoad)
# the CPU other processes may have used while costs were measured (cores, on average) for the costs to be stored:
# a quiet 2-core VM shows 0.01; a busy loop beside the calibration 0.65; one busy half the time 0.28
OTHER_CORES_LIMIT = 0.1


def busy_cpu_seconds(stat_text: str) -> float:
    """CPU seconds every process (and the hypervisor's steal) has used since boot, from /proc/stat's first line:
    user, nice, system, irq, softirq and steal time, in clock ticks."""
    fields = [int(v) for v in stat_text.split("\n", 1)[0].split()[1:]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
    return busy / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """The CPU other processes used between its creation and ``cores()``: all CPU time the kernel counted
    (/proc/stat) less this process's own, per second of wall time; None where there is no /proc/stat."""

    def __init__(self, stat_path: str = "/proc/stat"):
        self.stat_path = stat_path
        self.busy = self._busy()
        self.own = time.process_time()
        self.wall = time.perf_counter()

    def _busy(self) -> float | None:
        try:
            return busy_cpu_seconds(Path(self.stat_path).read_text())
        except (OSError, ValueError):
            return None

    def cores(self) -> float | None:
        busy, wall = self._busy(), time.perf_counter() - self.wall
        if busy is None or self.busy is None or wall <= 0:
            return None
        return max(0.0, (busy - self.busy) - (time.process_time() - self.own)) / wall


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(bundle_identity: str, provider: str, threads: int | None, max_tokens: int, context: int,
                    one_row_padded: bool = False) -> str:
    import onnxruntime

    key = {"bundle": bundle_identity, "cpu": cpu_model(), "onnxruntime": onnxruntime.__version__,
           "provider": provider, "threads": threads or os.cpu_count(), "max_tokens": max_tokens, "context": context}
    if one_row_padded:  # exact_rows: a one-token pass costs a two-token one (keys without it stay as they were)
        key["one_row_padded"] = True
    return json.dumps(key, sort_keys=True)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("layout") != LAYOUT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def load_costs(key: str, path: Path | None = None) -> Costs | None:
    entry = _read(path or cache_dir() / FILE_NAME).get(key)
    try:
        return Costs(draft_step=float(entry["draft_step"]), verify=tuple(float(v) for v in entry["verify"]),
                     context=int(entry["context"]), verify_slope=tuple(float(v) for v in entry["verify_slope"]),
                     draft_slope=float(entry["draft_slope"]))
    except (TypeError, KeyError, ValueError):
        return None


def save_costs(key: str, costs: Costs, path: Path | None = None) -> None:
    path = path or cache_dir() / FILE_NAME
    entries = _read(path)
    entries[key] = {"draft_step": costs.draft_step, "verify": list(costs.verify), "context": costs.context,
                    "verify_slope": list(costs.verify_slope), "draft_slope": costs.draft_slope}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump({"layout": LAYOUT, "entries": entries}, handle, indent=1)
        os.replace(handle.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as exc:
        log.warning("could not save measured pass costs to %s: %s", path, exc)
