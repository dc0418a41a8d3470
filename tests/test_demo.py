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
