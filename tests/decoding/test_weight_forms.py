"""A target in two weight forms (MatMulNBits' int4 blocks, int8 rows): the export writes both with no CPU flag read,
the first load on a machine measures them and runs the faster one for a reference turn, later loads read the choice,
and whichever runs, greedy speculation equals target-only decoding in every mode."""

from __future__ import annotations

import pytest
from every_mode import assert_every_mode_is_target_only

from specdec.decoding import forms as forms_module
from specdec.decoding.forms import REFERENCE_TURN, choose_form, turn_seconds

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def two_form_bundle(tiny_pair_dirs, tmp_path_factory):
    from specdec.export.bundle import ExportOptions, export_bundle

    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("two_forms") / "bundle"
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=out, quant="int4", quant_method="rtn"),
                  progress=lambda message: None)
    return out


def _costs(one, four, wide):
    return {1: one, 4: four, 64: wide}


def test_the_reference_turn_weighs_prefill_and_decoding():
    assert REFERENCE_TURN == {64: 8, 1: 64, 4: 32}
    # a Zen 4 EPYC's target passes (issue figures, ms): int8 rows win the turn on their prefill
    assert turn_seconds(_costs(0.0551, 0.070, 0.437)) < turn_seconds(_costs(0.0445, 0.080, 0.856))
    # a CPU whose wide passes cost the same in both: the one-token pass decides
    assert turn_seconds(_costs(0.040, 0.060, 0.500)) < turn_seconds(_costs(0.050, 0.060, 0.500))


@pytest.mark.integration
def test_export_writes_both_forms_and_the_first_load_measures_them(two_form_bundle, monkeypatch, tmp_path):
    import onnx

    from specdec import SpeculativeDecoder
    from specdec.contract.manifest import Manifest

    manifest = Manifest.read(two_form_bundle)
    assert manifest.target.weight_forms == (("nbits", "target/model.onnx"), ("int8", "target-int8/model.onnx"))
    assert manifest.draft.weight_forms == () and "weight_forms" not in manifest.to_json().split('"draft"')[1]
    assert any(name.startswith("target-int8/") for name in manifest.files)
    assert manifest.extra["parity_max_abs_error"]["target-int8"]["int4"]["rows_vs_decode"] == {"logits": 0.0,
                                                                                              "kv": 0.0}
    ops = {form: {n.op_type for n in onnx.load(two_form_bundle / path, load_external_data=False).graph.node}
           for form, path in manifest.target.weight_forms}
    assert "MatMulIntegerToFloat" in ops["int8"] and "MatMulIntegerToFloat" not in ops["nbits"]

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    measured = []
    fake = {"nbits": _costs(0.01, 0.02, 0.5), "int8": _costs(0.012, 0.015, 0.1)}  # int8: the faster turn

    def measure(path, spec, provider, threads, wide_rounds, keep=None):
        form = "int8" if "target-int8" in path else "nbits"
        measured.append(form)
        return fake[form]

    monkeypatch.setattr(forms_module, "measure_form", measure)
    # a quiet machine, whatever runs beside the tests: a choice measured beside other work is measured again by the
    # next load (test_a_choice_measured_beside_other_work_is_measured_again_when_quiet), not what this test is about
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: 0.0)
    decoder = SpeculativeDecoder.load(two_form_bundle)
    assert decoder.weight_form == "int8" and measured == ["nbits", "int8"]
    again = SpeculativeDecoder.load(two_form_bundle)  # read from the store: nothing measured
    assert again.weight_form == "int8" and measured == ["nbits", "int8"] and again.fork().weight_form == "int8"
    forced = SpeculativeDecoder.load(two_form_bundle, weight_form="nbits")
    assert forced.weight_form == "nbits" and forced._calibration_key != again._calibration_key
    with pytest.raises(ValueError, match="weight_form 'int4': this bundle's target has nbits, int8"):
        SpeculativeDecoder.load(two_form_bundle, weight_form="int4")
    prompt = "def add(a, b):\n    return a + b\n"
    assert decoder.generate(prompt, max_new_tokens=8).token_ids  # the int8 form decodes


@pytest.mark.integration
def test_a_noisy_choice_runs_at_once_and_a_quiet_load_measures_it_again(two_form_bundle, monkeypatch, tmp_path):
    """A choice stored from a measurement beside other work: a busy load runs it with nothing measured and no
    wait; a load during whose session-making other processes stayed quiet measures the forms again and runs the
    new choice (a load that never watched, or always measured, fails this)."""
    from specdec import SpeculativeDecoder

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    measured = []
    fake = {"nbits": _costs(0.01, 0.02, 0.5), "int8": _costs(0.012, 0.015, 0.1)}

    def measure(path, spec, provider, threads, wide_rounds, keep=None):
        form = "int8" if "target-int8" in path else "nbits"
        measured.append(form)
        return fake[form]

    busy = {"cores": 0.6}
    monkeypatch.setattr(forms_module, "measure_form", measure)
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: busy["cores"])
    assert SpeculativeDecoder.load(two_form_bundle).weight_form == "int8" and len(measured) == 2  # beside work
    assert SpeculativeDecoder.load(two_form_bundle).weight_form == "int8" and len(measured) == 2  # still busy
    busy["cores"] = 0.0
    fake["nbits"] = _costs(0.005, 0.01, 0.09)  # quiet, nbits is faster
    quiet = SpeculativeDecoder.load(two_form_bundle)
    assert quiet.weight_form == "nbits" and len(measured) == 4
    assert quiet.generate("def add(a, b):\n", max_new_tokens=4).token_ids  # the new form's session runs
    assert SpeculativeDecoder.load(two_form_bundle).weight_form == "nbits" and len(measured) == 4  # stored quiet


@pytest.mark.integration
def test_a_real_measurement_picks_a_form_and_every_mode_is_target_only_in_each(two_form_bundle, monkeypatch, tmp_path):
    from specdec import SpeculativeDecoder

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    timed = []
    real_time_passes = forms_module.time_passes

    def time_passes(runner, widths, repeats, stop=None, rounds=None):
        timed.append((tuple(widths), repeats, rounds))
        return real_time_passes(runner, widths, repeats, stop, rounds)

    monkeypatch.setattr(forms_module, "time_passes", time_passes)
    assert SpeculativeDecoder.load(two_form_bundle).weight_form in ("nbits", "int8")
    widths = tuple(sorted(REFERENCE_TURN))  # each form: a warm-up round, then REPEATS with one 64-token pass
    assert timed[:4] == [(widths, 1, None), (widths, forms_module.REPEATS, {64: 1})] * 2
    for form in ("nbits", "int8"):
        assert_every_mode_is_target_only(two_form_bundle, weight_form=form)


def test_a_single_form_bundle_runs_its_one_form_and_refuses_another():
    from types import SimpleNamespace

    spec = SimpleNamespace(weight_forms=(), onnx_file="target/model.onnx", role="target")
    assert choose_form(None, spec, "id", "cpu", 2) == (None, "target/model.onnx", None)
    with pytest.raises(ValueError, match="has its one form"):
        choose_form(None, spec, "id", "cpu", 2, "int8")
    two = SimpleNamespace(weight_forms=(("nbits", "a.onnx"), ("int8", "b.onnx")), onnx_file="a.onnx", role="target")
    assert choose_form(None, two, "id", "cuda", 2) == ("nbits", "a.onnx", None)  # never measured on a GPU: the first


def test_a_choice_measured_beside_other_work_is_measured_again_when_quiet(monkeypatch, tmp_path):
    from types import SimpleNamespace

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    spec = SimpleNamespace(weight_forms=(("nbits", "a.onnx"), ("int8", "b.onnx")), onnx_file="a.onnx", role="target")
    load = {"cores": 0.6}
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: load["cores"])
    calls = []
    costs = {"a.onnx": _costs(0.01, 0.02, 0.5), "b.onnx": _costs(0.012, 0.015, 0.1)}

    def measure(path, *rest, wide_rounds, keep=None):
        calls.append(path)
        return costs[path.rsplit("/", 1)[-1]]

    assert choose_form(tmp_path, spec, "id", "cpu", 2, measure=measure)[0] == "int8" and len(calls) == 2
    assert forms_module.noisy_choice(spec, "id", "cpu", 2)
    assert choose_form(tmp_path, spec, "id", "cpu", 2, measure=measure)[0] == "int8" and len(calls) == 2  # busy now
    load.update(cores=0.0)
    costs["a.onnx"] = _costs(0.005, 0.01, 0.09)  # measured quiet, nbits wins: the noisy choice is replaced
    assert choose_form(tmp_path, spec, "id", "cpu", 2, measure=measure, quiet=True)[0] == "nbits" and len(calls) == 4
    assert not forms_module.noisy_choice(spec, "id", "cpu", 2)
    assert choose_form(tmp_path, spec, "id", "cpu", 2, measure=measure, quiet=True)[0] == "nbits" and len(calls) == 4


def test_forms_far_apart_are_chosen_on_one_wide_pass_each_and_close_ones_measured_again(monkeypatch, tmp_path):
    """The 64-token pass (a second or more on a slow CPU) is timed once per form; forms whose reference turns come
    within DECISIVE of each other are measured again with REPEATS of every width, and those figures decide."""
    from types import SimpleNamespace

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: 0.0)
    spec = SimpleNamespace(weight_forms=(("nbits", "a.onnx"), ("int8", "b.onnx")), onnx_file="a.onnx", role="target")
    calls = []
    first = {"a.onnx": _costs(0.01, 0.02, 0.5), "b.onnx": _costs(0.012, 0.015, 0.1)}  # turns 5.28 s, 2.05 s
    again = {}

    def measure(path, spec, provider, threads, wide_rounds, keep=None):
        name = path.rsplit("/", 1)[-1]
        calls.append((name, wide_rounds))
        return (first if wide_rounds == 1 else again)[name]

    assert forms_module.decisive(first) and not forms_module.decisive({"a": first["a.onnx"], "b": first["a.onnx"]})
    assert choose_form(tmp_path, spec, "far", "cpu", 2, measure=measure)[0] == "int8"
    assert calls == [("a.onnx", 1), ("b.onnx", 1)]
    calls.clear()
    first["b.onnx"] = _costs(0.0095, 0.02, 0.5)  # 3.7% under a.onnx's turn on one wide pass: too close to tell
    again.update({"a.onnx": _costs(0.009, 0.018, 0.45), "b.onnx": _costs(0.0096, 0.02, 0.5)})
    assert choose_form(tmp_path, spec, "close", "cpu", 2, measure=measure)[0] == "nbits"  # the longer measurement's
    assert calls == [("a.onnx", 1), ("b.onnx", 1), ("a.onnx", forms_module.REPEATS), ("b.onnx", forms_module.REPEATS)]


def test_the_last_form_measured_keeps_its_session_only_when_it_wins(monkeypatch, tmp_path):
    """The last form's session is left open for the load when that form wins, freed when it loses, and freed before
    the forms are measured again (one form's weights in memory at a time); planted bugs (never keeping, keeping
    the loser, keeping across a second measurement) fail it."""
    from types import SimpleNamespace

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: 0.0)
    spec = SimpleNamespace(weight_forms=(("nbits", "a.onnx"), ("int8", "b.onnx")), onnx_file="a.onnx", role="target")
    costs = {"a.onnx": _costs(0.01, 0.02, 0.5), "b.onnx": _costs(0.012, 0.015, 0.1)}  # b (the last) wins
    held = []  # what was kept when each form began to be measured

    def measure(path, spec, provider, threads, wide_rounds, keep=None):
        name = path.rsplit("/", 1)[-1]
        held.append(list(keep) if keep is not None else None)
        if keep is not None:
            keep.append(f"session of {name}")
        return costs[name]

    assert choose_form(tmp_path, spec, "last-wins", "cpu", 2, measure=measure) == ("int8", "b.onnx", "session of b.onnx")
    assert held == [None, []]  # only the last form keeps its session
    costs["a.onnx"] = _costs(0.005, 0.01, 0.05)  # a (the first) wins: b's session is not handed on
    assert choose_form(tmp_path, spec, "first-wins", "cpu", 2, measure=measure) == ("nbits", "a.onnx", None)
    held.clear()
    costs["b.onnx"] = _costs(0.0051, 0.01, 0.05)  # too close on one wide pass: measured again, b's first session freed
    choice = choose_form(tmp_path, spec, "close", "cpu", 2, measure=measure)
    assert held == [None, [], None, []] and choice == ("nbits", "a.onnx", None)  # a still wins the longer measurement


def test_a_failed_measurement_keeps_no_session(monkeypatch):
    """A measurement that raises hands on no session (its packed weights are freed, not held by the caller's list)."""
    from types import SimpleNamespace

    class Runner:
        sessions = "the form's session"

        def reset(self):
            pass

    monkeypatch.setattr(forms_module, "make_runner", lambda *args, **kwargs: Runner())
    monkeypatch.setattr(forms_module, "fill_context", lambda runner, count: None)
    monkeypatch.setattr(forms_module, "settle", lambda: None)
    monkeypatch.setattr(forms_module, "collapse_resident", lambda: None)

    def fail(*args, **kwargs):
        raise RuntimeError("a pass failed")

    monkeypatch.setattr(forms_module, "time_passes", fail)
    kept = []
    with pytest.raises(RuntimeError, match="a pass failed"):
        forms_module.measure_form("b.onnx", SimpleNamespace(), "cpu", 2, keep=kept)
    assert kept == []
    monkeypatch.setattr(forms_module, "time_passes", lambda runner, widths, repeats, stop=None, rounds=None:
                        [0.01, 0.02, 0.5])
    assert forms_module.measure_form("b.onnx", SimpleNamespace(), "cpu", 2, keep=kept) == _costs(0.01, 0.02, 0.5)
    assert kept == ["the form's session"]


@pytest.mark.integration
def test_a_first_load_runs_the_session_its_measurement_left_open(two_form_bundle, monkeypatch, tmp_path):
    """Measured for real (sessions, passes), with the pass times fixed: when the last form measured wins, the load
    makes no third session of the target; when the first wins, it makes that one again. Outputs as target-only."""
    from specdec import SpeculativeDecoder
    from specdec.runners import standard

    opened = []
    real_session = standard._session

    def session(onnx_path, providers, threads):
        opened.append(onnx_path.rsplit("/", 2)[-2])
        return real_session(onnx_path, providers, threads)

    monkeypatch.setattr(standard, "_session", session)
    made = {}  # id(runner) -> the folder of the form it was made from
    real_make = forms_module.make_runner

    def make_runner(onnx_path, *args, **kwargs):
        runner = real_make(onnx_path, *args, **kwargs)
        made[id(runner)] = onnx_path.rsplit("/", 2)[-2]
        return runner

    monkeypatch.setattr(forms_module, "make_runner", make_runner)
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: 0.0)
    for winner, fake in (("int8", {"target": (0.01, 0.02, 0.5), "target-int8": (0.012, 0.015, 0.1)}),
                         ("nbits", {"target": (0.005, 0.01, 0.05), "target-int8": (0.012, 0.015, 0.1)})):
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / winner))
        opened.clear()

        def time_passes(runner, widths, repeats, stop=None, rounds=None):  # widths 1, 4, 64
            return list(fake[made[id(runner)]])

        monkeypatch.setattr(forms_module, "time_passes", time_passes)
        decoder = SpeculativeDecoder.load(two_form_bundle)
        assert decoder.weight_form == winner
        targets = [name for name in opened if name.startswith("target")]
        assert targets == (["target", "target-int8"] if winner == "int8" else ["target", "target-int8", "target"])
        fresh = SpeculativeDecoder.load(two_form_bundle, weight_form=winner)  # the same form on a new session
        for mode in ({}, {"num_draft_tokens": 0}):
            assert (decoder.generate("def add(a, b):\n", max_new_tokens=8, **mode).token_ids ==
                    fresh.generate("def add(a, b):\n", max_new_tokens=8, num_draft_tokens=0).token_ids)


@pytest.mark.integration
def test_a_first_measurement_beside_other_work_is_not_repeated_by_the_same_load(two_form_bundle, monkeypatch,
                                                                                 tmp_path):
    """A first load measures the forms beside other work (a noisy choice, stored) and finds the machine quiet
    while it makes the target's session: it runs its choice and leaves measuring again to a later quiet load (a load
    that watched its own fresh measurement measured twice and held two forms at once)."""
    from specdec import SpeculativeDecoder

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    measured = []

    def measure(path, spec, provider, threads, wide_rounds, keep=None):
        measured.append(path)
        return _costs(0.01, 0.02, 0.5) if "target-int8" not in path else _costs(0.012, 0.015, 0.1)

    readings = iter([0.6])  # the measurement's window is busy, every later one quiet
    monkeypatch.setattr(forms_module, "measure_form", measure)
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: next(readings, 0.0))
    assert SpeculativeDecoder.load(two_form_bundle).weight_form == "int8" and len(measured) == 2
    assert SpeculativeDecoder.load(two_form_bundle).weight_form == "int8" and len(measured) == 4  # a later quiet load


def _bytes_by_onnx(path) -> dict:
    """What a one-token pass reads, computed apart with the onnx package: MatMulNBits as MLAS packs it (the codes and
    a float32 scale and block sum per block), the tables Gather nodes read rows of apart, every other initializer
    whole."""
    import numpy as np
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    sizes = {i.name: int(np.prod(i.dims, dtype=np.int64)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
        i.data_type)).itemsize for i in model.graph.initializer}
    streamed, counted, gathered = 0, set(), 0
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            blocks = -(-attrs["K"] // attrs["block_size"])
            streamed += attrs["N"] * blocks * (attrs["block_size"] * attrs.get("bits", 4) // 8 + 8)
            counted.update(node.input[1:])
        elif node.op_type in ("Gather", "GatherBlockQuantized"):
            gathered += sum(sizes.get(name, 0) for name in node.input if name not in counted)
            counted.update(node.input)
    return {"streamed": streamed + sum(v for k, v in sizes.items() if k not in counted), "gathered": gathered}


@pytest.mark.integration
def test_the_bytes_a_one_token_pass_reads_match_the_graph_and_the_int8_form_reads_more(two_form_bundle):
    """contract.onnx_paths.one_token_bytes (no onnx package) against the same count made with onnx, for both of the
    target's forms and the draft; int8 rows read 8 bits a weight where MatMulNBits' blocks of 32 read 6."""
    from specdec.bench.weights_read import target_bytes
    from specdec.contract.manifest import Manifest
    from specdec.contract.onnx_paths import one_token_bytes

    manifest = Manifest.read(two_form_bundle)
    files = dict(manifest.target.weight_forms) | {"draft": manifest.draft.onnx_file}
    counts = {}
    for form, path in files.items():
        counts[form] = one_token_bytes((two_form_bundle / path).read_bytes())
        assert counts[form] == _bytes_by_onnx(two_form_bundle / path), form
    assert counts["int8"]["streamed"] > counts["nbits"]["streamed"] > 0 and counts["nbits"]["gathered"] > 0
    assert target_bytes(two_form_bundle, manifest, "int8") == {"form": "int8", "file": files["int8"], **counts["int8"]}


@pytest.mark.integration
def test_eval_reports_every_weight_form(two_form_bundle):
    from specdec.bench.perplexity import evaluate_bundle

    text = "def add(a, b):\n    return a + b\n" * 40
    results = evaluate_bundle(two_form_bundle, text, roles=("target",), context=64, chunks=2)
    assert set(results) == {"target", "target-int8"}
    assert results["target"].perplexity != results["target-int8"].perplexity  # two forms, two measurements


@pytest.mark.integration
def test_a_form_that_does_not_fit_beside_the_cache_is_left_out(two_form_bundle, monkeypatch, tmp_path):
    """Free memory between the two forms' budgets: the default context is sized for the smaller form (not capped
    by the larger one), only the form that fits runs (nothing measured, nothing stored), a named form that does not
    fit is refused, and a load with room measures both. Planted bugs (the budget of the largest form for the
    default context; forms measured whether they fit or not) fail it."""
    from specdec import SpeculativeDecoder
    from specdec.contract.limits import MAX_DRAFT_TOKENS, PREFILL_CHUNK
    from specdec.contract.manifest import Manifest
    from specdec.decoding import decoder as decoder_module
    from specdec.decoding.suffix_store import DEFAULT_CACHE_MIB
    from specdec.runners.memory import MemoryBudgetError, budget, default_context, fitting_forms, smallest_form

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(forms_module.OtherLoad, "cores", lambda self: 0.0)
    manifest = Manifest.read(two_form_bundle)
    files = dict(manifest.target.weight_forms)
    step, context = max(PREFILL_CHUNK, MAX_DRAFT_TOKENS + 2), 512
    reserved = int(DEFAULT_CACHE_MIB * 2**20)  # the load's default suffix store
    small, large = (budget(two_form_bundle, manifest, context, step, reserved, target_file=files[form]).total
                    for form in ("nbits", "int8"))
    assert small < large and smallest_form(two_form_bundle, manifest) == files["nbits"]
    between = int((small + large) / 2 / 0.9)
    assert list(fitting_forms(two_form_bundle, manifest, between, context, step, reserved=reserved)) == ["nbits"]
    assert list(fitting_forms(two_form_bundle, manifest, between, context, step)) == ["nbits", "int8"]  # RAM caches
    assert list(fitting_forms(two_form_bundle, manifest, None, context, step)) == ["nbits", "int8"]
    trained = min(spec.max_positions for spec in manifest.models().values())
    room = int(budget(two_form_bundle, manifest, trained, step, target_file=files["nbits"]).total / 0.9) + 1
    assert budget(two_form_bundle, manifest, trained, step).total > int(room * 0.9)  # the largest would not fit
    assert default_context(two_form_bundle, manifest, room, step)[0] == trained
    # a named form: the default context is sized for it (a larger one gets a smaller context, not a refusal)
    assert default_context(two_form_bundle, manifest, room, step, target_file=files["int8"])[0] < trained

    measured = []

    def measure(path, spec, provider, threads, wide_rounds, keep=None):
        measured.append(path)
        return _costs(0.01, 0.02, 0.5) if "target-int8" not in path else _costs(0.012, 0.015, 0.1)

    monkeypatch.setattr(forms_module, "measure_form", measure)
    monkeypatch.setattr(decoder_module, "_free_memory", lambda provider: between)
    decoder = SpeculativeDecoder.load(two_form_bundle, max_context=context)
    assert decoder.weight_form == "nbits" and measured == []
    assert decoder.generate("def add(a, b):\n", max_new_tokens=4).token_ids
    with pytest.raises(MemoryBudgetError, match="only"):
        SpeculativeDecoder.load(two_form_bundle, max_context=context, weight_form="int8")
    monkeypatch.setattr(decoder_module, "_free_memory", lambda provider: None)  # room: both measured, int8 wins
    assert SpeculativeDecoder.load(two_form_bundle, max_context=context).weight_form == "int8" and len(measured) == 2
