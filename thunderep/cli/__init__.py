"""The `thunderep` command line: one subcommand per job, each in its own module."""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import warnings

from .. import env
from ..errors import Stopped, ThunderError

__all__ = ["add_model_options", "count_problems", "main"]

# subcommand -> (module with a `main(argv) -> int`, one-line help)
COMMANDS = {
    "demo": ("thunderep.cli.demo", "run the main demo on this machine (CPU or GPU)"),
    "generate": ("thunderep.cli.generate", "generate text from a local HF MoE checkpoint on N expert-parallel ranks"),
    "train": ("thunderep.cli.train", "expert-parallel training of a byte-level MoE model on local text"),
    "finetune": ("thunderep.cli.finetune", "fine-tune a local HF MoE checkpoint on N expert-parallel ranks"),
    "serve": ("thunderep.cli.serve", "serve a local HF MoE checkpoint over HTTP (OpenAI-style) on N ranks"),
    "bench": ("thunderep.cli.bench", "benchmarks, baseline and candidate side by side"),
    "report": ("thunderep.cli.report", "print the sync-tax report of a run directory"),
    "project": ("thunderep.cli.project", "project a run's step time to 2 / 4 GPUs over PCIe (a model)"),
    "plan": ("thunderep.cli.plan", "memory per rank of a HF MoE checkpoint for each EP size, against this host"),
    "doctor": ("thunderep.cli.doctor", "check this machine's GPUs, PCIe links, ACS, IOMMU and P2P"),
}


def count_problems(args, at_least_1=(), at_least_0=()) -> list[str]:
    """The command-line counts among `args` (attribute names; those absent from `args` are skipped) below
    their minimum, one line each naming the option and its value."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    return ([f"{flag(n)} must be at least 1, got {getattr(args, n)}" for n in at_least_1
             if n in args and getattr(args, n) < 1]
            + [f"{flag(n)} must be 0 or more, got {getattr(args, n)}" for n in at_least_0
               if n in args and getattr(args, n) < 0])


def add_model_options(p, ep_help: str = "expert-parallel ranks to launch on this host (default 1: this process)",
                      ep_default: int | None = 1) -> None:
    """The --model and --ep options the commands that load a checkpoint share."""
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--ep", type=int, default=ep_default, help=ep_help)


def _format_warning(prefix: str, message, category, filename, lineno, line=None) -> str:
    """A warning as one line, as the command prints its errors: `thunderep train: warning: MESSAGE`, with the
    category before the message when it is not a plain UserWarning (`warning: FutureWarning: ...`)."""
    kind = "" if category is UserWarning else f"{category.__name__}: "
    return f"{prefix}: warning: {kind}{message}\n"


@contextlib.contextmanager
def _one_line_warnings(prefix: str):
    """While inside: warnings print as one line (`_format_warning`) instead of Python's form, which adds
    the file and line that warned and that line's source. Only the form changes: the filters still decide
    which warnings show. Ranks `launch` starts inside take the form over (`launch.RankStart`)."""
    previous = warnings.formatwarning
    warnings.formatwarning = functools.partial(_format_warning, prefix)
    try:
        yield
    finally:
        warnings.formatwarning = previous


def _usage() -> str:
    lines = ["usage: thunderep COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`thunderep COMMAND --help` shows a command's options; `thunderep --version` the version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        # deferred: the sysconfig launcher loads thunderep.cli without thunderep's __init__ (which imports torch)
        from .. import __version__

        print(f"thunderep {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"thunderep: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # THUNDEREP_DEBUG=1: Python's own form, which says where a warning came from
    with contextlib.nullcontext() if env.debug() else _one_line_warnings(f"thunderep {name}"):
        return _run(name, rest)


def _run(name: str, rest: list[str]) -> int:
    """The subcommand `name` with its arguments; an error it raises, as one line and an exit code."""
    # deferred: thunderep.comm's package imports torch; `thunderep-sysconfig` loads thunderep.cli without it
    from ..comm.stop import stop_on_sigterm

    module = importlib.import_module(COMMANDS[name][0])
    try:
        with stop_on_sigterm():
            return int(module.main(rest) or 0)
    except Stopped as exc:
        if env.debug():
            raise
        print(f"thunderep {name}: {exc}", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended
    except KeyboardInterrupt:
        if env.debug():
            raise
        print(f"thunderep {name}: interrupted", file=sys.stderr)
        return 130
    except ThunderError as exc:  # a clear message; THUNDEREP_DEBUG=1 shows the traceback
        if env.debug():
            raise
        print(f"thunderep {name}: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # files that are missing, unreadable or malformed; bad values
        if env.debug():
            raise
        print(f"thunderep {name}: error: {type(exc).__name__}: {exc} (THUNDEREP_DEBUG=1 shows where)",
              file=sys.stderr)
        return 1

