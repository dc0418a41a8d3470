"""Bench prompt sets built from text every machine has offline (no files of third-party text in the repo).

``long_context_prompts``: prompts of about ``tokens`` tokens (default 1,500) cut from this
Python's standard library: module sources (kind "long-code": continue the code) and pydoc's
plain-text rendering of modules (kind "long-docs"). Each prompt ends at a line break, so
the continuation is the module's next line. The text depends on the Python version: the
ids name it, and the bench reports the prompts' measured token counts, not this target.

``edit_prompts``: kind "edit": a stdlib function under an instruction to rewrite it (type hints,
renamed variables, no comments, a new docstring): the answer repeats most of the prompt, the
case suffix and lookup proposals are for.
"""

from __future__ import annotations

import importlib
import inspect
import platform
import pydoc

LONG_CONTEXT_TOKENS = 1500
LONG_CODE_MODULES = ("argparse", "difflib", "textwrap", "calendar", "json.decoder", "heapq")
LONG_DOCS_MODULES = ("fractions", "statistics")


def long_context_prompts(encode, decode, tokens: int = LONG_CONTEXT_TOKENS, code_modules=LONG_CODE_MODULES,
                         docs_modules=LONG_DOCS_MODULES) -> list:
    """[{id, kind, prompt}]: each module's text cut to at most ``tokens`` tokens of ``encode`` (text -> ids;
    ``decode``: ids -> text), then back to the last line break."""
    if tokens < 16:
        raise ValueError(f"tokens must be >= 16, got {tokens}")
    version = "py" + "".join(platform.python_version_tuple()[:2])
    prompts = []
    for kind, modules, text_of in (("long-code", code_modules, inspect.getsource),
                                   ("long-docs", docs_modules, lambda m: pydoc.plain(pydoc.render_doc(m)))):
        for name in modules:
            text = text_of(importlib.import_module(name))
            ids = encode(text)
            if len(ids) < tokens:
                continue  # shorter than asked in this Python version: not a long prompt
            cut = decode(ids[:tokens])
            cut = cut[: cut.rfind("\n") + 1] or cut
            prompts.append({"id": f"{kind}-{name}-{version}", "kind": kind, "prompt": cut})
    return prompts


# (module, function, instruction): the rewrite repeats most of the function
EDIT_PROMPTS = (
    ("glob", "glob", "Rewrite the function below with type hints added. Keep the body the same."),
    ("textwrap", "indent", "Rewrite the function below with every local variable renamed to a longer, descriptive "
                           "name. Keep everything else the same."),
    ("heapq", "nlargest", "Rewrite the function below without its comments and docstring. Keep the code the same."),
    ("shlex", "split", "Rewrite the function below with a Google-style docstring. Keep the code the same."),
)


def edit_prompts(prompts=EDIT_PROMPTS) -> list:
    """[{id, kind: "edit", prompt}]: each function's source after its instruction, as a comment, then a heading
    the rewrite follows."""
    found = []
    for module, function, instruction in prompts:
        source = inspect.getsource(getattr(importlib.import_module(module), function))
        found.append({"id": f"edit-{module}.{function}-py{platform.python_version()}", "kind": "edit",
                      "prompt": f"# {instruction}\n{source}\n\n# Rewritten:\n"})
    return found
