"""Where a bundle runs: one module per backend (a ``--provider`` name), found by the registry below.

A module of this package that defines ``BACKEND = Backend(...)`` is a backend: the CLI's ``--provider`` choices,
``SpeculativeDecoder.load``'s check of ``provider``, the session's onnxruntime providers, where the KV cache lives
and how much memory a load may take all read this registry, so adding a backend is adding one module (and its
tests).

- ``cpu`` (cpu.py): onnxruntime's CPU provider, every graph form;
- ``cuda`` (cuda.py): onnxruntime's CUDA provider, the standard form, the cache on the device;
- ``tensorrt`` (tensorrt.py): onnxruntime's TensorRT provider (CUDA for what it cannot take);
- ``tensorrt-native`` (tensorrt_native.py): TensorRT engines built by ``specdec-export --engine tensorrt``
  (runners/tensorrt/), which build all of a bundle's runners themselves.

The NVIDIA backends have never run on a GPU here: their registry entries and refusals are tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from specdec.contract.package_modules import package_modules


@dataclass(frozen=True)
class Backend:
    """One ``--provider`` choice.

    ``providers``: onnxruntime's execution providers for a session, first the one this backend needs (empty: the
    backend makes no onnxruntime session and ``bundle_runners`` builds every runner); ``device_memory``: the cache
    and weights live in the GPU's memory (a load is budgeted against its free memory, the cache kept there);
    ``fused_form``: onnxruntime's fused graph (GroupQueryAttention on a host-side shared cache) runs here;
    ``bundle_runners``: ``"module:function"`` of a factory ``(bundle_root, manifest, max_context) -> {role:
    Runner}``, imported only when this backend is asked for; ``missing``: what to install when its provider is
    absent; ``rank``: its place in the CLI's choices."""

    name: str
    help: str
    providers: tuple = ()
    device_memory: bool = False
    fused_form: bool = False
    bundle_runners: str | None = None
    missing: str = "install onnxruntime"
    rank: int = 100


@lru_cache(maxsize=1)
def backends() -> dict:
    """name -> Backend of every backend module in this package, in rank order."""
    found = [module.BACKEND for module in package_modules(__name__, __path__)
             if isinstance(getattr(module, "BACKEND", None), Backend)]
    return {entry.name: entry for entry in sorted(found, key=lambda entry: (entry.rank, entry.name))}


def backend_names() -> tuple:
    return tuple(backends())


def backend(name: str) -> Backend:
    """The backend called ``name``; a one-line ValueError naming the choices otherwise."""
    found = backends().get(name)
    if found is None:
        raise ValueError(f"provider {name!r} is not one of {', '.join(backends())}")
    return found
