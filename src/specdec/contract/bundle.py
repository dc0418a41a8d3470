"""Open a bundle safely: manifest, file hashes, paths that stay inside the bundle.

Trusted: the manifest's format, and a file once its sha256 matches the manifest.
Checked before onnxruntime opens anything:
- every path in the manifest resolves inside the bundle (no absolute paths, no ``..``, no
  symlink leading out);
- every external-data location inside each ONNX file also resolves inside the bundle and is
  itself a hashed file of the manifest;
- every file's sha256 matches the manifest. A verified file is remembered in a small cache
  keyed by (path, size, mtime, ctime, inode); a file changed in any of these is hashed again.
  ``ctime`` cannot be set back by a user, so the fast path does not trust a forged mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdec.contract.manifest import BundleError, Manifest
from specdec.contract.onnx_paths import ProtobufError, external_data_locations


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inside(root: Path, relative: str) -> Path:
    """Resolve ``relative`` under ``root``; refuse absolute paths, '..' and symlinks leading out."""
    if not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise BundleError(f"bundle path {relative!r} points outside the bundle: refused")
    path = root / relative
    resolved = path.resolve()
    if root.resolve() not in resolved.parents:
        raise BundleError(f"bundle path {relative!r} resolves outside the bundle ({resolved}): refused")
    return path


class HashCache:
    """sha256 results remembered across loads, keyed by file identity (see module docstring).

    The cache file is an optimisation only: unreadable, of another shape (``null``, ``[]``), or with
    malformed entries, it is ignored (bad entries dropped) and rewritten, never an error.
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict = {}
        self.dirty = False
        if path is None:
            return
        try:
            loaded = json.loads(path.read_bytes()) if path.is_file() else {}
        except (OSError, ValueError):  # ValueError: bad JSON or bad UTF-8
            loaded, self.dirty = {}, True
        if not isinstance(loaded, dict):
            loaded, self.dirty = {}, True
        self.entries = {key: entry for key, entry in loaded.items() if _valid_entry(entry)}
        self.dirty = self.dirty or len(self.entries) != len(loaded)

    @staticmethod
    def _identity(path: Path) -> list:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def sha256(self, path: Path) -> str:
        key = str(path.resolve())
        identity = self._identity(path)
        entry = self.entries.get(key)
        if entry and entry[0] == identity:
            return entry[1]
        digest = sha256_file(path)
        self.entries[key] = [identity, digest]
        self.dirty = True
        return digest

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            temporary.write_text(json.dumps(self.entries))
            os.replace(temporary, self.path)
        except OSError:
            pass  # the cache is an optimisation only


def _valid_entry(entry) -> bool:
    """[[size, mtime_ns, ctime_ns, inode], sha256 hex] as ``HashCache.sha256`` writes it."""
    return (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and len(entry[0]) == 4
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[0])
            and isinstance(entry[1], str) and len(entry[1]) == 64)


def cache_dir() -> Path:
    """specdec's per-user cache folder (verified hashes, measured pass costs, joined model files, the demo's
    bundle): ``$SPECDEC_CACHE``, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def default_hash_cache() -> Path:
    return cache_dir() / "verified-hashes.json"


def open_bundle(bundle_dir: str | Path, verify: bool = True, hash_cache: Path | None = None) -> Manifest:
    """Read and check a bundle. ``verify``: check every file's sha256 against the manifest."""
    root = Path(bundle_dir)
    manifest = Manifest.read(root)
    needed = {manifest.tokenizer_file} | {path for spec in manifest.models().values() for path in spec.files()}
    for relative in needed:
        if relative not in manifest.files:
            raise BundleError(f"manifest.json does not list a hash for {relative}: the bundle is incomplete")
    for relative in manifest.files:
        if not inside(root, relative).is_file():
            raise BundleError(f"bundle file {relative} is missing: re-export the bundle")
    for spec in manifest.models().values():
        for path in spec.files():
            _check_external_data(root, path, manifest.files)
    if verify:
        cache = HashCache(hash_cache)
        for relative, expected in manifest.files.items():
            if cache.sha256(inside(root, relative)) != expected:
                raise BundleError(
                    f"bundle file {relative} does not match its sha256 in manifest.json: corrupted or tampered"
                )
        cache.save()
    return manifest


def _check_external_data(root: Path, onnx_file: str, hashed: dict) -> None:
    onnx_path = inside(root, onnx_file)
    try:
        locations = external_data_locations(onnx_path.read_bytes())
    except ProtobufError as exc:
        raise BundleError(f"{onnx_file} is not a readable ONNX model ({exc}): corrupted or tampered") from None
    folder = Path(onnx_file).parent
    for location in locations:
        relative = (folder / location).as_posix() if not Path(location).is_absolute() else location
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise BundleError(f"{onnx_file} refers to external data {location!r} outside the bundle: refused")
        inside(root, relative)
        if relative not in hashed:
            raise BundleError(f"{onnx_file} refers to external data {location!r} that manifest.json does not hash: refused")
