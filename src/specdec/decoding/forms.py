"""Which of a model's weight forms this machine runs, chosen by measuring them here, once.

A bundle may carry its target in several weight forms (``ModelSpec.weight_forms``: MatMulNBits' int4 blocks and
int8 rows, export/int8_rows.py). Which is faster depends on the CPU, not on the one that exported the bundle: on a
2-core AMX Xeon int8 rows made a 64-token pass 0.37x and a one-token pass 1.06x MatMulNBits' time, on a 2-core Zen 4
EPYC 0.51x and 1.24x. So the first load on a machine times each form's passes (one form in memory at a time) and
keeps the form that runs a reference turn soonest: ``REFERENCE_TURN`` passes of each width, a 512-token prompt
prefilled in 64-token passes, then 128 new tokens as 64 one-token passes (rounds without a proposal, target-only
decoding) and 32 four-token verify passes. The narrow passes are timed ``REPEATS`` times each and the 64-token pass
(a second or more on a slow CPU) once; only when the forms' turns come within ``DECISIVE`` of each other are the
forms measured again with ``REPEATS`` of every width. The choice and its measurements are stored per bundle, CPU
(name and flags), onnxruntime, provider and thread count (decoding/calibration_store.py), so later loads read it;
a choice measured while other processes used the CPU is measured again by the first later load that finds the
machine quiet: such a load runs the stored choice at once and watches the CPU while it makes the target's session
(no load waits to find out), and measures the forms again after it when other processes stayed under
``OTHER_CORES_LIMIT``. A caller that knows better names a form (``SpeculativeDecoder.load(weight_form=...)``,
``--weight-form``). The last form measured keeps its session when it wins (``FormChoice.session``): the load runs
it instead of packing the same weights again.

Every form computes the same model within its quantization (each passed the exporter's parity check); greedy
identity with target-only decoding holds within whichever form runs, since both are decoded with it.
"""

from __future__ import annotations

import gc
import logging
from typing import NamedTuple

from specdec.contract.bundle import inside
from specdec.contract.manifest import forms_of
from specdec.decoding.calibration_store import (OTHER_CORES_LIMIT, OtherLoad, load_check, machine_key,
                                                other_cores_of, save_check)
from specdec.decoding.cost_model import fill_context, time_passes
from specdec.runners.factory import make_runner
from specdec.runners.huge_pages import collapse_resident, settle
from specdec.runners.resident import trim_heap

log = logging.getLogger(__name__)

REFERENCE_TURN = {64: 8, 1: 64, 4: 32}  # pass width -> passes of a reference turn
MEASURED_CONTEXT = 256  # cached tokens behind the timed passes
REPEATS = 3
DECISIVE = 1.1  # the runner-up's reference turn at least this many times the best's: chosen on one wide pass each


def quiet_since(watch: OtherLoad) -> bool:
    """Whether other processes used at most OTHER_CORES_LIMIT cores since ``watch`` began."""
    cores = watch.cores()
    return cores is not None and cores <= OTHER_CORES_LIMIT


def noisy_choice(spec, identity: str, provider: str, threads: int | None) -> bool:
    """Whether this machine's stored choice of ``spec``'s form was measured beside other work (measured again by a
    load that finds the machine quiet: ``choose_form(quiet=True)``)."""
    stored = load_check(machine_key(identity, provider, threads, checks="weight_form"))
    return stored is not None and other_cores_of(stored) > OTHER_CORES_LIMIT


def turn_seconds(costs: dict) -> float:
    """Seconds of the reference turn from a form's pass costs ``{width: seconds}``."""
    return sum(passes * costs[width] for width, passes in REFERENCE_TURN.items())


class FormChoice(NamedTuple):
    """The weight form a load runs: its name (None: a model in one form), its graph file and, when the measurement
    that chose it left it open, its session (a ``SessionHolder`` for ``make_runner(session=...)``), else None."""
    form: str | None
    onnx_file: str
    session: object = None


def measure_form(onnx_path: str, spec, provider: str, threads: int | None, wide_rounds: int = REPEATS,
                 keep: list | None = None) -> dict:
    """``{width: median seconds}`` of this form's passes at ``MEASURED_CONTEXT`` cached tokens: ``REPEATS`` of each
    narrow width, ``wide_rounds`` of the widest. Its session is freed before this returns, or, given ``keep``,
    appended to it (still open, its weights packed)."""
    widths = sorted(REFERENCE_TURN)
    runner = make_runner(onnx_path, spec, provider, MEASURED_CONTEXT + max(widths) + 1, max(widths), threads)
    measured = None
    try:
        fill_context(runner, MEASURED_CONTEXT)
        settle()
        collapse_resident()  # timed as a load runs it: its packed weights on 2 MiB pages (runners/huge_pages.py)
        time_passes(runner, widths, 1)  # warm-up: first passes allocate
        rounds = {max(widths): min(wide_rounds, REPEATS)}
        measured = dict(zip(widths, time_passes(runner, widths, REPEATS, rounds=rounds)))
        return measured
    finally:
        runner.reset()
        if keep is not None and measured is not None:  # a failed measurement keeps nothing
            keep.append(runner.sessions)
        del runner
        if keep is None or measured is None:
            release()


def release(kept: list | None = None) -> None:
    """Free the sessions in ``kept`` (emptied) and whatever else was dropped: the packed weights go back to the OS
    before another form is loaded."""
    if kept:
        kept.clear()
    gc.collect()
    trim_heap()


def check_wanted(spec, wanted: str | None) -> None:
    """Raise ValueError naming ``spec``'s forms when ``wanted`` (a form's name; None: any) is not one of them."""
    forms = dict(spec.weight_forms)
    if wanted is not None and wanted not in forms:
        have = ", ".join(str(name) for name in forms) if forms else "its one form"
        raise ValueError(f"weight_form {wanted!r}: this bundle's {spec.role} has {have}")


def choose_form(root, spec, identity: str, provider: str, threads: int | None, wanted: str | None = None,
                measure=None, quiet: bool = False, among: tuple | None = None) -> FormChoice:
    """The ``FormChoice`` of ``spec`` to run: ``wanted`` when given, the only one when there is one, else this
    machine's stored choice or a new measurement (stored; ``measure``: a form's timing, default ``measure_form``;
    the forms are measured in the order the bundle lists them, and the last one's session is kept if it wins).
    ``quiet``: this load found the machine quiet, so a choice stored from a measurement beside other work is
    measured again. ``among``: the forms this load may run (those that fit in memory, ``runners.memory.
    fitting_forms``; None: all); a choice among fewer than all is neither read from nor written to the store."""
    measure = measure or measure_form
    forms = forms_of(spec)
    if wanted is not None:
        check_wanted(spec, wanted)
        return FormChoice(wanted, forms[wanted])
    every = len(forms)
    if among is not None:
        forms = {name: path for name, path in forms.items() if name in among} or forms
    if len(forms) == 1 or provider != "cpu":  # a GPU's kernels were never measured: the first form
        return FormChoice(*next(iter(forms.items())))
    key = machine_key(identity, provider, threads, checks="weight_form")
    stored = load_check(key) if len(forms) == every else None
    if stored is not None and stored.get("form") in forms and not (other_cores_of(stored) > OTHER_CORES_LIMIT
                                                                    and quiet):
        return FormChoice(stored["form"], forms[stored["form"]])
    other = OtherLoad()
    kept = []  # the last form's session, open
    last = list(forms)[-1]

    def measure_all(wide_rounds: int) -> dict:
        release(kept)  # one form's weights in memory at a time
        return {name: measure(str(inside(root, path)), spec, provider, threads, wide_rounds=wide_rounds,
                              keep=kept if name == last else None)
                for name, path in forms.items()}

    wide_rounds = 1
    try:
        costs = measure_all(wide_rounds)
        if not decisive(costs):
            wide_rounds = REPEATS
            costs = measure_all(wide_rounds)
    except BaseException:
        release(kept)  # a measurement that failed holds no form's weights
        raise
    turns = {name: turn_seconds(measured) for name, measured in costs.items()}
    best = min(turns, key=turns.get)
    other_cores = other.cores()
    log.info("weight forms of the %s measured on this machine (reference turn: %s; %s): %s; running %s%s",
             spec.role, ", ".join(f"{passes} passes of {width}" for width, passes in REFERENCE_TURN.items()),
             f"medians of {REPEATS} passes" if wide_rounds == REPEATS else
             f"medians of {REPEATS} narrow passes, one of {max(REFERENCE_TURN)}",
             "; ".join(f"{name} {turns[name]:.2f} s (" + ", ".join(f"{w}: {1000 * c:.1f} ms" for w, c in
                                                                   sorted(costs[name].items())) + ")"
                       for name in forms), best,
             f" (other processes used {other_cores:.2f} cores meanwhile)" if other_cores else "")
    if len(forms) == every:
        save_check(key, {"form": best, "turn_seconds": turns,
                         "costs": {name: {str(w): c for w, c in measured.items()} for name, measured in costs.items()},
                         "wide_rounds": wide_rounds, "other_cores": other_cores})
    if best != last:
        release(kept)
    return FormChoice(best, forms[best], kept[0] if kept else None)


def decisive(costs: dict) -> bool:
    """Whether forms' pass costs ``{form: {width: seconds}}`` part their reference turns by ``DECISIVE`` or more."""
    turns = sorted(turn_seconds(measured) for measured in costs.values())
    return len(turns) < 2 or turns[1] >= DECISIVE * turns[0]
