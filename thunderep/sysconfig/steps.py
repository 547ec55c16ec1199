"""The vocabulary of a system-setup plan: files to write, commands to run, and how to print them.

A `Plan` is computed against the machine's current state and holds only steps that change something,
so an empty plan means "nothing to do" and applying a plan twice is the same as applying it once.
Every step carries its reason; every command carries the commands that undo it (run by `revert`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..doctor.sources import format_argv

__all__ = [
    "Options",
    "WriteFile",
    "RunCommand",
    "Step",
    "Plan",
    "UNIT",
    "UNIT_NAME",
    "UNIT_WANTS",
    "MODULES_LOAD",
    "MODPROBE_OPTIONS",
    "describe_step",
]

UNIT_NAME = "thunderep-acs.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
UNIT_WANTS = f"/etc/systemd/system/multi-user.target.wants/{UNIT_NAME}"
MODULES_LOAD = "/etc/modules-load.d/thunderep-nvidia-uvm.conf"
MODPROBE_OPTIONS = "/etc/modprobe.d/thunderep-nvidia-uvm.conf"


@dataclass(frozen=True)
class Options:
    """What to set up. Defaults: kernel command line, ACS (runtime + boot unit) and UVM; nothing opt-in."""

    cmdline: bool = True
    acs: bool = True
    uvm: bool = True
    uvm_disable_hmm: bool = False
    acs_override: bool = False


@dataclass(frozen=True)
class WriteFile:
    """Write `content` to the absolute system path `path` (backed up first if it exists)."""

    path: str
    content: str
    reason: str
    mode: int = 0o644


@dataclass(frozen=True)
class RunCommand:
    """Run `argv`. `undo`: commands `revert` runs before restoring files (after, when `undo_late`)."""

    argv: tuple[str, ...]
    reason: str
    undo: tuple[tuple[str, ...], ...] = ()
    undo_late: bool = False
    adds_params: tuple[str, ...] = ()  # kernel parameters this command adds (remembered in the state)


Step = Union[WriteFile, RunCommand]


@dataclass(frozen=True)
class Plan:
    """Steps that change something, notes on what was left alone and why, and the current status."""

    steps: tuple[Step, ...]
    notes: tuple[str, ...] = ()
    status: tuple[str, ...] = field(default=())

    @property
    def empty(self) -> bool:
        return not self.steps


def describe_step(step: Step, exists: bool | None = None) -> str:
    """A step as printed by plan/apply: the reason, then the full file content or the exact command."""
    if isinstance(step, WriteFile):
        state = "" if exists is None else (" (replaces the current file)" if exists else " (new file)")
        body = "".join(f"    | {line}\n" for line in step.content.splitlines())
        return f"write {step.path}{state}, mode {step.mode:04o}\n    why: {step.reason}\n{body}"
    undo = ""
    if step.undo:
        undo = "    undone by: " + "; ".join(format_argv(u) for u in step.undo) + "\n"
    return f"run   {format_argv(step.argv)}\n    why: {step.reason}\n{undo}"
