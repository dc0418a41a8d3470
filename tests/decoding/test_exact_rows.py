"""exact_rows: one-token target passes run as two rows, so greedy speculation equals target-only decoding even
where a one-row pass rounds unlike a row of a wider one (onnxruntime's one-row int4 kernel on an AVX2 CPU)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from scripted import ScriptedModel, ScriptedRunner, scripted_decoder

from specdec.runners.row_parity import check_one_row, row_gaps
from specdec.sampling.processors import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)


class OneRowRounding(ScriptedRunner):
    """A scripted target whose one-token passes round differently, enough to flip near-ties: the CPU case."""

    def _run(self, ids, positions, mask, sliding, past):
        out = super()._run(ids, positions, mask, sliding, past)
        if len(ids) == 1:
            out = out + np.linspace(0.0, 1.5, out.shape[1], dtype=np.float32)  # nudges the higher ids up
        return out

    def _fork(self):
        return OneRowRounding(self.model, self.max_context, self.max_step_tokens)


class WideRounding(ScriptedRunner):
    """One- and two-row passes agree, three rows and more round otherwise: padding to two rows cannot cure it."""

    def _run(self, ids, positions, mask, sliding, past):
        out = super()._run(ids, positions, mask, sliding, past)
        return out + 0.25 if len(ids) >= 3 else out


def _decoder_on_a_rounding_cpu():
    decoder = scripted_decoder(vocab=16, eos=99, seed=3)
    decoder.target = OneRowRounding(decoder.target.model, decoder.max_context)
    return decoder


def test_the_check_sees_a_one_row_pass_that_rounds_differently_and_padding_cures_it():
    runner = OneRowRounding(ScriptedModel(16, 3))
    assert check_one_row(runner) is False
    assert runner.length == 0  # the check leaves the cache empty
    gaps = row_gaps(runner)  # what tools/check/rows_check.py prints
    assert gaps["one_row"] > 0.0 and gaps["two_rows"] == 0.0
    runner.pad_one_row = True
    assert check_one_row(runner) is True
    assert check_one_row(ScriptedRunner(ScriptedModel(16, 3))) is True
    wide = WideRounding(ScriptedModel(16, 3))
    wide.pad_one_row = True
    assert check_one_row(wide) is False  # compared against a wider verify pass, not only against two rows
    assert check_one_row(ScriptedRunner(ScriptedModel(16, 3), max_step_tokens=1)) is None  # cannot tell


def test_a_padded_one_token_pass_runs_two_rows_and_commits_one():
    runner = ScriptedRunner(ScriptedModel(16, 3))
    widths = []
    run = runner._run
    runner._run = lambda ids, *rest: widths.append(len(ids)) or run(ids, *rest)
    runner.forward([1, 2, 3], range(3))
    runner.commit(3)
    plain = np.array(runner.forward([4], [3]))
    runner.pad_one_row = True
    padded = runner.forward([4], [3])
    assert widths == [3, 1, 2] and padded.shape == (1, 16) and np.array_equal(padded, plain)
    runner.commit(1)
    assert runner.length == 4 and runner.held_prefix([1, 2, 3, 4, 5]) == 4
    runner.forward([5], [4])  # the pad row's slot is overwritten, not kept
    assert runner.slot_ids[4] == 5
    runner.forward([5], [4], parents=[-1])  # a one-node tree (the pending token alone) is a chain: padded too
    assert widths[-2:] == [2, 2]


def test_greedy_speculation_equals_target_only_on_a_rounding_cpu_only_with_padding():
    """On the rounding CPU, target-only decoding (one-row passes) and speculation (verify rows) are two greedy
    decodings that part; with one-token passes padded both read multi-row rows and agree token for token."""
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8], [9, 10, 11], [12, 2]]

    def outputs(pad: bool):
        decoder = _decoder_on_a_rounding_cpu()
        decoder.target.pad_one_row = pad
        pairs = []
        for prompt in prompts:
            base = decoder.generate(prompt, max_new_tokens=24, sampling=GREEDY, num_draft_tokens=0).token_ids
            spec = decoder.generate(prompt, max_new_tokens=24, sampling=GREEDY, num_draft_tokens=3).token_ids
            pairs.append(base == spec)
        return pairs

    assert not all(outputs(pad=False))  # the control: without padding the two decodings part on this CPU
    assert all(outputs(pad=True))


def test_load_pads_forks_keep_it_and_calibrations_are_kept_apart(tiny_bundle, monkeypatch, caplog, tmp_path):
    from specdec import SpeculativeDecoder
    from specdec.decoding import decoder as decoder_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    exact = SpeculativeDecoder.load(tiny_bundle, exact_rows=True)
    assert exact.target.pad_one_row and exact.rows_exact and exact.fork().target.pad_one_row
    assert not exact.draft.pad_one_row and not exact.fork().draft.pad_one_row  # only the target's rows matter
    plain = SpeculativeDecoder.load(tiny_bundle)
    assert not plain.target.pad_one_row and plain.rows_exact is True  # this CPU's tiny rows agree: no padding
    assert exact._calibration_key != plain._calibration_key  # a padded one-token pass costs a two-token one
    with pytest.raises(ValueError, match="exact_rows"):
        SpeculativeDecoder.load(tiny_bundle, exact_rows="yes")
    # a CPU whose one-row pass rounds otherwise (the checks a first load stores, as an AVX2 EPYC's read)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "rounding"))
    monkeypatch.setattr(decoder_module, "row_gaps", lambda runner: {"one_row": 0.25, "two_rows": 0.0,
                                                                    "argmax_equal": True})
    with caplog.at_level(logging.INFO, logger="specdec.decoding.decoder"):
        rounding = SpeculativeDecoder.load(tiny_bundle)  # the default: exact, by padding
    assert rounding.target.pad_one_row and rounding.rows_exact is True and "--no-exact-rows" in caplog.text
    assert rounding.fork().target.pad_one_row
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.decoding.decoder"):
        fast = SpeculativeDecoder.load(tiny_bundle, exact_rows=False)
    assert not fast.target.pad_one_row and fast.rows_exact is False and "parts" not in caplog.text
    assert "may part from target-only" in caplog.text


def test_row_checks_are_measured_once_per_machine(tiny_bundle, monkeypatch, tmp_path):
    """A second load reads the first one's row checks (and exact width) from the store: nothing measured twice;
    another CPU (its flags) measures its own."""
    from specdec import SpeculativeDecoder
    from specdec.decoding import calibration_store
    from specdec.decoding import decoder as decoder_module

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    measured_gaps, measured_width = decoder_module.row_gaps, decoder_module.exact_width
    monkeypatch.setattr(decoder_module, "row_gaps", lambda runner: calls.append("gaps") or measured_gaps(runner))
    monkeypatch.setattr(decoder_module, "exact_width", lambda runner: calls.append("width") or measured_width(runner))
    first = SpeculativeDecoder.load(tiny_bundle)
    assert calls == ["gaps", "width"] and (tmp_path / "load-checks.json").is_file()
    second = SpeculativeDecoder.load(tiny_bundle)
    assert calls == ["gaps", "width"]  # read, not measured
    assert (second.rows_exact, second.target.exact_width, second.target.pad_one_row) == (
        first.rows_exact, first.target.exact_width, first.target.pad_one_row)
    monkeypatch.setattr(calibration_store, "cpu_flags_digest", lambda: "another-cpu")
    SpeculativeDecoder.load(tiny_bundle)
    assert calls == ["gaps", "width"] * 2


def test_the_flag_reaches_every_load_path():
    import argparse

    from specdec.cli.args import add_load_args
    from specdec.decoding.load_options import LoadOptions

    parser = argparse.ArgumentParser()
    add_load_args(parser)
    assert parser.parse_args(["--exact-rows"]).exact_rows is True and parser.parse_args([]).exact_rows is None
    assert parser.parse_args(["--no-exact-rows"]).exact_rows is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--exact-rows", "--no-exact-rows"])
    assert LoadOptions(exact_rows=True).load_kwargs()["exact_rows"] is True
    assert LoadOptions(exact_rows=False).load_kwargs()["exact_rows"] is False
    assert "exact_rows" not in LoadOptions().load_kwargs()


def test_every_backend_fork_pads_as_its_parent():
    """Runner.fork carries pad_one_row for every backend (its _fork hook only builds the new runner): a server's
    workers stay exact when the first decoder is."""
    runner = OneRowRounding(ScriptedModel(16, 3))
    runner.pad_one_row = True
    forked = runner.fork()
    assert forked is not runner and forked.pad_one_row and check_one_row(forked) is True
    runner.pad_one_row = False
    assert not runner.fork().pad_one_row
