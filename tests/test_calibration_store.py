"""Measured pass costs on disk: calibrate once per machine; a stale or malformed file is ignored and rewritten."""

from __future__ import annotations

import json

import pytest

from specdec.decoding.calibration_store import OtherLoad, busy_cpu_seconds, calibration_key, load_costs, save_costs
from specdec.decoding.cost_model import Costs

COSTS = Costs(draft_step=0.02, verify=(0.07, 0.08, 0.1))


def test_a_saved_entry_is_found_by_the_same_key_only(tmp_path):
    path = tmp_path / "costs.json"
    key = calibration_key("bundle-a", "cpu", 2, 9, 256)
    save_costs(key, COSTS, path)
    assert load_costs(key, path) == COSTS
    for other in (calibration_key("bundle-b", "cpu", 2, 9, 256), calibration_key("bundle-a", "cpu", 1, 9, 256),
                  calibration_key("bundle-a", "cuda", 2, 9, 256)):
        assert load_costs(other, path) is None


def test_a_malformed_or_foreign_file_is_ignored_and_rewritten(tmp_path):
    path = tmp_path / "costs.json"
    key = calibration_key("bundle-a", "cpu", 2, 9, 256)
    for content in ("not json", "[]", json.dumps({"layout": 99, "entries": {}}),
                    json.dumps({"layout": 1, "entries": {key: {"draft_step": "x", "verify": [0.1]}}}),
                    json.dumps({"layout": 1, "entries": {key: {"draft_step": 0.1, "verify": [-1.0]}}})):
        path.write_text(content)
        assert load_costs(key, path) is None
        save_costs(key, COSTS, path)
        assert load_costs(key, path) == COSTS


def test_a_second_process_starts_auto_without_calibrating(tiny_bundle, monkeypatch, tmp_path):
    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: 0.0)  # a quiet machine, whatever runs beside
    first = SpeculativeDecoder.load(tiny_bundle)
    measured = first.costs()
    assert (tmp_path / "pass-costs.json").is_file()

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(decoder_module, "calibrate", no_calibration)
    second = SpeculativeDecoder.load(tiny_bundle)  # as a new process would: nothing in memory
    assert second.costs() == measured
    second.generate("def f(x):", max_new_tokens=4, num_draft_tokens="auto")


def test_threads_are_honoured_or_refused_never_ignored(tiny_bundle):
    """The process's thread pool is sized by its first load; another size later is a one-line error."""
    import subprocess
    import sys

    code = (f"from specdec import SpeculativeDecoder as D; D.load({str(tiny_bundle)!r}, threads=1)\n"
            f"D.load({str(tiny_bundle)!r}, threads=1); D.load({str(tiny_bundle)!r})\n"
            f"try:\n    D.load({str(tiny_bundle)!r}, threads=2)\nexcept ValueError as exc:\n    print('refused:', exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "refused: threads=2: this process's onnxruntime thread pool was already created with 1 threads" in result.stdout


def test_busy_seconds_count_user_nice_system_irq_softirq_and_steal_not_idle_or_iowait(monkeypatch):
    import os

    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    # cpu  user nice system idle iowait irq softirq steal guest guest_nice
    assert busy_cpu_seconds("cpu  100 20 30 9000 500 4 6 40 0 0\ncpu0 1 2 3\n") == pytest.approx(2.0)


def test_other_load_is_none_without_proc_stat(tmp_path):
    assert OtherLoad(str(tmp_path / "missing")).cores() is None


@pytest.mark.parametrize("other_cores, stored", [(0.02, True), (0.5, False)])
def test_costs_measured_on_a_busy_cpu_serve_the_process_and_are_not_stored(tiny_bundle, monkeypatch, tmp_path,
                                                                          other_cores, stored, caplog):
    """Another process using half a core while costs are measured (a stored c(2) equal to c(1) once came from
    such a run): the decoder keeps them, the file does not (storing regardless fails the busy case)."""
    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: other_cores)
    decoder = SpeculativeDecoder.load(tiny_bundle)
    with caplog.at_level("WARNING", logger="specdec.decoding.decoder"):
        costs = decoder.costs()
    assert costs.verify[0] > 0 and decoder.costs() is costs
    assert (tmp_path / "pass-costs.json").is_file() == stored
    assert ("not stored" in caplog.text) == (not stored)
