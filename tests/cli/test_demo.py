"""``specdec demo`` on the tiny chat bundle: both tasks, every mode's row, greedy outputs identical across modes."""

from specdec.cli.main import main


def test_demo_prints_both_tasks_and_each_modes_speed(chat_bundle, capsys):
    assert main(["demo", "--bundle", str(chat_bundle), "--max-new-tokens", "8", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("completion ", "edit "))]
    assert [(row[0], " ".join(row[1:3])) for row in rows] == [
        (task, mode) for task in ("completion", "edit") for mode in ("target only", "draft model", "auto (default)")]
    assert all(row[-1] == "yes" for row in rows), out
    assert "--- completion" in out and "--- edit" in out


def test_every_demo_run_starts_cold(chat_bundle, monkeypatch):
    """No run sees an earlier run's output in the suffix store or its tokens in the KV cache (a timed ``auto`` run
    matching the warm-up's answer would be a cherry-picked speedup)."""
    from specdec.cli import demo
    from specdec.decoding.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(chat_bundle)
    seen, generate = [], decoder.generate

    def checked(ids, **options):
        seen.append((decoder.suffix_cache.used, decoder.cached_prefix(ids)))
        return generate(ids, **options)

    monkeypatch.setattr(decoder, "generate", checked)
    demo.run_demo(decoder, 6, 1)
    assert len(seen) == 12 and all(used == cached == 0 for used, cached in seen), seen


def test_demo_bad_options_are_one_line(capsys, tmp_path):
    assert main(["demo", "--bundle", str(tmp_path), "--repeat", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_demo_explains_a_rounding_cpu_and_takes_exact_rows(chat_bundle, capsys, monkeypatch, tmp_path):
    """On a CPU whose one-row pass rounds otherwise the demo pads one-token passes and says so; with
    --no-exact-rows it does not, and says why a mode may read NO."""
    from specdec.decoding import decoder as decoder_module

    loaded = []
    load = decoder_module.SpeculativeDecoder.load.__func__

    def spy(cls, *args, **kwargs):
        loaded.append(load(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "load", classmethod(spy))
    argv = ["demo", "--bundle", str(chat_bundle), "--max-new-tokens", "4", "--repeat", "1"]
    assert main(argv + ["--exact-rows"]) == 0
    assert loaded[-1].target.pad_one_row and "--exact-rows keeps" not in capsys.readouterr().out
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "rounding"))  # this CPU's stored row checks do not apply
    monkeypatch.setattr(decoder_module, "row_gaps", lambda runner: {"one_row": 0.25, "two_rows": 0.0,
                                                                    "argmax_equal": True})
    assert main(argv) == 0
    assert loaded[-1].target.pad_one_row and "ran as two rows" in capsys.readouterr().out
    assert main(argv + ["--no-exact-rows"]) == 0
    assert not loaded[-1].target.pad_one_row and "without --no-exact-rows" in capsys.readouterr().out
