"""`thunderep report RUN_DIR`: print the sync-tax report a `thunderep train --out DIR` run saved: bytes
each operation sent, the share of step time communication took, load imbalance, the bottleneck and what to
try first."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import command_parser

__all__ = ["configure", "main", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory (`thunderep train --out DIR`)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose report to print")


def run(args: argparse.Namespace) -> int:
    # deferred: train.telemetry imports torch, which takes seconds; --help must not pay it
    from ..train.telemetry import format_report

    path = Path(args.run_dir) / f"synctax-rank{args.rank}.json"
    if not path.exists():
        print(f"thunderep report: {path} not found (runs write it with --out DIR)", file=sys.stderr)
        return 2
    try:
        report = json.loads(path.read_text())
        text = format_report(report, flags=True)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # truncated, or not a sync-tax report
        print(f"thunderep report: {path} is not a readable sync-tax report ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("report").parse_args(argv))
