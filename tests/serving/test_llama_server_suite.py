"""llama-server's own server tests (llama.cpp's tools/server/tests, read from the llama-cpp-python source
distribution by tools/check/llama_server_tests.py) against `specdec serve` on the tiny chat bundle: a handful of files whose
tests do not depend on the model's words. A change that breaks a llama-server client fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import ROOT

pytest.importorskip("wget")  # the suite's utils.py imports it (the test extra installs it)
pytest.importorskip("filelock")

ROOT = ROOT
# tests that must pass against specdec (they pass against llama-server too)
MUST_PASS = [
    "test_security::test_access_public_endpoint[/health]",
    "test_security::test_incorrect_api_key[None]",
    "test_security::test_incorrect_api_key[invalid-key]",
    "test_security::test_correct_api_key",
    "test_security::test_correct_api_key_anthropic_header",
    "test_security::test_openai_library_correct_api_key",
    "test_tokenize::test_tokenize_detokenize",
    "test_completion::test_json_prompt_no_mtmd",
    "test_completion::test_json_prompt_mtm_error_when_not_supported",
    "test_chat_completion::test_invalid_chat_completion_req[messages7]",
]


@pytest.mark.integration
def test_llama_servers_own_tests_pass_against_specdec(chat_bundle, tmp_path):
    command = [sys.executable, str(ROOT / "tools" / "check" / "llama_server_tests.py"), "--bundle", str(chat_bundle),
               "--files", "test_security.py", "test_tokenize.py", "test_completion.py", "test_chat_completion.py",
               "--out", str(tmp_path), "-k", "api_key or public_endpoint or tokenize_detokenize or json_prompt "
               "or invalid_chat_completion_req"]  # (the CORS tests start the router preset at 1,024 tokens of context,
    # more than the tiny bundle has; test_server.py checks the header names as those tests read them)
    if os.environ.get("LLAMA_CPP_SRC"):  # an unpacked llama.cpp tree (else the sdist is downloaded)
        command += ["--llama-src", os.environ["LLAMA_CPP_SRC"]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads((tmp_path / "results.json").read_text())["specdec"]
    failing = [name for name in MUST_PASS if outcomes.get(name) != "passed"]
    assert not failing, (failing, done.stdout[-3000:])
