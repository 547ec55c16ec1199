"""Apply a plan with backups, remember what was done, and revert it.

Everything lives under `root` (the machine's "/" or a test tree). Before a file is first replaced it
is copied (bytes, mode and times) to /var/lib/thunderep/sysconfig/backup/<its path>; files that did not
exist are remembered as created. state.json records those, the directories created, the undo commands
of every command that ran, and the kernel parameters added through grubby. A second apply never
overwrites a backup, so `revert` always restores the file as it was before the first apply, byte for
byte, then deletes the files it created and runs the undo commands.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TextIO

from ..doctor.sources import Runner, format_argv
from ..errors import ThunderError
from .steps import Plan, RunCommand, WriteFile, describe_step

__all__ = ["STATE_DIR", "STATE_FILE", "BACKUP_DIR", "load_state", "apply_plan", "revert_plan", "revert"]

STATE_DIR = "/var/lib/thunderep/sysconfig"
STATE_FILE = f"{STATE_DIR}/state.json"
BACKUP_DIR = f"{STATE_DIR}/backup"
_VERSION = 1


def _under(root: Path, p: str) -> Path:
    return root / p.lstrip("/")


def _empty_state() -> dict:
    return {"version": _VERSION, "files": {}, "dirs": [], "undo": [], "undo_late": [], "kernel_params": []}


def load_state(root: str | os.PathLike[str]) -> dict | None:
    """The recorded state, or None when nothing was applied (or everything was reverted)."""
    path = _under(Path(root), STATE_FILE)
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ThunderError(f"cannot read {STATE_FILE} ({exc}): it records what apply changed; restore it "
                           f"from {BACKUP_DIR} by hand or remove it if nothing was applied") from exc
    if state.get("version") != _VERSION:
        raise ThunderError(f"{STATE_FILE} has version {state.get('version')!r}, this tool writes {_VERSION}: "
                           "revert with the version of thunderep-sysconfig that applied it")
    return state


def _save_state(root: Path, state: dict) -> None:
    _write_atomic(root, STATE_FILE, json.dumps(state, indent=2) + "\n", 0o600, state=None)


def _make_dirs(root: Path, directory: str, state: dict | None) -> None:
    missing = []
    d = directory
    while d not in ("", "/") and not _under(root, d).exists():
        missing.append(d)
        d = os.path.dirname(d)
    for m in reversed(missing):
        _under(root, m).mkdir()
        if state is not None:
            state["dirs"].append(m)


def _write_atomic(root: Path, path: str, content: str, mode: int, state: dict | None) -> None:
    _make_dirs(root, os.path.dirname(path), state)
    target = _under(root, path)
    tmp = target.with_name(f".{target.name}.thunderep-tmp")
    tmp.write_text(content)
    os.chmod(tmp, mode)
    os.replace(tmp, target)


def _record_file(root: Path, path: str, state: dict) -> None:
    """Back the file up (or remember it as created) the first time this tool touches it."""
    if path in state["files"]:
        return
    target = _under(root, path)
    if target.exists():
        backup = f"{BACKUP_DIR}{path}"
        _make_dirs(root, os.path.dirname(backup), None)
        shutil.copy2(target, _under(root, backup), follow_symlinks=False)
        state["files"][path] = {"backup": backup}
    else:
        state["files"][path] = {"created": True}


def apply_plan(plan: Plan, root: str | os.PathLike[str], runner: Runner, out: TextIO) -> None:
    """Execute every step in order, printing each file and command; the state is saved after each step."""
    root = Path(root)
    state = load_state(root) or _empty_state()
    for step in plan.steps:
        if isinstance(step, WriteFile):
            exists = _under(root, step.path).exists()
            out.write(describe_step(step, exists))
            _record_file(root, step.path, state)
            _write_atomic(root, step.path, step.content, step.mode, state)
        else:
            out.write(describe_step(step))
            res = runner(list(step.argv))
            out.write(f"    -> exit status {res.returncode}{': ' + res.stderr.strip() if res.stderr.strip() else ''}\n")
            if not res.ok:
                _save_state(root, state)
                raise ThunderError(
                    f"`{format_argv(step.argv)}` failed with exit status {res.returncode} "
                    f"({res.stderr.strip() or 'no message'}); the steps before it are applied and recorded "
                    "in " + STATE_FILE + ": fix the cause and run apply again, or undo them with "
                    "`thunderep-sysconfig revert --yes`")
            _record_command(step, state)
        _save_state(root, state)


def _record_command(step: RunCommand, state: dict) -> None:
    key = "undo_late" if step.undo_late else "undo"
    for u in step.undo:
        if list(u) not in state[key]:
            state[key].append(list(u))
    for p in step.adds_params:
        if p not in state["kernel_params"]:
            state["kernel_params"].append(p)


def revert_plan(root: str | os.PathLike[str]) -> list[str]:
    """What `revert` would do, one line per action (empty when nothing is recorded)."""
    state = load_state(root)
    if state is None:
        return []
    lines = [f"run   {format_argv(u)}" for u in reversed(state["undo"])]
    for path, rec in state["files"].items():
        lines.append(f"restore {path} from {rec['backup']}" if "backup" in rec else f"delete {path}")
    lines += [f"remove directory {d} if empty" for d in reversed(state["dirs"])]
    lines += [f"run   {format_argv(u)}" for u in state["undo_late"]]
    lines.append(f"delete {STATE_DIR}")
    return lines


def revert(root: str | os.PathLike[str], runner: Runner, out: TextIO) -> None:
    """Undo everything recorded: early undo commands, files, directories, late undo commands, the state."""
    root = Path(root)
    state = load_state(root)
    if state is None:
        out.write("nothing to revert: no state recorded by thunderep-sysconfig apply\n")
        return
    failures = []

    def run(argv: list[str]) -> None:
        res = runner(argv)
        out.write(f"run   {format_argv(argv)}\n    -> exit status {res.returncode}\n")
        if not res.ok:
            failures.append(f"`{format_argv(argv)}` (exit status {res.returncode}: {res.stderr.strip()})")

    for u in reversed(state["undo"]):
        run(u)
    for path, rec in state["files"].items():
        target = _under(root, path)
        if "backup" in rec:
            out.write(f"restore {path} from {rec['backup']}\n")
            if target.is_symlink():
                target.unlink()
            shutil.copy2(_under(root, rec["backup"]), target, follow_symlinks=False)
        elif target.exists() or target.is_symlink():
            out.write(f"delete {path}\n")
            target.unlink()
    for d in reversed(state["dirs"]):
        p = _under(root, d)
        if p.is_dir() and not any(p.iterdir()):
            out.write(f"remove empty directory {d}\n")
            p.rmdir()
    for u in state["undo_late"]:
        run(u)
    shutil.rmtree(_under(root, STATE_DIR))
    out.write(f"delete {STATE_DIR}\n")
    parent = _under(root, os.path.dirname(STATE_DIR))
    if parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
    if failures:
        raise ThunderError("files are restored, but these undo commands failed: " + "; ".join(failures)
                           + ". Run them by hand once the cause is fixed")
