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
                  calibration_key("bundle-a", "cuda", 2, 9, 256),
                  calibration_key("bundle-a", "cpu", 2, 9, 256, huge_pages=True)):  # costs measured on 2 MiB pages
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


def test_costs_measured_on_a_busy_cpu_are_stored_as_noisy_and_refined_when_quiet(tiny_bundle, monkeypatch, tmp_path):
    """Another process using half a core while costs are measured (a stored c(2) equal to c(1) once came from such
    a run): they are stored and used, so a later start does not measure again, but marked noisy; a quiet
    measurement replaces them, a noisier one never replaces a quieter one, and a stopped one changes nothing."""
    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    load = {"cores": 0.5}
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: load["cores"])
    decoder = SpeculativeDecoder.load(tiny_bundle)
    costs = decoder.costs()
    assert costs.verify[0] > 0 and decoder.costs() is costs and decoder.costs_noisy
    assert (tmp_path / "pass-costs.json").is_file()
    again = SpeculativeDecoder.load(tiny_bundle)
    monkeypatch.setattr(decoder_module, "calibrate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    assert again.costs() == costs and again.costs_noisy  # read: a later start does not measure
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: load["cores"])
    assert again.refine_costs(stop=lambda: True) is None and again.costs_noisy  # stopped: nothing changed
    load["cores"] = 0.9
    assert again.refine_costs() is None and again.costs_noisy  # noisier: kept the first
    load["cores"] = 0.01
    refined = again.refine_costs()
    assert refined is not None and not again.costs_noisy and again.refine_costs() is None
    third = SpeculativeDecoder.load(tiny_bundle)
    assert third.costs() == refined and not third.costs_noisy
    load["cores"] = 0.7  # a busy measurement never replaces a quiet entry
    from specdec.decoding.calibration_store import load_costs, save_costs
    assert not save_costs(third._calibration_key, costs, other_cores=0.7)
    assert load_costs(third._calibration_key) == refined


def test_an_idle_pool_refines_noisy_costs_for_every_worker(tiny_bundle, monkeypatch, tmp_path):
    import time

    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module
    from specdec.serving import pool as pool_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    load = {"cores": 0.5}
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: load["cores"])
    monkeypatch.setattr(pool_module, "IDLE_BEFORE_REFINE", 0.3)
    monkeypatch.setattr(pool_module, "REFINE_POLL", 0.05)
    decoder = SpeculativeDecoder.load(tiny_bundle, kv_caches=2)
    decoder.costs()
    pool = pool_module.DecoderPool(decoder, pool_module.PoolOptions(workers=2))
    try:
        assert all(worker.costs_noisy for worker in pool.decoders)
        load["cores"] = 0.0
        deadline = time.monotonic() + 60
        while any(worker.costs_noisy for worker in pool.decoders) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(worker.costs_noisy for worker in pool.decoders)
        assert pool.decoders[1].costs() == decoder.costs()
    finally:
        pool.close()


def _spy_calibrate(monkeypatch, decoder_module) -> list:
    """Every calibrate call's keywords, the measurement itself left as it is."""
    calls, original = [], decoder_module.calibrate
    monkeypatch.setattr(decoder_module, "calibrate", lambda *a, **k: calls.append(k) or original(*a, **k))
    return calls


def test_provisional_costs_are_coarse_never_stored_and_measured_in_full_by_refine(tiny_bundle, monkeypatch, tmp_path):
    """A server's first start on a machine: ``costs(provisional=True)`` measures one round at the shallow context
    and stores nothing (a later start must not read them as measured); ``refine_costs`` then measures in full, uses
    and stores that (quiet or not), and a later start reads it without measuring."""
    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module
    from specdec.decoding.calibration_store import load_costs_entry

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: 0.5)  # a full measurement beside other work
    calls = _spy_calibrate(monkeypatch, decoder_module)
    decoder = SpeculativeDecoder.load(tiny_bundle)
    provisional = decoder.costs(provisional=True)
    assert calls == [{"max_tokens": decoder_module.CALIBRATED_WIDTH, "stop": None,
                      **decoder_module.COARSE_CALIBRATION}]
    assert len(provisional.verify) == decoder_module.CALIBRATED_WIDTH and provisional.verify_slope == ()
    assert decoder.costs_provisional and decoder.costs_to_refine and not decoder.costs_noisy
    assert load_costs_entry(decoder._calibration_key)[0] is None  # never stored
    assert decoder.costs() is provisional and decoder.fork().costs_provisional  # a request runs on them, no wait
    assert decoder.refine_costs(stop=lambda: True) is None and decoder.costs_provisional  # stopped: nothing changed
    full = decoder.refine_costs()
    assert full is not None and full is not provisional and calls[-1].get("repeats") is None
    assert not decoder.costs_provisional and decoder.costs() is full and decoder.costs_noisy  # beside 0.5 cores
    assert load_costs_entry(decoder._calibration_key) == (full, 0.5)
    later = SpeculativeDecoder.load(tiny_bundle)
    count = len(calls)
    assert later.costs(provisional=True) == full and not later.costs_provisional and len(calls) == count


def test_an_idle_pool_measures_provisional_costs_in_full_soon(tiny_bundle, monkeypatch, tmp_path):
    import time

    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module
    from specdec.decoding.calibration_store import load_costs_entry
    from specdec.serving import pool as pool_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(decoder_module.OtherLoad, "cores", lambda self: 0.0)
    monkeypatch.setattr(pool_module, "IDLE_BEFORE_REFINE", 1000.0)  # only the first-costs wait may start it
    monkeypatch.setattr(pool_module, "IDLE_BEFORE_FIRST_COSTS", 0.2)
    monkeypatch.setattr(pool_module, "REFINE_POLL", 0.05)
    decoder = SpeculativeDecoder.load(tiny_bundle, kv_caches=2)
    decoder.costs(provisional=True)
    pool = pool_module.DecoderPool(decoder, pool_module.PoolOptions(workers=2))
    try:
        assert all(worker.costs_provisional for worker in pool.decoders)
        deadline = time.monotonic() + 60
        while any(worker.costs_provisional for worker in pool.decoders) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(worker.costs_to_refine for worker in pool.decoders)
        assert pool.decoders[1].costs() == decoder.costs() == load_costs_entry(decoder._calibration_key)[0]
    finally:
        pool.close()
