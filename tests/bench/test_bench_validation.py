"""``specdec bench`` checks every input before the first run: one line, exit 2, nothing run, nothing lost."""

import json
import shutil

import pytest

from specdec.bench.bench import build_modes, load_prompts
from specdec.cli.main import main


def write_prompts(tmp_path, data) -> str:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(data))
    return str(path)


def run_bench_cli(capsys, bundle, prompts, *extra):
    code = main(["bench", str(bundle), "--prompts", prompts, *map(str, extra)])
    err = capsys.readouterr().err
    return code, err


GOOD = [{"id": "a", "kind": "code", "prompt": "def f():"}, {"id": "b", "prompt": "x = 1"}]


@pytest.mark.parametrize("data, message", [
    ([], "non-empty JSON list"),
    ({"prompt": "x"}, "non-empty JSON list"),
    (["just a string"], "item 0 must be an object"),
    ([{"prompt": 123}], "item 0: 'prompt' must be a non-empty string, got 123"),
    ([{"prompt": ""}], "item 0: 'prompt' must be a non-empty string"),
    ([{"text": "x"}], "item 0: 'prompt' must be a non-empty string, got null"),
    ([{"prompt": "x", "id": 7}], "item 0: 'id' must be a non-empty string, got 7"),
    ([{"prompt": "x", "kind": ["a"]}], "item 0: 'kind' must be a non-empty string"),
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "item 1: id 'a' is also the id of item 0"),
    ([{"prompt": "x"}, {"id": "0", "prompt": "y"}], "item 1: id '0' is also the id of item 0"),  # implicit ids count
])
def test_bad_prompt_files_are_refused_naming_the_item(tmp_path, data, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_prompts(write_prompts(tmp_path, data), None)


def test_unreadable_prompt_file_and_bad_limit(tmp_path):
    with pytest.raises(ValueError, match="cannot read prompts from"):
        load_prompts(str(tmp_path / "missing.json"), None)
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe[")
    with pytest.raises(ValueError, match="cannot read prompts from"):
        load_prompts(str(tmp_path / "bad.json"), None)
    for limit in (0, -1, True):
        with pytest.raises(ValueError, match="--limit must be an integer >= 1"):
            load_prompts(write_prompts(tmp_path, GOOD), limit)


def test_good_prompts_and_limit():
    """Valid files load with their ids/kinds (defaults: index, 'all'); --limit keeps the first N."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    prompts = load_prompts(write_prompts(folder, GOOD), None)
    assert prompts == [{"id": "a", "kind": "code", "prompt": "def f():"}, {"id": "b", "kind": "all", "prompt": "x = 1"}]
    assert load_prompts(write_prompts(folder, GOOD), 1) == prompts[:1]
    shutil.rmtree(folder)


@pytest.mark.parametrize("draft, proposers, trees, message", [
    ("0,99", "", "", "--draft-tokens: '99' is not a draft length"),
    ("-1", "", "", "--draft-tokens: '-1' is not a draft length"),
    ("two", "", "", "--draft-tokens: 'two' is not a draft length"),
    ("1", "magic", "", "--proposers takes draft, lookup, suffix, hybrid, got 'magic'"),
    ("1", "", "0", "--trees: tree branching factors must be"),
    ("1", "", "2,x", "--trees: tree must be"),
    ("1", "", "8,8", "--trees: '8,8' has 72 nodes, more than the 62"),
])
def test_bad_modes_are_refused_naming_the_option(draft, proposers, trees, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_modes(draft, proposers, trees)


def test_good_modes():
    """Every accepted item becomes a mode; target-only first; 0 means target-only."""
    modes = build_modes("0,1,4,auto", "lookup,hybrid", "2,2,1;auto")
    assert list(modes) == ["0", "1", "4", "auto", "auto:lookup", "auto:hybrid", "tree:2,2,1", "tree:auto"]


@pytest.mark.parametrize("extra, message", [
    (("--repeat", 0), "--repeat must be >= 1, got 0"),
    (("--max-new-tokens", 0), "--max-new-tokens must be >= 1, got 0"),
    (("--temperature", -1), "--temperature must be >= 0"),
    (("--temperature", "nan"), "--temperature must be >= 0"),
    (("--limit", 0), "--limit must be an integer >= 1"),
    (("--trees", "0"), "--trees: tree branching factors"),
    (("--draft-tokens", "0,99"), "--draft-tokens: '99' is not a draft length"),
])
def test_cli_refuses_bad_options_before_loading_anything(tmp_path, capsys, extra, message):
    """The bundle path does not even exist: the option's error comes first, as one line, exit 2."""
    code, err = run_bench_cli(capsys, tmp_path / "no-bundle", write_prompts(tmp_path, GOOD),
                              "--out", tmp_path / "out", *extra)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_unwritable_out_before_loading(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    code, err = run_bench_cli(capsys, tmp_path / "no-bundle", write_prompts(tmp_path, GOOD), "--out", blocker / "out")
    assert code == 2 and err.count("\n") == 1 and f"--out {blocker / 'out'} is not a writable folder" in err, err
    assert blocker.read_text() == "mine"


@pytest.fixture
def draftless_bundle(tiny_bundle, tmp_path):
    """A copy of the tiny bundle whose manifest has no draft model (the draft files stay, unused)."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["draft"] = None
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("extra, message", [
    (("--draft-tokens", "0", "--trees", "2,1"), "mode tree:2,1: "),
    (("--draft-tokens", "0,2"), "mode 2: "),
])
def test_modes_the_bundle_cannot_run_are_refused_before_the_first_run(draftless_bundle, tmp_path, capsys, extra,
                                                                       message):
    code, err = run_bench_cli(capsys, draftless_bundle, write_prompts(tmp_path, GOOD), "--out", tmp_path / "out",
                              *extra)
    assert code == 2 and err.count("\n") == 1 and message in err and "draft model" in err, err
    assert "calibrating" not in err and not (tmp_path / "out" / "bench.json").exists()


def test_prompt_too_long_for_the_context_is_refused_before_the_first_run(tiny_bundle, tmp_path, capsys):
    prompts = write_prompts(tmp_path, [{"id": "short", "prompt": "x"}, {"id": "long", "prompt": "y" * 100}])
    code, err = run_bench_cli(capsys, tiny_bundle, prompts, "--out", tmp_path / "out", "--max-context", 64,
                              "--max-new-tokens", 8, "--draft-tokens", "0,2")
    assert code == 2 and err.count("\n") == 1 and "prompt 'long', mode 0:" in err and "max_context 64" in err, err
    assert "calibrating" not in err
