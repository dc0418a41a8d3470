"""Session traces for ``specdec bench --session``, built from this Python's standard library.

Nothing of the library is stored in the repository: ``tools/inputs/make_traces.py OUT_DIR`` writes the
traces from ``inspect.getsource`` of stdlib modules. The same Python gives the same traces
(``make_traces`` is deterministic; each trace names the Python version it came from). Token
counts are estimated from characters (``CHARS_PER_TOKEN``, measured on Qwen2.5's tokenizer over
stdlib sources); the session report gives the servers' own prompt token counts.

A trace: ``{"name", "description", "python", "requests": [...]}``; a request is one of

- ``{"route": "chat", "conversation": ID, "user": TEXT, "max_tokens": N}``: the next user turn of
  conversation ID; the replay sends the conversation so far with, as assistant turns, the replies
  the server actually gave, then this turn;
- ``{"route": "completion", "prompt": TEXT, "max_tokens": N}``: ``/v1/completions``;
- ``{"route": "infill", "input_prefix", "input_suffix", "input_extra": [{"filename", "text"}],
  "prompt": "", "n_predict": N}``: llama.cpp's native ``/infill`` as llama.vscode sends it
  (``n_predict: 0`` is its warm-up request, which only fills the cache).
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
from pathlib import Path

CHARS_PER_TOKEN = 4.4  # Qwen2.5's tokenizer on stdlib sources: 3.5 to 4.8 characters a token
ROUTES = ("chat", "completion", "infill")

CHAT_MODULE = "linecache"  # ~1,200 tokens (1,196 with Qwen2.5's tokenizer on Python 3.11)
CHAT_TURNS = ("Here is a Python module:\n\n```python\n{source}```\n\nWhat does this module do? Answer briefly.",
              "Which function would you call to read one line of a file, and what happens when the file is missing?",
              "Is there any thread-safety concern in how the cache is updated? Point to the code.",
              "Write a short unit test for getline using a temporary file.")
CHAT_MAX_TOKENS = 128

FIM_MODULE, FIM_EXTRA_MODULE = "fnmatch", "glob"
FIM_START_LINE, FIM_STEP, FIM_REQUESTS, FIM_N_PREDICT = 40, 2, 12, 24
FIM_EXTRA_LINES = 40  # llama.vscode's input_extra: a chunk of another open file

EDITOR_MODULE, EDITOR_START_LINE, EDITOR_STEP, EDITOR_REQUESTS, EDITOR_MAX_TOKENS = "fnmatch", 90, 2, 12, 24

LONG_MODULES = ("textwrap", "queue", "shlex")
LONG_TOKENS, LONG_MAX_TOKENS = 1500, 128

EDIT_FUNCTIONS = (("textwrap", "dedent"), ("difflib", "get_close_matches"), ("shlex", "quote"))
EDIT_INSTRUCTIONS = ("Add type hints to this function. Reply with the whole function only.",
                     "Now add a docstring with one example. Reply with the whole function only.",
                     "Now rename the local variables to more descriptive names. Reply with the whole function only.")
EDIT_MAX_TOKENS = 384

# agents whose outputs repeat across requests (separate chats): suffix proposals' shared store
TESTS_MODULE = "bisect"  # ~800 tokens
TESTS_FUNCTIONS = ("bisect_right", "bisect_left", "insort_right", "insort_left")
TESTS_INSTRUCTION = "Write pytest unit tests for `{function}` of this module. Reply with the test code only."
TESTS_MAX_TOKENS = 256
REVIEW_MODULE = "colorsys"  # ~1,100 tokens
REVIEW_EDITS = ((), (("ONE_SIXTH = 1.0/6.0", "ONE_SIXTH = 1 / 6"),),
                (("ONE_SIXTH = 1.0/6.0", "ONE_SIXTH = 1 / 6"), ("def rgb_to_yiq(", "def rgb_to_yiq_fast(")))
# a file-reading agent: a repository's files pasted into one chat, then questions whose answers quote them
AGENT_MODULES = ("configparser", "argparse", "tempfile", "shutil", "textwrap", "shlex", "queue")
AGENT_SIZES = (8000, 16000, 30000)  # prompt tokens of the long-context traces (30k: a 32k context's agent turn)
AGENT_TURNS = ("Which method of RawConfigParser reads a file, and what happens when the file is missing? Quote the "
               "code.",
               "Now show where interpolation is applied when a value is read, quoting the method.",
               "Write a short example that reads an INI string with one section and prints one value.")
AGENT_MAX_TOKENS = 128
REVIEW_QUESTION = "List every function of this module with a one-line summary of what it computes."
REVIEW_MAX_TOKENS = 192


def python_version() -> str:
    return platform.python_version()


def _source(name: str) -> str:
    return inspect.getsource(importlib.import_module(name))


def _cut(text: str, tokens: int) -> str:
    """``text`` cut to about ``tokens`` tokens, back to the last line break."""
    cut = text[: int(tokens * CHARS_PER_TOKEN)]
    return cut[: cut.rfind("\n") + 1] or cut


def _trace(name: str, description: str, requests: list) -> dict:
    return {"name": name, "description": description, "python": python_version(), "requests": requests}


def chat_trace() -> dict:
    source = _source(CHAT_MODULE)
    requests = [{"route": "chat", "conversation": "paste", "user": turn.format(source=source) if i == 0 else turn,
                 "max_tokens": CHAT_MAX_TOKENS} for i, turn in enumerate(CHAT_TURNS)]
    return _trace("chat-paste", f"4-turn chat over the pasted source of {CHAT_MODULE}.py (history resent each turn)",
                  requests)


def fim_trace() -> dict:
    lines = _source(FIM_MODULE).splitlines(keepends=True)
    extra = "".join(_source(FIM_EXTRA_MODULE).splitlines(keepends=True)[:FIM_EXTRA_LINES])
    input_extra = [{"filename": f"{FIM_EXTRA_MODULE}.py", "text": extra}]

    def request(line: int, n_predict: int) -> dict:
        return {"route": "infill", "input_prefix": "".join(lines[:line]), "input_suffix": "".join(lines[line:]),
                "input_extra": input_extra, "prompt": "", "n_predict": n_predict}

    requests = [request(FIM_START_LINE, 0)]  # llama.vscode's warm-up: fills the cache, generates nothing
    requests += [request(FIM_START_LINE + FIM_STEP * k, FIM_N_PREDICT) for k in range(FIM_REQUESTS)]
    return _trace("fim-typing", f"editor typing in {FIM_MODULE}.py: a warm-up (n_predict 0), then {FIM_REQUESTS} "
                  f"/infill requests, the cursor {FIM_STEP} lines further each time", requests)


def editor_trace() -> dict:
    """Completion at the end of a growing file (no suffix): the shape of an editor completing as one types on."""
    lines = _source(EDITOR_MODULE).splitlines(keepends=True)
    requests = [{"route": "completion", "prompt": "".join(lines[: EDITOR_START_LINE + EDITOR_STEP * k]),
                 "max_tokens": EDITOR_MAX_TOKENS} for k in range(EDITOR_REQUESTS)]
    return _trace("editor-completion", f"the first {EDITOR_START_LINE} lines of {EDITOR_MODULE}.py, {EDITOR_STEP} lines "
                  f"more each request, {EDITOR_MAX_TOKENS} tokens each ({EDITOR_REQUESTS} requests)", requests)


def long_trace() -> dict:
    requests = [{"route": "completion", "prompt": _cut(_source(name), LONG_TOKENS), "max_tokens": LONG_MAX_TOKENS}
                for name in LONG_MODULES]
    return _trace("long-completion", f"~{LONG_TOKENS}-token stdlib sources ({', '.join(LONG_MODULES)}) continued "
                  f"for {LONG_MAX_TOKENS} tokens", requests)


def agent_trace(tokens: int) -> dict:
    """A coding agent's chat after reading files: ``tokens`` tokens of stdlib sources (whole files, the last cut),
    each under its path, then questions about the first file and follow-ups (history resent each turn)."""
    parts, left = [], tokens
    for name in AGENT_MODULES:
        source = _source(name)
        whole = len(source) <= left * CHARS_PER_TOKEN
        parts.append(f"### Lib/{name}.py\n```python\n{source if whole else _cut(source, left)}```\n")
        left -= int(len(source) / CHARS_PER_TOKEN)
        if not whole or left <= 0:
            break
    files = "Here are the files I read from the repository:\n\n" + "\n".join(parts)
    requests = [{"route": "chat", "conversation": "repository", "user": f"{files}\n{turn}" if i == 0 else turn,
                 "max_tokens": AGENT_MAX_TOKENS} for i, turn in enumerate(AGENT_TURNS)]
    return _trace(f"repo-agent-{tokens // 1000}k", f"a chat after ~{tokens} tokens of pasted stdlib files "
                  f"({', '.join(AGENT_MODULES[:len(parts)])}), then {len(AGENT_TURNS) - 1} follow-ups", requests)


def edit_trace() -> dict:
    requests = []
    for module, function in EDIT_FUNCTIONS:
        source = inspect.getsource(getattr(importlib.import_module(module), function))
        for i, instruction in enumerate(EDIT_INSTRUCTIONS):
            user = f"```python\n{source}```\n\n{instruction}" if i == 0 else instruction
            requests.append({"route": "chat", "conversation": f"{module}.{function}", "user": user,
                             "max_tokens": EDIT_MAX_TOKENS})
    return _trace("edit-agent", "3 stdlib functions, each rewritten under 3 successive instructions in one chat",
                  requests)


def tests_trace() -> dict:
    """Tests for each function of one module, each asked in a new chat: the answers share their boilerplate."""
    source = _source(TESTS_MODULE)
    requests = [{"route": "chat", "conversation": f"tests-{function}",
                 "user": f"```python\n{source}```\n\n{TESTS_INSTRUCTION.format(function=function)}",
                 "max_tokens": TESTS_MAX_TOKENS} for function in TESTS_FUNCTIONS]
    return _trace("tests-agent", f"unit tests for {len(TESTS_FUNCTIONS)} functions of {TESTS_MODULE}.py, each asked "
                  "in a new chat", requests)


def review_trace() -> dict:
    """The same question about successive versions of one file, each in a new chat: the answers repeat."""
    requests = []
    for version, edits in enumerate(REVIEW_EDITS):
        source = _source(REVIEW_MODULE)
        for old, new in edits:
            source = source.replace(old, new)
        requests.append({"route": "chat", "conversation": f"review-{version}",
                         "user": f"```python\n{source}```\n\n{REVIEW_QUESTION}", "max_tokens": REVIEW_MAX_TOKENS})
    return _trace("review-agent", f"one question about {len(REVIEW_EDITS)} successive versions of {REVIEW_MODULE}.py, "
                  "each in a new chat", requests)


def make_traces() -> dict:
    """file name -> trace."""
    return {"chat-paste.json": chat_trace(), "fim-typing.json": fim_trace(), "editor-completion.json": editor_trace(),
            "long-completion.json": long_trace(), "edit-agent.json": edit_trace(), "tests-agent.json": tests_trace(),
            "review-agent.json": review_trace(),
            **{f"repo-agent-{size // 1000}k.json": agent_trace(size) for size in AGENT_SIZES}}


def write_traces(out_dir) -> list:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, trace in make_traces().items():
        (out / name).write_text(json.dumps(trace, indent=1) + "\n")
        written.append(out / name)
    return written


def load_trace(path) -> dict:
    """A trace file, checked: one ValueError line naming the file and the request."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the trace {path}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list) or not data["requests"]:
        raise ValueError(f"{path} must be a trace: an object with a non-empty 'requests' list")
    for index, request in enumerate(data["requests"]):
        where = f"{path}: request {index}"
        if not isinstance(request, dict) or request.get("route") not in ROUTES:
            raise ValueError(f"{where} must be an object whose 'route' is one of {', '.join(ROUTES)}")
        needed = {"chat": ("conversation", "user"), "completion": ("prompt",),
                  "infill": ("input_prefix", "input_suffix")}[request["route"]]
        for key in needed:
            if not isinstance(request.get(key), str):
                raise ValueError(f"{where}: '{key}' must be a string")
    data.setdefault("name", Path(path).stem)
    return data
