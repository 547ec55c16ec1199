"""Benchmarks: each prints baseline and candidate side by side in one run, with the ratio and the hardware."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..errors import ConfigError

__all__ = ["parsed"]


def parsed(argv: list[str] | None, doc: str, parse: Callable, name: str):
    """(options, None) for a `python -m thunderep.bench.<name>` command line (sys.argv's without `argv`), or
    (None, exit code): 0 after printing `doc` for --help / -h, 2 after naming a bad option (`parse` raised
    ConfigError) on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(doc)
        return None, 0
    try:
        return parse(argv), None
    except ConfigError as exc:
        print(f"thunderep.bench.{name}: {exc}", file=sys.stderr)
        return None, 2
