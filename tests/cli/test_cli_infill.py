"""`specdec infill`: its arguments are checked before anything loads; a bundle without FIM tokens is one line."""

from __future__ import annotations

import pytest

from specdec.cli.main import main


@pytest.mark.parametrize("args, message", [
    ([], "give --prefix"),
    (["--file", "{file}"], "--line must be in 1..3"),
    (["--file", "{file}", "--line", "9"], "--line must be in 1..3"),
    (["--file", "{file}", "--line", "2", "--prefix", "x"], "drop --prefix"),
])
def test_bad_arguments_are_one_line_before_loading(tmp_path, capsys, args, message):
    source = tmp_path / "code.py"
    source.write_text("a = 1\nb = 2\n")
    code = main(["infill", str(tmp_path / "no-bundle"), *[a.format(file=source) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_bundle_without_fim_tokens_is_refused_in_one_line(tiny_bundle, capsys):
    code = main(["infill", str(tiny_bundle), "--prefix", "def f():\n", "--suffix", "\n"])
    err = capsys.readouterr().err
    assert code == 2 and "no fill-in-the-middle tokens" in err
