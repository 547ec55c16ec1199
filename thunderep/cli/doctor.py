"""`thunderep doctor`: check a multi-GPU PCIe box (driver, UVM, links, ACS, IOMMU, BAR1, P2P) and this Python
environment (the mailbox extension, Triton), with a verdict and the exact fix per check.

Exit status: 0 when no check fails, 1 when one does, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..doctor import Runner, diagnose, render_json, render_table
from ..errors import ThunderError
from . import command_parser

__all__ = ["configure", "main", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of the table")
    p.add_argument("--root", default="/", metavar="PATH",
                   help="read the system under PATH instead of / (a fixture or captured tree; "
                        "commands answer from PATH/_commands)")
    p.add_argument("--no-cuda", action="store_true", help="do not initialise CUDA (no P2P matrix, no bandwidth)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the GPU-to-GPU copy measurement")
    p.add_argument("--copy-mib", type=int, default=64, metavar="N", help="size of each test copy in MiB")


def main(argv: list[str] | None = None, *, runner: Runner | None = None, out: TextIO | None = None) -> int:
    """Entry point of `thunderep doctor`; returns the exit status (see the module docstring)."""
    try:
        args = command_parser("doctor").parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return int(exc.code or 0)
    return run(args, runner=runner, out=out)


def run(args: argparse.Namespace, *, runner: Runner | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.copy_mib < 1:  # (diagnose's own message names its argument, copy_mib, not the option)
        print(f"thunderep doctor: error: --copy-mib must be at least 1, got {args.copy_mib}", file=sys.stderr)
        return 2
    try:
        d = diagnose(args.root, runner, cuda=not args.no_cuda, measure=not args.no_bandwidth,
                     copy_mib=args.copy_mib)
    except ThunderError as exc:
        print(f"thunderep doctor: error: {exc}", file=sys.stderr)
        return 2
    out.write(render_json(d) if args.json else render_table(d))
    return d.exit_code
