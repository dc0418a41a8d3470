"""The held-out text ``specdec eval`` scores by default: module docstrings of a fixed list of standard library modules.

Deterministic for a given Python: the modules' ``__doc__`` (``inspect.cleandoc``) in the order below, each under a
``# module`` line, joined by blank lines, one trailing newline. Nothing is copied into the repository; the text's
sha256 and the Python version are what to record beside a result (``specdec eval --write-text FILE`` writes the
file ``llama-perplexity -f`` reads). About 6,500 tokens with the Qwen2.5 tokenizer on Python 3.11 (12 chunks of
512; sha256 ``4d8edefe...be879f`` on Python 3.11.7).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import platform

MODULES = (
    "re", "json", "argparse", "unittest", "heapq", "itertools", "doctest", "subprocess", "typing", "difflib",
    "collections", "string", "pickle", "tarfile", "pydoc", "optparse", "tokenize", "codecs", "inspect", "ast",
)


def eval_text(modules=MODULES) -> str:
    parts = []
    for name in modules:
        doc = inspect.cleandoc(importlib.import_module(name).__doc__ or "")
        if doc:
            parts.append(f"# {name}\n\n{doc}")
    return "\n\n".join(parts) + "\n"


def describe(text: str) -> str:
    """What identifies a text beside a result: its bytes, sha256 and this Python's version."""
    data = text.encode("utf-8")
    return (f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}, Python {platform.python_version()} "
            f"({len(MODULES)} modules)")
