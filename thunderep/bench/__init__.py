"""Benchmarks: each prints baseline and candidate side by side in one run, with the ratio and the hardware."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from ..errors import ConfigError

__all__ = ["dataclass_options", "parsed"]


def dataclass_options(cls, argv: list[str], kinds: dict | None = None) -> dict:
    """The `--name value` options of the dataclass `cls`'s fields as keywords for it (dashes for
    underscores): a bool field is a bare flag; a tuple field takes comma-separated values of kinds[name]
    (default int); an int field a whole number; any other a string. ConfigError names an unknown option,
    a missing value, a value of the wrong kind."""
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    kinds = kinds or {}
    values: dict = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        name = arg[2:].replace("-", "_") if arg.startswith("--") else ""
        if name not in fields:
            raise ConfigError(f"unknown option {arg!r}; the options: "
                              + ", ".join("--" + n.replace("_", "-") for n in fields))
        default = fields[name]
        if isinstance(default, bool):
            values[name] = True
            continue
        if not args:
            raise ConfigError(f"{arg} needs a value")
        text = args.pop(0)
        many = isinstance(default, tuple)
        kind = kinds.get(name, int) if many else int if isinstance(default, int) else str
        try:
            values[name] = tuple(kind(v) for v in text.split(",") if v) if many else kind(text)
        except ValueError:
            raise ConfigError(f"{arg} {text!r}: expected {kind.__name__}"
                              f"{' values, comma-separated' if many else ''}") from None
    return values


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
