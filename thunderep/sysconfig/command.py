"""What `thunderep-sysconfig` does: check | plan | apply | revert (its usage and options: the command line,
thunderep/cli/sysconfig.py). Dry-run unless asked with --yes; with a --root other than "/", commands are
read from PATH/_commands and state-changing commands are printed but never run."""

from __future__ import annotations

import os
import sys
from typing import Callable, TextIO

from ..doctor.sources import HostFS, NotRunRunner, Runner, SystemRunner, default_runner
from ..errors import ThunderError
from .planner import make_plan
from .state import apply_plan, revert, revert_plan
from .steps import Options, RunCommand, WriteFile, describe_step

__all__ = ["PROG", "run_command"]

PROG = "thunderep-sysconfig"


def _print_plan(plan, fs: HostFS, out: TextIO) -> None:
    for i, step in enumerate(plan.steps, 1):
        exists = fs.exists(step.path) if isinstance(step, WriteFile) else None
        out.write(f"[{i}] " + describe_step(step, exists))
    for n in plan.notes:
        out.write(f"note: {n}\n")


def _refusal(yes: bool, is_root: Callable[[], bool], what: str) -> str | None:
    """Why `what` may not proceed (None when --yes was given and we are root)."""
    if not yes:
        return f"dry run: nothing was changed. To {what}, run again with --yes (as root).\n"
    if not is_root():
        return (f"{PROG}: refusing to {what}: it writes system files and runs setpci/systemctl/modprobe, "
                f"which needs root (effective uid {os.geteuid()}). Run it with sudo.\n")
    return None


def run_command(
    command: str,
    root: str = "/",
    options: Options | None = None,
    yes: bool = False,
    *,
    runner: Runner | None = None,
    exec_runner: Runner | None = None,
    is_root: Callable[[], bool] | None = None,
    out: TextIO | None = None,
) -> int:
    """Run `command` (check, plan, apply or revert) on the tree under `root`; returns the exit status.
    options: what check / plan / apply manage (default all of it); yes: apply / revert may change the
    system. `runner` answers read-only commands (lspci, setpci reads, nvidia-smi); `exec_runner` runs
    state-changing ones (default: `runner` when given, else real commands on "/" and none at all
    elsewhere); `is_root` decides whether apply/revert may proceed."""
    out = out or sys.stdout
    fs = HostFS(root)
    if not fs.path("/").is_dir():
        print(f"{PROG}: error: --root {root!r} is not a directory: pass '/' or the root of a "
              "filesystem tree", file=sys.stderr)
        return 2
    probe = runner if runner is not None else default_runner(fs)
    if exec_runner is None:
        exec_runner = runner if runner is not None else (
            SystemRunner() if fs.is_real_root else NotRunRunner(f"--root {root} is not /"))
    is_root = is_root if is_root is not None else (lambda: os.geteuid() == 0)
    try:
        if command == "revert":
            return _revert(fs, yes, exec_runner, is_root, out)
        return _run(command, options or Options(), yes, fs, probe, exec_runner, is_root, out)
    except ThunderError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


def _revert(fs: HostFS, yes: bool, exec_runner: Runner, is_root, out: TextIO) -> int:
    lines = revert_plan(fs.root)
    if not lines:
        out.write("nothing to revert: no state recorded by apply\n")
        return 0
    out.write("revert:\n" + "".join(f"  {line}\n" for line in lines))
    refusal = _refusal(yes, is_root, "revert")
    if refusal is not None:
        out.write(refusal)
        return 2
    revert(fs.root, exec_runner, out)
    out.write("reverted: files and ACS bits are back as they were; reboot to boot with the previous "
              "kernel command line.\n")
    return 0


def _run(command: str, options: Options, yes: bool, fs: HostFS, probe: Runner, exec_runner: Runner, is_root,
         out: TextIO) -> int:
    plan = make_plan(fs, probe, options)
    if command == "check":
        out.write("".join(f"{s}\n" for s in plan.status))
        out.write("".join(f"note: {n}\n" for n in plan.notes))
        out.write(f"{len(plan.steps)} change(s) pending" + (f": see `{PROG} plan`\n" if plan.steps else "\n"))
        return 1 if plan.steps else 0
    if plan.empty:
        out.write("nothing to do: this machine is already set up as planned\n")
        out.write("".join(f"note: {n}\n" for n in plan.notes))
        return 0
    if command == "plan":
        out.write(f"plan for {fs.root} (dry run: nothing is changed)\n")
        _print_plan(plan, fs, out)
        out.write(f"to apply: sudo {PROG} apply --yes\n")
        return 0
    # apply
    out.write(f"apply on {fs.root}:\n")
    refusal = _refusal(yes, is_root, "apply")
    if refusal is not None:
        _print_plan(plan, fs, out)
        out.write(refusal)
        return 2
    apply_plan(plan, fs.root, exec_runner, out)
    for n in plan.notes:
        out.write(f"note: {n}\n")
    if isinstance(exec_runner, NotRunRunner) and exec_runner.skipped:
        out.write(f"note: {len(exec_runner.skipped)} command(s) printed but not run: {exec_runner.reason}\n")
    if any(isinstance(s, RunCommand) and s.adds_params or isinstance(s, WriteFile) and "grub" in s.path
           for s in plan.steps):
        out.write("done. Reboot for the kernel command line to take effect; then run `thunderep doctor`.\n")
    else:
        out.write("done. Run `thunderep doctor` to check.\n")
    return 0
