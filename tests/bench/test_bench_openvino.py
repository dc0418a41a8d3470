"""The OpenVINO GenAI peer without OpenVINO: its worker processes run against stand-in ``openvino`` and
``openvino_genai`` modules (written to a folder on PYTHONPATH), so the protocol, the modes, the draft's
conversion and cleanup, the records and the one-line errors are tested; the real library's timings are
in benchmarks/results (it is not a test dependency)."""

import json
import os
import sys
import textwrap

import pytest

from specdec.bench import bench
from specdec.bench import openvino_peer as ovp
from specdec.cli.main import main

# generate answers the prompt ids reversed, then the mode's mark and the thread count: the test sees that its ids,
# its mode and its properties reached the pipeline
STAND_IN = textwrap.dedent('''
    import os

    class Tensor:
        def __init__(self, array):
            self.data = array

    class _Mean:
        def __init__(self, value):
            self.mean = value

    class _Metrics:
        def get_ttft(self):
            return _Mean(12.5)

    class _Result:
        def __init__(self, tokens):
            self.tokens = [tokens]
            self.perf_metrics = _Metrics()

    class _Config:
        max_new_tokens = 0
        do_sample = True
        num_assistant_tokens = 0
        max_ngram_size = 0

    class TokenizedInputs:
        def __init__(self, ids, mask):
            self.input_ids, self.attention_mask = ids, mask

    def draft_model(path, device, **properties):
        if not os.path.isfile(os.path.join(path, "openvino_model.xml")):
            raise RuntimeError("no IR in " + path)
        return ("draft", path)

    class LLMPipeline:
        def __init__(self, path, device, enable_save_ov_model=False, draft_model=None, prompt_lookup=False,
                     **properties):
            if "q5_0" in os.path.basename(path):
                raise RuntimeError("Check 'data != nullptr' failed at gguf.cpp:84:")
            if not os.path.exists(path):
                raise RuntimeError("no such model " + path)
            if enable_save_ov_model:
                open(os.path.join(os.path.dirname(path), "openvino_model.xml"), "w").write("<net/>")
            self.mark = 700 if draft_model else 800 if prompt_lookup else 900
            self.threads = properties["INFERENCE_NUM_THREADS"]
            self.hint = properties.get("INFERENCE_PRECISION_HINT")

        def get_generation_config(self):
            return _Config()

        def generate(self, inputs, config):
            import time

            time.sleep(0.03)  # longer than its time to first token
            assert config.do_sample is False
            ids = [int(i) for i in inputs.input_ids.data[0]]
            extra = [config.num_assistant_tokens, config.max_ngram_size, 1 if self.hint == "f32" else 0]
            return _Result((ids[::-1] + [self.mark, self.threads] + extra)[:config.max_new_tokens])
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    folder = tmp_path / "stand-in"
    folder.mkdir()
    (folder / "openvino_genai.py").write_text(STAND_IN)
    (folder / "openvino.py").write_text("from openvino_genai import Tensor\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    for path in (target, draft):
        path.write_bytes(b"GGUF" + b"\0" * 8)
    return tmp_path


def _encode(text):
    return [ord(c) for c in text]


@pytest.mark.integration  # starts worker processes
def test_each_mode_gets_the_prompt_ids_its_options_and_the_bench_record(stand_in):
    said = []
    peer = ovp.OpenvinoPeer(sys.executable, str(stand_in / "t.gguf"), str(stand_in / "d.gguf"), _encode, 12,
                            said.append, threads=3, draft_tokens=5, properties={"INFERENCE_PRECISION_HINT": "f32"},
                            log_dir=str(stand_in))
    scratch = peer.scratch
    try:
        assert os.path.isfile(os.path.join(scratch, "openvino_model.xml"))  # the draft converted once
        runs = peer({"id": "p", "kind": "code", "prompt": "abc"})
    finally:
        peer.close()
    assert [r["mode"] for r in runs] == list(ovp.MODES)
    marks = {"ov:target": [900, 3, 0, 0, 1], "ov:draft": [700, 3, 5, 0, 1], "ov:lookup": [800, 3, 5, 3, 1]}
    for run in runs:
        assert run["tokens"] == [99, 98, 97] + marks[run["mode"]]
        assert run["new_tokens"] == 8 and run["decode_tokens"] == 7 and run["prefill_seconds"] == 0.0125
        assert run["decode_seconds"] > 0 and run["accepted"] is None and run["rss_mib"] > 0
    assert not os.path.exists(scratch)  # removed at close
    described = peer.describe()
    assert described["ov:draft"]["job"]["draft_gguf"] == "d.gguf" and "draft" not in described["ov:draft"]["job"]
    assert described["ov:target"]["job"]["target"] == "t.gguf"  # a file name, not this machine's path


@pytest.mark.integration  # starts worker processes
def test_no_draft_skips_its_mode_with_a_note(stand_in):
    said = []
    peer = ovp.OpenvinoPeer(sys.executable, str(stand_in / "t.gguf"), None, _encode, 4, said.append, threads=1)
    try:
        assert list(peer.workers) == ["ov:target", "ov:lookup"] and "ov:draft skipped" in peer.notes[0]
    finally:
        peer.close()


@pytest.mark.integration  # starts worker processes
def test_a_draft_the_gguf_reader_cannot_read_is_one_line_naming_the_way_out(stand_in):
    (stand_in / "d-q5_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="--openvino-draft") as caught:
        ovp.OpenvinoPeer(sys.executable, str(stand_in / "t.gguf"), str(stand_in / "d-q5_0.gguf"), _encode, 4,
                         lambda m: None, threads=1, modes=["ov:draft"])
    assert "\n" not in str(caught.value) and "data != nullptr" in str(caught.value)


@pytest.mark.integration  # starts worker processes
def test_a_worker_that_fails_to_load_is_one_line(stand_in):
    with pytest.raises(ValueError, match=r"OpenVINO GenAI \(ov:target\): RuntimeError: no such model"):
        ovp.OpenvinoPeer(sys.executable, str(stand_in / "missing.gguf"), None, _encode, 4, lambda m: None,
                         modes=["ov:target"])


def test_options_are_checked():
    with pytest.raises(ValueError, match="--openvino-modes takes"):
        ovp.parse_modes("ov:target,ov:tree")
    assert ovp.parse_modes(" ov:lookup ") == ["ov:lookup"]
    with pytest.raises(ValueError, match="JSON object"):
        ovp.parse_properties("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        ovp.parse_properties("{bad")
    assert ovp.parse_properties('{"A": "b"}') == {"A": "b"}


@pytest.mark.integration  # starts worker processes
def test_an_interpreter_without_openvino_genai_is_one_line(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(ValueError, match="needs openvino-genai"):
        ovp.check_python(str(python))
    with pytest.raises(ValueError, match="is not an executable file"):
        ovp.check_python(str(tmp_path / "nothing"))


@pytest.mark.parametrize("flags, message", [
    (["--openvino-modes", "ov:x"], "--openvino-modes takes"),
    (["--openvino-draft-tokens", "0"], "--openvino-draft-tokens must be >= 1"),
    (["--openvino-config", "[]"], "--openvino-config must be a JSON object"),
    (["--peer-gguf", "missing.gguf"], "the target GGUF"),
])
def test_bad_openvino_options_are_one_line_before_anything_runs(tmp_path, capsys, flags, message):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"id": "a", "prompt": "def f():"}]))
    (tmp_path / "t.gguf").write_bytes(b"GGUF" + b"\0" * 8)
    gguf = [] if "--peer-gguf" in flags else ["--peer-gguf", str(tmp_path / "t.gguf")]
    code = main(["bench", str(tmp_path / "no-bundle"), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                 "--peer-openvino", *gguf, *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_the_report_names_the_openvino_rows():
    report = {"summary": {}, "costs": {"draft_step": 0.3, "verify": [1.0]}, "spread": {},
              "openvino": {"ov:target": {"job": {"properties": {}}, "version": "2026.4"}, "notes": ["ov:draft skipped"]}}
    text = bench.markdown(report)
    assert "OpenVINO GenAI 2026.4 rows (ov:*)" in text and "its defaults" in text and "ov:draft skipped" in text
