"""The command line's own behaviour: one-line errors with exit code 2."""

from __future__ import annotations


def test_a_missing_optional_module_is_one_line_naming_its_extra(monkeypatch, capsys):
    """specdec serve --ray without ray (and any command whose optional import fails): exit 2, one line, the extra."""
    import builtins

    from specdec.cli import serve
    from specdec.cli.main import main

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    monkeypatch.setattr(serve, "_show_logs", lambda: None)
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    assert main(["serve", "bundle-that-is-not-read", "--ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'ray'" in err and '.[ray]' in err


def test_serve_names_a_missing_chat_template_file_in_one_line(monkeypatch, capsys, tmp_path):
    from specdec.cli import serve
    from specdec.cli.main import main
    from specdec.decoding import load_options

    monkeypatch.setattr(serve, "_show_logs", lambda: None)
    monkeypatch.setattr(load_options, "BackgroundLoad", lambda *args, **kwargs: None)  # nothing is loaded
    assert main(["serve", str(tmp_path), "--chat-template-file", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: --chat-template-file ") and "is not a file" in err
