"""The one place a runner is chosen: onnxruntime's runners by the graph form a bundle records, and the backends
that build all of a bundle's runners themselves (TensorRT's engines), by provider name.

``make_runner`` picks FoldedRunner (runners/folded.py: folded attention), FusedRunner (runners/fused.py:
GroupQueryAttention on a shared KV buffer) or ModelRunner (runners/standard.py: the standard form).
``backend_for(provider)`` answers a whole-bundle backend (runners/backends/: a ``Backend`` with ``bundle_runners``),
imported only when that provider is asked for: the runtime never imports the engines package otherwise.
"""

from __future__ import annotations

import importlib

from specdec.contract.manifest import ModelSpec
from specdec.runners.backends import backend
from specdec.runners.folded import FoldedRunner
from specdec.runners.fused import FusedRunner
from specdec.runners.standard import ModelRunner

def runner_class(spec: ModelSpec) -> type:
    """The onnxruntime runner of ``spec``'s graph form."""
    if spec.graph == "fused":
        return FoldedRunner if spec.attention == "folded" else FusedRunner
    return ModelRunner


def make_runner(onnx_path: str, spec: ModelSpec, provider: str, max_context: int, max_step_tokens: int,
                threads: int | None = None, kept_ids=None, session=None):
    """The runner for ``spec``'s graph form (``runner_class``). ``kept_ids``: a pruned draft's vocabulary
    (runners/vocab_map.py); ``session``: one made already, or DEFERRED (runners/sessions.py)."""
    return runner_class(spec)(onnx_path, spec, provider, max_context, max_step_tokens, threads, session=session,
                              kept_ids=kept_ids)


def backend_for(provider: str):
    """The whole-bundle runner factory registered for ``provider``, or None (onnxruntime's runners, per model)."""
    where = backend(provider).bundle_runners
    if where is None:
        return None
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)
