"""Saved KV caches (llama-server's slot save / restore): one decoder's caches of both models in one file.

Layout (every integer little-endian)::

    MAGIC (8 bytes) | header length (uint32) | header (UTF-8 JSON) | payload | sha256 of all before (32 bytes)

The header: ``{"format": 1, "bundle": <sha256 of the manifest's JSON>, "n_tokens": <target tokens>, "models":
[{"role", "tokens", "shape", "dtype", "bytes"}, ...]}``; the payload, per model in the header's order, its token
ids (int64) and then its keys/values (``shape``, ``dtype``, C order: the runner's own snapshot layout).

A restore reads and checks everything before it touches a cache: the magic, the format, the size the header
describes against the file's (a truncated file), the checksum (a changed byte), the bundle's identity (a file
saved from another bundle), the roles, shapes and dtypes against this decoder's runners, the token ids against
the vocabulary. Any failure is a one-line ``SlotFileError`` and the caches stay as they were. A save writes a
temporary file in the same folder and renames it over the name, so a reader never sees half a file; it never
replaces a file that is not a slot file of this bundle (``SlotFileConflict``). ``slot_path`` keeps a client's
filename inside the save folder. Boundary: files and a decoder's runners; no HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

import numpy as np

from specdec.runners.runner import KVSnapshot

MAGIC = b"SDSLOT\r\n"  # a CR-LF inside: a transfer that rewrites line ends breaks the magic, not the payload silently
FORMAT = 1
MAX_HEADER = 1 << 20
DIGEST = 32
_FORBIDDEN = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


class SlotFileError(ValueError):
    """A slot file that cannot be used (or a filename that is not allowed): one line, nothing loaded."""


class SlotFileConflict(SlotFileError):
    """A save would replace a file that is not a slot file of this bundle."""


class SlotWriteError(SlotFileError):
    """The file could not be written (the folder's permissions, a full disk)."""


class SlotUnsupported(SlotFileError):
    """This backend keeps its KV cache where it cannot be copied to a file (a device cache)."""


def slot_path(folder, filename: str) -> Path:
    """``folder / filename`` for a client's filename: llama.cpp's rules (``fs_validate_filename``: no path
    separator, no "..", no control or reserved characters, no leading or trailing space, no trailing dot) and a
    path that resolves inside ``folder`` (a symlink pointing out is refused)."""
    if not isinstance(filename, str) or not _valid_name(filename):
        raise SlotFileError("Invalid filename")
    root = Path(folder).resolve()
    path = (root / filename).resolve()
    if path.parent != root:
        raise SlotFileError("Invalid filename")
    return path


def _valid_name(name: str) -> bool:
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    if not 0 < size <= 255 or name in (".",) or ".." in name:
        return False
    if name[0] == " " or name[-1] in (" ", "."):
        return False
    return not any(ord(c) <= 0x1F or 0x7F <= ord(c) <= 0x9F or c in _FORBIDDEN for c in name)


def _runners(decoder) -> dict:
    return {role: runner for role, runner in (("target", decoder.target), ("draft", decoder.draft)) if runner is not None}


def save_slot(decoder, path) -> tuple:
    """Write ``decoder``'s caches to ``path``; (target tokens saved, bytes written). The caller holds the decoder."""
    path = Path(path)
    if decoder.identity is None:
        raise SlotUnsupported("this decoder was not loaded from a bundle: it has no identity to key a file by")
    existing = _existing_header(path)
    if existing is not None and existing.get("bundle") != decoder.identity:
        raise SlotFileConflict(f"{path.name} holds a slot of another bundle: not overwritten (choose another "
                               "filename, or delete that file)")
    models, blobs = [], []
    for role, runner in _runners(decoder).items():
        try:
            snapshot = runner.snapshot()
        except NotImplementedError as exc:
            raise SlotUnsupported(f"cannot save the {role}'s KV cache: {exc}") from None
        rows = np.ascontiguousarray(snapshot.rows)
        dtype = rows.dtype.newbyteorder("<")
        ids = snapshot.token_ids.astype("<i8")
        models.append({"role": role, "tokens": int(len(ids)), "shape": list(rows.shape), "dtype": dtype.str,
                       "bytes": int(rows.nbytes)})
        blobs += [ids.tobytes(), rows.astype(dtype, copy=False).tobytes()]
    header = json.dumps({"format": FORMAT, "bundle": decoder.identity, "n_tokens": models[0]["tokens"],
                         "models": models}, separators=(",", ":")).encode()
    pieces = [MAGIC, struct.pack("<I", len(header)), header, *blobs]
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    pieces.append(digest.digest())
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temp, "xb") as out:
            for piece in pieces:
                out.write(piece)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise SlotWriteError(f"cannot write {path.name}: {exc.strerror or exc}") from None
    return models[0]["tokens"], sum(len(piece) for piece in pieces)


def _existing_header(path: Path) -> dict | None:
    """The header of the slot file at ``path``, None when there is no file; SlotFileConflict for a file that
    is not a slot file (a user's own file is never replaced)."""
    if not path.exists():
        return None
    try:
        with open(path, "rb") as handle:
            return _read_header(handle, path.name)[0]
    except (OSError, SlotFileError):
        raise SlotFileConflict(f"{path.name} exists and is not a specdec slot file: not overwritten") from None


def _read_header(handle, name: str) -> tuple:
    """(header dict, its length in bytes) from an open slot file."""
    start = handle.read(len(MAGIC) + 4)
    if len(start) < len(MAGIC) + 4 or start[: len(MAGIC)] != MAGIC:
        raise SlotFileError(f"{name} is not a specdec slot file")
    (length,) = struct.unpack("<I", start[len(MAGIC):])
    if length > MAX_HEADER:
        raise SlotFileError(f"{name}: its header is larger than any slot file writes")
    raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8")) if len(raw) == length else None
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise SlotFileError(f"{name}: its header is truncated or damaged")
    return header, length


def read_slot(decoder, path) -> tuple:
    """Every check on the file at ``path`` against ``decoder``, without touching its caches: ({role:
    KVSnapshot}, bytes read)."""
    path = Path(path)
    name = path.name
    try:
        with open(path, "rb") as handle:
            header, length = _read_header(handle, name)
            models = _check_header(header, decoder, name)
            expected = len(MAGIC) + 4 + length + sum(m["tokens"] * 8 + m["bytes"] for m in models) + DIGEST
            size = os.fstat(handle.fileno()).st_size
            if size != expected:
                raise SlotFileError(f"{name} is truncated or has bytes appended: {size} bytes, its header describes "
                                    f"{expected}")
            handle.seek(0)
            data = handle.read(expected)
    except FileNotFoundError:
        raise SlotFileError(f"{name} does not exist") from None
    except OSError as exc:
        raise SlotFileError(f"cannot read {name}: {exc.strerror or exc}") from None
    if len(data) != expected or hashlib.sha256(data[:-DIGEST]).digest() != data[-DIGEST:]:
        raise SlotFileError(f"{name} fails its checksum: the file was changed or damaged after it was saved")
    if header["bundle"] != decoder.identity:  # after the checksum: the identity read is the one written
        raise SlotFileError(f"{name} was saved from another bundle (manifest sha256 {header['bundle'][:12]}..., "
                            f"this server's is {decoder.identity[:12]}...)")
    snapshots, offset = {}, len(MAGIC) + 4 + length
    vocab = decoder.manifest.target.vocab_size
    for model in models:
        count = model["tokens"]
        ids = np.frombuffer(data, "<i8", count, offset).astype(np.int64)
        offset += count * 8
        rows = np.frombuffer(data, np.dtype(model["dtype"]), int(np.prod(model["shape"])), offset)
        offset += model["bytes"]
        if count and (ids.min() < 0 or ids.max() >= vocab):
            raise SlotFileError(f"{name}: the {model['role']}'s token ids are not in this bundle's vocabulary")
        snapshots[model["role"]] = KVSnapshot(ids, rows.reshape(model["shape"]))
    return snapshots, expected


def _check_header(header: dict, decoder, name: str) -> list:
    """The header's models, checked against ``decoder``'s runners (roles, token counts, shapes, dtypes)."""
    version = header.get("format")
    if version != FORMAT:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT
        raise SlotFileError(f"{name}: slot file format {version!r} " + (
            f"is newer than this specdec reads ({FORMAT})" if newer else "is not one specdec writes"))
    models, runners = header.get("models"), _runners(decoder)
    if not isinstance(header.get("bundle"), str) or not isinstance(models, list) or not all(
            isinstance(m, dict) for m in models):
        raise SlotFileError(f"{name}: its header is damaged")
    if [m.get("role") for m in models] != list(runners):
        raise SlotFileError(f"{name} holds the caches of {[m.get('role') for m in models]}; this server's bundle "
                            f"has {list(runners)}")
    for model in models:
        runner, role, count = runners[model["role"]], model["role"], model.get("tokens")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= runner.max_context:
            raise SlotFileError(f"{name}: the {role} holds {count!r} tokens; this server's context is "
                                f"{runner.max_context}")
        try:
            shape, dtype = runner.kv_layout(count)
        except NotImplementedError as exc:
            raise SlotUnsupported(f"cannot restore the {role}'s KV cache: {exc}") from None
        dtype = np.dtype(dtype).newbyteorder("<")
        if model.get("shape") != list(shape) or model.get("dtype") != dtype.str or \
                model.get("bytes") != int(np.prod(shape)) * dtype.itemsize:
            raise SlotFileError(f"{name}: the {role}'s cache is {model.get('shape')} {model.get('dtype')}; this "
                                f"server's is {list(shape)} {dtype.str}")
    return models


def restore_slot(decoder, path) -> tuple:
    """Load the file at ``path`` into ``decoder``'s caches once every check passed; (target tokens, bytes read).
    The caller holds the decoder."""
    snapshots, size = read_slot(decoder, path)
    for role, runner in _runners(decoder).items():
        snapshot = snapshots[role]
        runner.restore(snapshot, len(snapshot.token_ids))
    return len(snapshots["target"].token_ids), size
