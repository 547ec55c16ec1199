"""`thunderep-sysconfig`: check | plan | apply | revert (the work: `thunderep.sysconfig`).

    thunderep-sysconfig [--root PATH] check     what is set up and what is not (exit 1 if changes are pending)
    thunderep-sysconfig [--root PATH] plan      every file (full content) and command apply would run
    thunderep-sysconfig [--root PATH] apply --yes   do it (needs root); idempotent
    thunderep-sysconfig [--root PATH] revert --yes  restore the backups and undo the commands (needs root)

Options of check/plan/apply: --no-cmdline, --no-acs, --no-uvm, --uvm-disable-hmm, --acs-override.
Without --yes, apply and revert print what they would do and change nothing (exit status 2).
With a --root other than "/", commands are read from PATH/_commands and state-changing commands are
printed but never run. This module imports nothing heavy (no torch): the launcher
`sysconfig/thunderep-sysconfig` runs it with the system Python alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TextIO

from ..doctor.sources import Runner
from ..sysconfig import Options
from ..sysconfig.command import PROG, run_command
from . import HelpFormatter, new_parser

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = new_parser(
        PROG,
        description="Set up a multi-GPU PCIe box for peer-to-peer (kernel command line, ACS, nvidia_uvm).\n"
                    "Dry-run by default; see docs/guide/doctor-and-sysconfig.md for what each setting does and costs.")
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
    sub.add_parser("check", parents=[common, opts], formatter_class=HelpFormatter,
                   help="show the current state; exit 1 if changes are pending")
    sub.add_parser("plan", parents=[common, opts], formatter_class=HelpFormatter,
                   help="print every file and command apply would run")
    sub.add_parser("apply", parents=[common, opts, yes], formatter_class=HelpFormatter,
                   help="apply the plan (needs root and --yes)")
    sub.add_parser("revert", parents=[common, yes], formatter_class=HelpFormatter,
                   help="restore backups, undo commands (needs root and --yes)")
    return p


def _options(args: argparse.Namespace) -> Options:
    return Options(cmdline=not args.no_cmdline, acs=not args.no_acs, uvm=not args.no_uvm,
                   uvm_disable_hmm=args.uvm_disable_hmm, acs_override=args.acs_override)


def main(
    argv: list[str] | None = None,
    *,
    runner: Runner | None = None,
    exec_runner: Runner | None = None,
    is_root: Callable[[], bool] | None = None,
    out: TextIO | None = None,
) -> int:
    """Run the command line (`run_command` says what `runner`, `exec_runner` and `is_root` do)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    options = _options(args) if args.command != "revert" else None
    return run_command(args.command, args.root, options, getattr(args, "yes", False), runner=runner,
                       exec_runner=exec_runner, is_root=is_root, out=out)
