"""The wire dialects the server speaks, one module each, found by ``dialects()`` below.

A module of this package that defines ``RANK`` (an int: the order dialects mount their routes in) and
``mount(app, engine, server)`` is a dialect, so adding a dialect is adding one module (and its tests). A dialect
module turns its request bodies into ``GenerationOptions`` and chat turns, runs them through the shared ``Engine``
(serving/jobs.py) and writes the answers in its own shapes. A module that answers errors in a shape other than
OpenAI's also has ``owns_errors(path)`` and ``error_response(status, message, ...)``. Helpers of a dialect
(``llama_info``, ``llama_slots``) define no ``RANK``: their dialect mounts them.

- ``openai`` (10): chat completions, completions, models, with and without ``/v1``;
- ``responses`` (20): the Responses API;
- ``anthropic`` (30): the Messages API;
- ``llama`` (40): llama-server's native routes.
"""

from __future__ import annotations

from functools import lru_cache

from specdec.contract.package_modules import package_modules


@lru_cache(maxsize=1)
def dialects() -> tuple:
    """Every dialect module of this package, in ``RANK`` order."""
    found = [module for module in package_modules(__name__, __path__)
             if isinstance(getattr(module, "RANK", None), int) and callable(getattr(module, "mount", None))]
    return tuple(sorted(found, key=lambda module: (module.RANK, module.__name__)))
