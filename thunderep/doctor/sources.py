"""Where the doctor's facts come from: a filesystem root and a command runner.

Every file the doctor (and `thunderep-sysconfig`) reads goes through `HostFS`, which puts it under a
root directory ("/" on a real machine, a fixture tree in tests), and every external command (lspci,
setpci, nvidia-smi, update-grub, ...) goes through a `Runner`: a callable taking an argv and returning
a `CommandResult`. Nothing here needs root; unreadable files read as missing.

Runners:
- `SystemRunner` runs real commands (used only when the root is "/");
- `RecordedRunner` answers from recorded outputs in `<root>/_commands/index.json`, so that a fixture
  tree (or a tree captured from a user's box) carries the lspci / setpci / nvidia-smi outputs with it;
- `NotRunRunner` refuses to run anything and says so (used for state-changing commands when the root
  is not "/", so that `--root` can never touch the real machine).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

__all__ = [
    "CommandResult",
    "Runner",
    "HostFS",
    "SystemRunner",
    "RecordedRunner",
    "NotRunRunner",
    "RECORDED_DIR",
    "default_runner",
    "format_argv",
]

RECORDED_DIR = "_commands"
"""Directory (under a fixture root) holding recorded command outputs and their index.json."""


@dataclass(frozen=True)
class CommandResult:
    """What a command returned. returncode 127 means "not installed / not recorded"."""

    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


Runner = Callable[[Sequence[str]], CommandResult]


def format_argv(argv: Sequence[str]) -> str:
    """A command line as a user would type it (arguments with spaces or shell characters quoted)."""
    out = []
    for arg in argv:
        if arg and all(c.isalnum() or c in "-_./:=+@,%" for c in arg):
            out.append(arg)
        else:
            out.append("'" + arg.replace("'", "'\\''") + "'")
    return " ".join(out)


class HostFS:
    """Read-only view of a machine's files under `root` ("/" for the real machine)."""

    def __init__(self, root: str | os.PathLike[str] = "/"):
        self.root = Path(root)

    @property
    def is_real_root(self) -> bool:
        """True when this view is the running machine itself (root "/")."""
        return self.root.resolve() == Path("/")

    def path(self, p: str) -> Path:
        """The path of absolute system path `p` under the root."""
        return self.root / p.lstrip("/")

    def read_text(self, p: str) -> str | None:
        """Contents of `p`, or None when it is missing or unreadable."""
        try:
            return self.path(p).read_text(encoding="utf-8", errors="replace")
        except (OSError, ValueError):
            return None

    def read_line(self, p: str) -> str | None:
        """First line of `p`, stripped, or None."""
        text = self.read_text(p)
        if text is None:
            return None
        return text.strip().splitlines()[0].strip() if text.strip() else ""

    def read_bytes(self, p: str) -> bytes | None:
        try:
            return self.path(p).read_bytes()
        except OSError:
            return None

    def exists(self, p: str) -> bool:
        return os.path.lexists(self.path(p))

    def is_file(self, p: str) -> bool:
        return self.path(p).is_file()

    def listdir(self, p: str) -> list[str]:
        """Sorted entry names of directory `p` ([] when missing or unreadable)."""
        try:
            return sorted(os.listdir(self.path(p)))
        except OSError:
            return []

    def which(self, name: str) -> str | None:
        """Absolute system path of executable `name` in the usual sbin/bin directories, or None."""
        for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin", "/usr/local/bin"):
            if self.is_file(f"{d}/{name}"):
                return f"{d}/{name}"
        return None


class SystemRunner:
    """Runs real commands with a timeout; a missing program gives returncode 127, never an exception."""

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        try:
            proc = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except FileNotFoundError:
            return CommandResult(127, "", f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            return CommandResult(124, "", f"{argv[0]}: no answer within {self.timeout_s:g} s")
        except OSError as exc:
            return CommandResult(126, "", f"{argv[0]}: {exc}")
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)


class RecordedRunner:
    """Answers commands from recorded outputs.

    `<directory>/index.json` maps a command line (arguments joined by single spaces) to either a file
    name (its contents are stdout, returncode 0) or an object {"stdout": file, "returncode": int,
    "stderr": text}. Commands that are not recorded answer returncode 127, like a missing program.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        index = self.directory / "index.json"
        self.index: dict[str, object] = json.loads(index.read_text()) if index.is_file() else {}

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        entry = self.index.get(" ".join(argv))
        if entry is None:
            return CommandResult(127, "", f"{argv[0]}: not recorded in {self.directory}")
        if isinstance(entry, str):
            entry = {"stdout": entry}
        assert isinstance(entry, dict), f"bad index entry for {argv!r}"
        stdout = ""
        if entry.get("stdout"):
            stdout = (self.directory / str(entry["stdout"])).read_text()
        return CommandResult(int(entry.get("returncode", 0)), stdout, str(entry.get("stderr", "")))


class NotRunRunner:
    """Runs nothing: every command answers returncode 0 with a note, and is listed in `.skipped`."""

    def __init__(self, reason: str):
        self.reason = reason
        self.skipped: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        self.skipped.append(tuple(argv))
        return CommandResult(0, "", f"not run: {self.reason}")


def default_runner(fs: HostFS) -> Runner:
    """Real commands for the real root; recorded outputs (or nothing) for any other root."""
    if fs.is_real_root:
        return SystemRunner()
    return RecordedRunner(fs.path(RECORDED_DIR))
