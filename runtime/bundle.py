"""Open a bundle safely: manifest, file hashes, paths that stay inside the bundle.

Every file listed in the manifest must exist and match its sha256 before any model is
handed to onnxruntime; a file that is missing, changed or outside the bundle is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .manifest import BundleError, Manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inside(root: Path, relative: str) -> Path:
    """Resolve ``relative`` under ``root``; refuse absolute paths, '..' and symlinks leading out."""
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise BundleError(f"bundle path {relative!r} points outside the bundle: refused")
    path = (root / relative)
    resolved = path.resolve()
    if root.resolve() not in resolved.parents:
        raise BundleError(f"bundle path {relative!r} resolves outside the bundle ({resolved}): refused")
    return path


def open_bundle(bundle_dir: str | Path, verify: bool = True) -> Manifest:
    """Read and check a bundle. ``verify``: hash every file against the manifest."""
    root = Path(bundle_dir)
    manifest = Manifest.read(root)
    needed = {manifest.tokenizer_file} | {spec.onnx_file for spec in manifest.models().values()}
    for relative in needed:
        if relative not in manifest.files:
            raise BundleError(f"manifest.json does not list a hash for {relative}: the bundle is incomplete")
    for relative, expected in manifest.files.items():
        path = inside(root, relative)
        if not path.is_file():
            raise BundleError(f"bundle file {relative} is missing: re-export the bundle")
        if verify and _sha256(path) != expected:
            raise BundleError(f"bundle file {relative} does not match its sha256 in manifest.json: corrupted or tampered")
    return manifest
