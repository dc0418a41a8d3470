"""The one way a registry finds its members: every module of a package, imported (proposers, runner backends and
API dialects each keep the modules that define their entry)."""

from __future__ import annotations

import importlib
import pkgutil


def package_modules(package: str, path) -> list:
    """Every module of the package named ``package`` whose search path is ``path`` (its ``__path__``), imported."""
    return [importlib.import_module(f"{package}.{info.name}") for info in pkgutil.iter_modules(path)]
