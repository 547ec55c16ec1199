"""Names of mailbox segments (user, pid namespace and creator pid, then a random token) and the cleanup
of segments whose creator exited while its group was starting. No native code: the mailbox itself is
`thunderep.comm.mailbox`."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

__all__ = ["cleanup_stale_segments", "new_segment_name"]

_SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^tep-(\d+)-(\d+)-(\d+)-([0-9a-f]{16})$")


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_segment_name() -> str:
    """A fresh segment name: user, pid namespace and creator pid (for stale cleanup) + a random token."""
    return f"/tep-{os.geteuid()}-{_pidns()}-{os.getpid()}-{secrets.token_hex(8)}"


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] in "ZXx"
    except (OSError, ValueError, IndexError):
        return False


def cleanup_stale_segments() -> list[str]:
    """Unlink mailbox segments of this user whose creator process has exited; return their names.

    A live group unlinks its segment's name as soon as every rank attached, so a name left behind
    belongs to a run that crashed while starting. Segments of other pid namespaces are left alone.
    """
    removed: list[str] = []
    if not _SHM_DIR.is_dir():
        return removed
    uid, ns = os.geteuid(), _pidns()
    for entry in os.scandir(_SHM_DIR):
        m = _NAME_RE.match(entry.name)
        if not m or int(m.group(1)) != uid or int(m.group(2)) != ns or not _process_gone(int(m.group(3))):
            continue
        try:
            os.unlink(entry.path)
            removed.append("/" + entry.name)
        except OSError:
            pass
    return removed
