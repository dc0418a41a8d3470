"""Where a bundle goes: which ``--out`` may be replaced, leftovers of dead exports, the final swap.

``--out`` is replaced only when it is a specdec bundle holding nothing but the files its manifest
lists; anything else is refused (SourceError, one line) and left untouched. Writers work under
hidden names ``.NAME.<kind>-PID`` beside their destination and rename into place when complete;
a process killed with SIGKILL (or by the out-of-memory killer) cannot clean up, so the next run
removes what belongs to processes that no longer run, and never touches a live one's.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
from pathlib import Path

from specdec.contract.manifest import MANIFEST_NAME

from specdec.export.sources import SourceError

_LEFTOVER = re.compile(r"^\.[^/]+\.partial-\d+$")  # a file a killed specdec process was writing


def _bundle_files(out: Path) -> set | None:
    """Relative paths a specdec manifest at ``out`` lists (plus manifest.json), or None if it has none.

    Deliberately lenient about the manifest's version and fields (an older bundle may be replaced),
    strict about what it lists: that list is what decides which files are the bundle's.
    """
    try:
        data = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("format_version"), int)
            and isinstance(data.get("target"), dict) and isinstance(data.get("files"), dict)):
        return None
    return {MANIFEST_NAME} | {str(key) for key in data["files"]}


def check_destination(out: Path) -> None:
    """Refuse (SourceError, one line) an ``--out`` that is not absent, an empty folder or a specdec bundle.

    A bundle may be replaced only if every file under it is one its manifest lists (or a leftover
    ``.NAME.partial-PID`` file of a killed specdec process): nothing a user put there is ever deleted.
    """
    if out.is_symlink():
        raise SourceError(f"--out {out} is a symbolic link: give the real folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise SourceError(f"--out {out} exists and is not a folder: refusing to replace it")
    entries = list(out.rglob("*"))
    if not entries:
        return
    listed = _bundle_files(out)
    if listed is None:
        raise SourceError(f"--out {out} is a non-empty folder that is not a specdec bundle (no valid {MANIFEST_NAME}): "
                          "refusing to replace it; choose another --out")
    folders = {parent.as_posix() for rel in listed for parent in Path(rel).parents if parent != Path(".")}
    for path in sorted(entries):
        relative = path.relative_to(out).as_posix()
        if path.is_dir() and not path.is_symlink():
            ok = relative in folders
        else:
            ok = (relative in listed and not path.is_symlink()) or bool(_LEFTOVER.match(path.name))
        if not ok:
            raise SourceError(f"--out {out} holds {relative}, which is not part of the specdec bundle there: "
                              "refusing to replace it; choose another --out or move that file")


def remove_dead_staging(out: Path, progress=None) -> None:
    """Clean up after export processes to ``out`` that were killed (never touches a live one's folders).

    ``.OUT.partial-PID``: an unfinished export, or an old bundle swapped out but not yet removed: deleted.
    ``.OUT.old-PID``: a bundle moved aside by the two-rename fallback swap: put back if ``out`` is missing
    (the process died between the renames), else deleted.
    """
    progress = progress or (lambda message: None)
    for path in dead_leftovers(out, "partial"):
        progress(f"removing {path.name}, left by an export process that no longer runs")
        shutil.rmtree(path, ignore_errors=True)
    for path in dead_leftovers(out, "old"):
        if not out.exists():
            progress(f"restoring {out} from {path.name} (an export process died while replacing it)")
            os.rename(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def dead_leftovers(path: Path, kind: str = "partial") -> list:
    """``.NAME.<kind>-PID`` entries beside ``path`` (NAME = its name) whose process no longer runs."""
    found = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.{kind}-*"):
        pid = candidate.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            found.append(candidate)
    return found


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_into_place(staging: Path, out: Path) -> None:
    """Put the finished staging folder at ``out``; an existing bundle is swapped out, then removed.

    The destination is checked again first (someone may have put files there during the export).
    With an atomic exchange ``out`` is never missing; the fallback (two renames) leaves the old
    bundle at ``.OUT.old-PID`` for a moment, which the next export restores if this one dies there.
    """
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    check_destination(out)
    if not out.exists():
        os.rename(staging, out)
        return
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # now the old bundle
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)
