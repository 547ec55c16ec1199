"""The `thunderep` command line: one subcommand per job, each in its own module.

A command module has `configure(parser)`, which adds its options, and `run(args)`, which does the work; its
docstring is its --help description. The modules import nothing heavy at their top: torch, transformers and
the library modules that import them are imported inside `run`, so that --help and a usage error take a
fraction of a second and a long command says what it is doing before it pays for them.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib
import os
import sys
import traceback
import warnings

from .. import env
from ..errors import Stopped, ThunderError

__all__ = [
    "COMMANDS",
    "EP_ONE_HELP",
    "EXPERTS_DTYPES",
    "EXPERTS_DTYPE_HELP",
    "EXPERTS_IMPLEMENTATION_HELP",
    "HelpFormatter",
    "add_model_options",
    "build_parser",
    "command_parser",
    "count_problems",
    "entry",
    "main",
    "new_parser",
    "quiet_libraries",
    "say",
]

# subcommand -> (module with `configure(parser)` and `run(args)`, one-line help)
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

# Why --ep defaults differ: for generate and serve one process starts quickest, and more ranks pay off only
# for a model that does not fit one device; finetune and train use every GPU of the host.
EP_ONE_HELP = ("expert-parallel ranks to launch on this host (default 1: this process alone, the quickest start "
               "and enough for a model that fits one device; give up to one per GPU to split a model that does "
               "not fit one GPU)")

# The options generate, finetune and serve share (the library checks the values: thunderep.hf.fp8, whose
# EXPERTS_DTYPES these choices equal)
EXPERTS_DTYPES = ("fp8", "fp8-w8a8", "mxfp4", "int4", "int4-g128")
EXPERTS_DTYPE_HELP = (
    "fp8: hold the routed experts in FP8 (e4m3, a scale per row; half the bytes of bfloat16), quantized as each "
    "rank reads them, computed by ThunderEP's kernels in the model's dtype; fp8-w8a8: the same, and prompts' "
    "activations quantized per row too, for FP8 tensor-core products (about twice the prefill speed, about 1.4x "
    "the error); both need a GPU of compute capability 8.9 or later (RTX 4090 / 5090, H100 / H200); int4, "
    "int4-g128: 4-bit experts, two values a byte, one scale per 32 / 128 input columns (a compressed-tensors "
    "pack-quantized checkpoint keeps its own groups and bytes); mxfp4: e2m1 values with a power-of-two scale per 32; "
    "decode reads the packed bytes, and so do prompts of up to 128 rows an expert on average (longer ones run "
    "on the experts dequantized per layer); all inference only, on a CUDA GPU (default: the model's dtype)")
EXPERTS_IMPLEMENTATION_HELP = (
    "what computes each rank's experts: the model's own transformers function (default), another one "
    "(grouped_mm, eager, ...), triton (ThunderEP's kernels, CUDA), or auto (the kernels for experts they cover "
    "in bfloat16 / float16 on a GPU of compute capability 8.0 or later, else the model's own)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The --help format of every command: descriptions as written, and every option that takes a value
    shows its default ("(default: X)" appended where its help does not already say what the default is)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = (not action.option_strings or action.required or default is None or default is False
                 or default == argparse.SUPPRESS or "default" in text.lower())
        if shown:
            return text
        value = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(value).replace('%', '%%')})"


def new_parser(prog: str, description: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """A parser in the one format of the `thunderep` commands (`HelpFormatter`)."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `thunderep NAME`, all its options: imports only the command's module."""
    module = importlib.import_module(COMMANDS[name][0])
    p = new_parser(f"thunderep {name}", module.__doc__)
    module.configure(p)
    return p


def _top_parser() -> argparse.ArgumentParser:
    p = new_parser("thunderep", "ThunderEP: expert parallelism for Mixture-of-Experts models on consumer PCIe "
                                "machines.", epilog="`thunderep COMMAND --help` shows a command's options; "
                                                    "`thunderep --version` the version.")
    p.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The whole `thunderep` parser: every command a subparser with all its options, as each prints them
    with --help (for a look at every option at once; `main` builds only the parser of the command it runs)."""
    p = _top_parser()
    sub = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, (module_name, help_) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_, description=module.__doc__, formatter_class=HelpFormatter)
        if hasattr(module, "configure"):  # (a module with only `main(argv)` parses its options itself)
            module.configure(command)
    return p


def _usage() -> str:
    p = _top_parser()
    sub = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_)
    return p.format_help()


def count_problems(args, at_least_1=(), at_least_0=()) -> list[str]:
    """The command-line counts among `args` (attribute names; those absent from `args` are skipped) below
    their minimum, one line each naming the option and its value."""
    flag = lambda name: "--" + name.replace("_", "-")
    return ([f"{flag(n)} must be at least 1, got {getattr(args, n)}" for n in at_least_1
             if n in args and getattr(args, n) < 1]
            + [f"{flag(n)} must be 0 or more, got {getattr(args, n)}" for n in at_least_0
               if n in args and getattr(args, n) < 0])


def add_model_options(p, ep_help: str = EP_ONE_HELP, ep_default: int | None = 1) -> None:
    """The --model and --ep options the commands that load a checkpoint share."""
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--ep", type=int, default=ep_default, help=ep_help)


def say(command: str, text: str, quiet: bool = False) -> None:
    """A line on what a command is doing (stderr, so that stdout holds only results); none with --quiet."""
    if not quiet:
        print(f"thunderep {command}: {text}", file=sys.stderr, flush=True)


# --quiet: what transformers and huggingface_hub read at import (the ranks' fork server imports them anew)
_QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
              "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


@contextlib.contextmanager
def quiet_libraries(quiet: bool = True):
    """While inside (with `quiet`): transformers' and huggingface_hub's progress bars ("Loading weights",
    "Writing model shards") and transformers' logged warnings are off, in this process and in the ranks it
    starts (they take this process's environment, and the fork server that forks them imports transformers
    with it). Afterwards both are as they were."""
    if not quiet:
        yield
        return
    before = {name: os.environ.get(name) for name in _QUIET_ENV}
    os.environ.update(_QUIET_ENV)
    undo = []
    if "transformers" in sys.modules:  # imported already: its settings are read; set them
        # optional dependency, imported already
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        undo.append(lambda: (hf_logging.set_verbosity(verbosity),
                             hf_logging.enable_progress_bar() if bars else None))
    try:
        yield
    finally:
        for step in undo:
            step()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), end="")
        return 0
    if argv[0] in ("-V", "--version"):
        # thunderep's __init__: light (its torch names load on first use)
        from .. import __version__

        print(f"thunderep {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"thunderep: unknown command {name!r}\n\n{_usage()}", file=sys.stderr, end="")
        return 2
    # THUNDEREP_DEBUG=1: Python's own form, which says where a warning came from
    with contextlib.nullcontext() if env.debug() else _one_line_warnings(f"thunderep {name}"):
        return _run(name, rest)


def entry() -> None:
    """The `thunderep` executable: `main`, then the process ends as soon as its exit handlers have run and its
    output is flushed, without the interpreter's teardown of every module (1-2 s after a run that imported
    torch and transformers and started ranks, which a failed or finished command would otherwise add)."""
    code = 1
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors and --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # before a command's own handler is in place (while it imports)
        print("thunderep: interrupted", file=sys.stderr)
        code = 130
    except BaseException:  # noqa: BLE001 - an error no handler expected: its traceback, which os._exit would lose
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # what a normal exit runs: multiprocessing's, logging's, the library's own
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _run(name: str, rest: list[str]) -> int:
    """The subcommand `name` with its arguments; an error it raises, as one line and an exit code."""
    module = importlib.import_module(COMMANDS[name][0])
    if hasattr(module, "configure"):  # --help and usage errors exit here, before anything heavy is imported
        args = command_parser(name).parse_args(rest)
        work = functools.partial(module.run, args)
    else:  # a module with only `main(argv)`, which parses inside
        work = functools.partial(module.main, rest)
    # deferred: thunderep.comm's package imports torch, which --help and usage errors must not wait for
    from ..comm.stop import stop_on_sigterm

    try:
        with stop_on_sigterm():
            return int(work() or 0)
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
