"""`thunderep report RUN_DIR`: print the sync-tax report a `thunderep train --out DIR` run saved."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="thunderep report",
                                     description="Print the sync-tax report a `thunderep train --out DIR` run saved.")
    parser.add_argument("run_dir", help="the run directory (`thunderep train --out DIR`)")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose report to print (default 0)")
    args = parser.parse_args(argv)
    # deferred: train.telemetry imports torch, which takes seconds; --help must not pay it
    from ..train.telemetry import format_report

    path = Path(args.run_dir) / f"synctax-rank{args.rank}.json"
    if not path.exists():
        print(f"thunderep report: {path} not found (runs write it with --out DIR)", file=sys.stderr)
        return 2
    try:
        report = json.loads(path.read_text())
        text = format_report(report)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # truncated, or not a sync-tax report
        print(f"thunderep report: {path} is not a readable sync-tax report ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    print(text)
    return 0
