"""What a load measures on this machine, on disk, so it is measured once per machine, not once per process or worker.

Two stores, each keyed by everything its values depend on: the bundle's identity (the hash of its manifest,
which hashes every file), the CPU (model name and instruction-set flags: two VMs named alike can dispatch other
kernels), the onnxruntime version, the provider and the thread count.

- ``pass-costs.json``: ``auto``'s measured pass costs (key also the calibration's shape). Each entry records the
  CPU other processes used while it was measured (``OtherLoad``). An entry measured beside other work is still
  stored and used, so a later start never measures again, but it is marked ``noisy``: on a 2-core VM a busy loop
  beside the calibration made a one-token pass 2.3x dearer and a two-token pass 1.9x, so c(2) came out equal to
  c(1) and ``auto`` ran one-token drafts on prose where they lose. A noisy entry is replaced by the next
  measurement made on a quieter CPU (``SpeculativeDecoder.refine_costs``, which a server runs while it is idle);
  a quiet entry is never replaced by a noisier one.
- ``load-checks.json``: what a load finds out once: whether the target's one-token pass rounds as a row of a wider
  pass and the widest pass whose rows equal a narrow pass's (runners/row_parity.py), and which of a model's weight
  forms runs faster here (decoding/forms.py).

A file that is missing, malformed or of another layout is ignored (and rewritten on the next save); a wrong entry
is dropped.
"""

from __future__ import annotations

import hashlib
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
CHECKS_FILE_NAME = "load-checks.json"
# 2: the costs' growth with the context (verify_slope, draft_slope); 3: measured on a quiet CPU (OtherLoad);
# 4: every entry with the other processes' cores it was measured beside (noisy ones kept, replaced when quieter)
LAYOUT = 4
CHECKS_LAYOUT = 1
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


def cpu_flags_digest() -> str:
    """A short hash of the first CPU's instruction-set flags (/proc/cpuinfo), "" where there are none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                return hashlib.sha256(flags.encode()).hexdigest()[:16]
    except OSError:
        pass
    return ""


def bundle_identity(manifest) -> str:
    """What the stores key a bundle by: the sha256 of its manifest (which hashes every file)."""
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


def _this_machine(bundle_identity: str) -> dict:
    """The fields of a key that name the bundle, this CPU (name and flags) and onnxruntime."""
    import onnxruntime

    return {"bundle": bundle_identity, "cpu": cpu_model(), "cpu_flags": cpu_flags_digest(),
            "onnxruntime": onnxruntime.__version__}


def machine_key(bundle_identity: str, provider: str, threads: int | None, **more) -> str:
    """The key of what was measured for ``bundle_identity`` on this CPU, onnxruntime, provider and thread count."""
    key = {**_this_machine(bundle_identity), "provider": provider, "threads": threads or os.cpu_count(), **more}
    return json.dumps(key, sort_keys=True)


def calibration_key(bundle_identity: str, provider: str, threads: int | None, max_tokens: int, context: int,
                    one_row_padded: bool = False, form: str | None = None, huge_pages: bool = False) -> str:
    # exact_rows: a padded one-token pass costs a two-token one; form: the weight form run; huge_pages: the packed
    # weights on 2 MiB pages (6-11% faster one-token passes: measured again) (keys without any stay as they were)
    more = (({"one_row_padded": True} if one_row_padded else {}) | ({"form": form} if form else {})
            | ({"pages": "2 MiB"} if huge_pages else {}))
    return machine_key(bundle_identity, provider, threads, max_tokens=max_tokens, context=context, **more)


def _read(path: Path, layout: int = LAYOUT) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("layout") != layout or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _write(path: Path, layout: int, entries: dict, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump({"layout": layout, "entries": entries}, handle, indent=1)
        os.replace(handle.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as exc:
        log.warning("could not save %s to %s: %s", what, path, exc)


def other_cores_of(entry) -> float:
    """The other processes' cores a stored entry was measured beside (0 when it does not say)."""
    value = entry.get("other_cores") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0.0


def _costs_of(entry) -> Costs | None:
    try:
        return Costs(draft_step=float(entry["draft_step"]), verify=tuple(float(v) for v in entry["verify"]),
                     context=int(entry["context"]), verify_slope=tuple(float(v) for v in entry["verify_slope"]),
                     draft_slope=float(entry["draft_slope"]))
    except (TypeError, KeyError, ValueError):
        return None


def load_costs(key: str, path: Path | None = None) -> Costs | None:
    return load_costs_entry(key, path)[0]


def load_costs_entry(key: str, path: Path | None = None) -> tuple[Costs | None, float]:
    """(the stored costs or None, the other processes' cores they were measured beside)."""
    entry = _read(path or cache_dir() / FILE_NAME).get(key)
    costs = _costs_of(entry)
    return (costs, other_cores_of(entry)) if costs is not None else (None, 0.0)


def save_costs(key: str, costs: Costs, path: Path | None = None, other_cores: float = 0.0) -> bool:
    """Store ``costs`` measured beside ``other_cores`` of other processes' work, unless a stored entry was measured
    on a quieter CPU; returns whether they were stored."""
    path = path or cache_dir() / FILE_NAME
    entries = _read(path)
    stored = entries.get(key)
    if _costs_of(stored) is not None and other_cores_of(stored) < other_cores:
        return False
    entries[key] = {"draft_step": costs.draft_step, "verify": list(costs.verify), "context": costs.context,
                    "verify_slope": list(costs.verify_slope), "draft_slope": costs.draft_slope,
                    "other_cores": round(float(other_cores), 3)}
    _write(path, LAYOUT, entries, "measured pass costs")
    return True


def stored_here(bundle_identity: str, folder: Path | None = None) -> list:
    """What loads of ``bundle_identity`` stored about this CPU (name and flags) and onnxruntime: ``[(kind, key, entry)]``
    with ``kind`` "checks" (load-checks.json: weight form, row checks) or "costs" (pass-costs.json), ``key`` the entry's
    key as a dict without the fields that name the bundle and the machine, ``entry`` as stored."""
    folder = folder or cache_dir()
    here = _this_machine(bundle_identity)
    found = []
    for kind, name, layout in (("checks", CHECKS_FILE_NAME, CHECKS_LAYOUT), ("costs", FILE_NAME, LAYOUT)):
        for text, entry in _read(folder / name, layout).items():
            try:
                key = json.loads(text)
            except ValueError:
                continue
            if isinstance(key, dict) and isinstance(entry, dict) and all(key.get(f) == v for f, v in here.items()):
                found.append((kind, {f: v for f, v in key.items() if f not in here}, entry))
    return found


def load_check(key: str, path: Path | None = None) -> dict | None:
    """A load's stored finding under ``key`` (a dict), or None."""
    entry = _read(path or cache_dir() / CHECKS_FILE_NAME, CHECKS_LAYOUT).get(key)
    return entry if isinstance(entry, dict) else None


def save_check(key: str, entry: dict, path: Path | None = None) -> None:
    path = path or cache_dir() / CHECKS_FILE_NAME
    entries = _read(path, CHECKS_LAYOUT)
    entries[key] = entry
    _write(path, CHECKS_LAYOUT, entries, "load checks")


def load_row_checks(key: str, path: Path | None = None) -> dict | None:
    """The stored row checks (``{"one_row": gap, "two_rows": gap, "exact_width": int | None}``) or None."""
    entry = load_check(key, path)
    if entry is None:
        return None
    gaps, width = (entry.get("one_row"), entry.get("two_rows")), entry.get("exact_width")
    if not all(isinstance(g, (int, float)) and not isinstance(g, bool) and g >= 0 for g in gaps):
        return None
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        return None
    return {"one_row": float(gaps[0]), "two_rows": float(gaps[1]), "exact_width": width}


def save_row_checks(key: str, checks: dict, path: Path | None = None) -> None:
    save_check(key, {"one_row": checks["one_row"], "two_rows": checks["two_rows"],
                     "exact_width": checks["exact_width"]}, path)
