"""Files and folders that killed specdec processes leave behind, named ``.NAME.<kind>-PID``.

Writers put their work under such a hidden name and rename it into place when complete; a
process killed with SIGKILL (or by the out-of-memory killer) cannot clean up, so the next run
removes what belongs to processes that no longer run, and never touches a live one's.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path


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
