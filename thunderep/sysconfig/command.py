"""The `thunderep-sysconfig` command line: check | plan | apply | revert.

    thunderep-sysconfig [--root PATH] check     what is set up and what is not (exit 1 if changes are pending)
    thunderep-sysconfig [--root PATH] plan      every file (full content) and command apply would run
    thunderep-sysconfig [--root PATH] apply --yes   do it (needs root); idempotent
    thunderep-sysconfig [--root PATH] revert --yes  restore the backups and undo the commands (needs root)

Options of check/plan/apply: --no-cmdline, --no-acs, --no-uvm, --uvm-disable-hmm, --acs-override.
Without --yes, apply and revert print what they would do and change nothing (exit status 2).
With a --root other than "/", commands are read from PATH/_commands and state-changing commands are
printed but never run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, TextIO

from ..doctor.sources import HostFS, NotRunRunner, Runner, SystemRunner, default_runner
from ..errors import ThunderError
from .planner import make_plan
from .state import apply_plan, revert, revert_plan
from .steps import Options, RunCommand, WriteFile, describe_step

__all__ = ["main"]

_PROG = "thunderep-sysconfig"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Set up a multi-GPU PCIe box for peer-to-peer (kernel command line, ACS, nvidia_uvm). "
                    "Dry-run by default; see docs/SYSTEM_SETUP.md for what each setting does and costs.")
    p.add_argument("--root", default="/", metavar="PATH", help="operate on the tree under PATH instead of /")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=argparse.SUPPRESS, metavar="PATH", help=argparse.SUPPRESS)
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--no-cmdline", action="store_true", help="leave the kernel command line alone")
    opts.add_argument("--no-acs", action="store_true", help="leave ACS (runtime and boot unit) alone")
    opts.add_argument("--no-uvm", action="store_true", help="leave nvidia_uvm alone")
    opts.add_argument("--uvm-disable-hmm", action="store_true",
                      help="also write `options nvidia_uvm uvm_disable_hmm=1` (a workaround; off by default)")
    opts.add_argument("--acs-override", action="store_true",
                      help="also add pcie_acs_override (only if the running kernel carries that patch; VFIO only)")
    yes = argparse.ArgumentParser(add_help=False)
    yes.add_argument("--yes", action="store_true", help="really change the system (needs root)")
    sub = p.add_subparsers(dest="command", required=True, metavar="{check,plan,apply,revert}")
    sub.add_parser("check", parents=[common, opts], help="show the current state; exit 1 if changes are pending")
    sub.add_parser("plan", parents=[common, opts], help="print every file and command apply would run")
    sub.add_parser("apply", parents=[common, opts, yes], help="apply the plan (needs root and --yes)")
    sub.add_parser("revert", parents=[common, yes], help="restore backups, undo commands (needs root and --yes)")
    return p


def _options(args: argparse.Namespace) -> Options:
    return Options(cmdline=not args.no_cmdline, acs=not args.no_acs, uvm=not args.no_uvm,
                   uvm_disable_hmm=args.uvm_disable_hmm, acs_override=args.acs_override)


def _print_plan(plan, fs: HostFS, out: TextIO) -> None:
    for i, step in enumerate(plan.steps, 1):
        exists = fs.exists(step.path) if isinstance(step, WriteFile) else None
        out.write(f"[{i}] " + describe_step(step, exists))
    for n in plan.notes:
        out.write(f"note: {n}\n")


def _refusal(args: argparse.Namespace, is_root: Callable[[], bool], what: str) -> str | None:
    """Why `what` may not proceed (None when --yes was given and we are root)."""
    if not args.yes:
        return f"dry run: nothing was changed. To {what}, run again with --yes (as root).\n"
    if not is_root():
        return (f"{_PROG}: refusing to {what}: it writes system files and runs setpci/systemctl/modprobe, "
                f"which needs root (effective uid {os.geteuid()}). Run it with sudo.\n")
    return None


def main(
    argv: list[str] | None = None,
    *,
    runner: Runner | None = None,
    exec_runner: Runner | None = None,
    is_root: Callable[[], bool] | None = None,
    out: TextIO | None = None,
) -> int:
    """Run the command line. `runner` answers read-only commands (lspci, setpci reads, nvidia-smi);
    `exec_runner` runs state-changing ones (default: `runner` when given, else real commands on "/"
    and none at all elsewhere); `is_root` decides whether apply/revert may proceed."""
    out = out or sys.stdout
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    fs = HostFS(args.root)
    if not fs.path("/").is_dir():
        print(f"{_PROG}: error: --root {args.root!r} is not a directory: pass '/' or the root of a "
              "filesystem tree", file=sys.stderr)
        return 2
    probe = runner if runner is not None else default_runner(fs)
    if exec_runner is None:
        exec_runner = runner if runner is not None else (
            SystemRunner() if fs.is_real_root else NotRunRunner(f"--root {args.root} is not /"))
    is_root = is_root if is_root is not None else (lambda: os.geteuid() == 0)
    try:
        return _run(args, fs, probe, exec_runner, is_root, out)
    except ThunderError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1


def _run(args, fs: HostFS, probe: Runner, exec_runner: Runner, is_root, out: TextIO) -> int:
    if args.command == "revert":
        lines = revert_plan(fs.root)
        if not lines:
            out.write("nothing to revert: no state recorded by apply\n")
            return 0
        out.write("revert:\n" + "".join(f"  {line}\n" for line in lines))
        refusal = _refusal(args, is_root, "revert")
        if refusal is not None:
            out.write(refusal)
            return 2
        revert(fs.root, exec_runner, out)
        out.write("reverted: files and ACS bits are back as they were; reboot to boot with the previous "
                  "kernel command line.\n")
        return 0

    plan = make_plan(fs, probe, _options(args))
    if args.command == "check":
        out.write("".join(f"{s}\n" for s in plan.status))
        out.write("".join(f"note: {n}\n" for n in plan.notes))
        out.write(f"{len(plan.steps)} change(s) pending" + (f": see `{_PROG} plan`\n" if plan.steps else "\n"))
        return 1 if plan.steps else 0
    if plan.empty:
        out.write("nothing to do: this machine is already set up as planned\n")
        out.write("".join(f"note: {n}\n" for n in plan.notes))
        return 0
    if args.command == "plan":
        out.write(f"plan for {fs.root} (dry run: nothing is changed)\n")
        _print_plan(plan, fs, out)
        out.write(f"to apply: sudo {_PROG} apply --yes\n")
        return 0
    # apply
    out.write(f"apply on {fs.root}:\n")
    refusal = _refusal(args, is_root, "apply")
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
