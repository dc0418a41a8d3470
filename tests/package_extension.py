"""Adds modules to a registry's package for one test: the way the registry tests show that a new proposer, backend
or dialect is one module and nothing else."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def package_with(monkeypatch, package, registry, folder, files: dict):
    """``files`` (file name -> source) written to ``folder``, which joins ``package``'s search path while the block
    runs; ``registry`` (an lru_cache'd finder) is emptied before and after, so it reads the package as it is."""
    for name, text in files.items():
        (folder / name).write_text(text)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    registry.cache_clear()
    try:
        yield
    finally:
        registry.cache_clear()
