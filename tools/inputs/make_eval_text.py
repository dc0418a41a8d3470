"""Write the held-out text of ``specdec eval``: module docstrings of a fixed list of standard library modules.

    python tools/inputs/make_eval_text.py OUT.txt
    specdec eval BUNDLE --text OUT.txt
    llama-perplexity -m TARGET.gguf -f OUT.txt -c 512

Deterministic for a given Python: the modules' ``__doc__`` (``inspect.cleandoc``) in the order below,
each under a ``# module`` line, joined by blank lines, UTF-8, one trailing newline. Nothing is copied
into the repository; the file's sha256 and the Python version are printed, to record beside results.
About 6,500 tokens with the Qwen2.5 tokenizer on Python 3.11 (12 chunks of 512).
"""

import argparse
import hashlib
import importlib
import inspect
import platform
import sys
from pathlib import Path

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    data = eval_text().encode("utf-8")
    args.out.write_bytes(data)
    print(f"wrote {args.out}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}, "
          f"Python {platform.python_version()} ({len(MODULES)} modules)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
