"""specdec info: the bundle's models and forms from its manifest, and what loads stored about this machine; nothing
stored yet says so; a bad bundle is one line."""

import json

import pytest

from specdec.cli.main import main

pytestmark = pytest.mark.integration


def test_info_before_and_after_a_load(tiny_bundle, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert main(["info", str(tiny_bundle)]) == 0
    out = capsys.readouterr().out
    assert "target: " in out and "draft: " in out and "nothing measured yet" in out

    from specdec import SpeculativeDecoder

    SpeculativeDecoder.load(tiny_bundle).costs()
    assert main(["info", str(tiny_bundle)]) == 0
    out = capsys.readouterr().out
    assert "nothing measured yet" not in out
    assert "row checks (" in out and "pass costs (" in out and " threads" in out
    assert main(["info", str(tiny_bundle), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = {(item["kind"], item["key"].get("checks")) for item in report["stored"]}
    assert ("checks", "rows") in kinds and ("costs", None) in kinds
    assert set(report["models"]) == {"target", "draft"}
    assert all(form["bytes"] > 0 for model in report["models"].values() for form in model["weight_forms"].values())
    assert all(0 < form["one_token_bytes"] < form["bytes"] for model in report["models"].values()
               for form in model["weight_forms"].values())


def test_info_of_a_missing_bundle_is_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
