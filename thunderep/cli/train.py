"""`thunderep train`: expert-parallel training of a byte-level MoE language model on local text.

    thunderep train --steps 200                  # one rank per GPU, or 2 CPU ranks on a host without GPUs
    torchrun --nproc_per_node=2 -m thunderep.cli train --steps 200

Data: any text files (--data FILE ...), read as bytes (vocabulary 256, no tokenizer); by default the English
reference text that ships with Python, so it works offline. Each rank draws its own batches; a fixed held-out
slice gives the evaluation loss. NCCL with one GPU per rank when the host has a GPU for each of its ranks
(under torchrun, LOCAL_WORLD_SIZE of them), else gloo on CPU. At the end: the losses, tokens per second and
the sync-tax report (what expert parallelism cost, and what to try first).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from . import command_parser, count_problems, say

__all__ = ["argument_problems", "configure", "main", "parse_config", "parser", "run", "to_config"]


def configure(p: argparse.ArgumentParser, nproc_default: int | None = None) -> None:
    """`thunderep train`'s options; `nproc_default`: --nproc's default (None: one rank per GPU)."""
    p.add_argument("--nproc", type=int, default=nproc_default,
                   help="ranks to start on this host, ignored under torchrun" + (
                       " (default: one per GPU of this host, so that every GPU holds a share of the experts; "
                       "2 CPU ranks on a host without GPUs)" if nproc_default is None else ""))
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (warm-up, then cosine to 0)")
    _add_model_options(p)
    _add_sync_options(p)
    p.add_argument("--data", nargs="*", help="text files (default: Python's bundled reference text)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches scored after training; 0: none")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of each rank's batches")
    p.add_argument("--out", help="run directory for metrics.json, the sync-tax report (`thunderep report DIR`) "
                                 "and a Chrome trace (default: none written)")
    p.add_argument("--generate", type=int, default=0, help="bytes to generate after training (0: none)")
    p.add_argument("--prompt", default="The ", help="the text --generate continues")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of --generate; 0: greedy")
    p.add_argument("--quiet", action="store_true", help="print only the results: no progress lines or bar")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the model")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, each with a MoE layer")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    p.add_argument("--waves", type=int, default=1,
                   help="split each MoE layer's tokens into this many waves whose dispatch, expert compute and "
                        "combine overlap (the results do not change)")
    p.add_argument("--compression", choices=("none", "bf16", "fp8"), default="none",
                   help="payload of dispatch and combine and their gradients: none, bf16, or fp8 (e4m3 with a "
                        "float32 scale per row)")
    p.add_argument("--balance", action="store_true",
                   help="the load balancer on every MoE layer: replicas of hot experts in spare slots, trades "
                        "between replicas, migrations between steps (the math is unchanged)")
    p.add_argument("--redundant", type=int, default=1, help="spare expert slots per rank with --balance")


def _add_sync_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sync", choices=("every_step", "delta"), default="every_step",
                   help="gradient sync of the replicated weights: every_step (an all-reduce per step, as DDP) or "
                        "delta (local steps, then an all-reduce of the change: DiLoCo)")
    p.add_argument("--delta-steps", type=int, default=16, help="local steps per window with --sync delta")
    p.add_argument("--delta-dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="wire dtype of the delta all-reduce with --sync delta")
    p.add_argument("--outer-lr", type=float, default=1.0, help="learning rate of the outer step with --sync delta")
    p.add_argument("--outer-momentum", type=float, default=0.0,
                   help="Nesterov momentum of the outer step with --sync delta")
    p.add_argument("--warmup", type=int, default=0, help="every_step sync steps before delta mode starts")
    p.add_argument("--overlap", action="store_true",
                   help="with --sync delta: run the delta all-reduce behind the next window (applied one window late)")


def parser() -> argparse.ArgumentParser:
    """The parser of `thunderep train`."""
    return command_parser("train")


def to_config(args: argparse.Namespace):
    """The `TrainConfig` of parsed `thunderep train` arguments (--nproc aside)."""
    # deferred: train.loop imports torch, which takes seconds; --help must not pay it
    from ..train.loop import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def parse_config(argv: list[str] | None = None):
    """The `TrainConfig` of a `thunderep train` command line, unchecked."""
    return to_config(parser().parse_args(argv))


def argument_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with these arguments, checked before any rank starts (before, --nproc 0 did nothing
    and succeeded, --steps 0 divided by zero, and an --out that is a file failed after the training)."""
    problems = count_problems(args, ("nproc", "steps", "batch", "seq_len", "hidden", "layers", "experts", "top_k",
                                     "delta_steps", "waves"), ("warmup", "redundant", "eval_batches", "generate"))
    if "lr" in args and not 0 < args.lr < math.inf:
        problems.append(f"--lr must be positive and finite, got {args.lr}")
    if "outer_lr" in args and not 0 < args.outer_lr < math.inf:
        problems.append(f"--outer-lr must be positive and finite, got {args.outer_lr}")
    if "outer_momentum" in args and not 0 <= args.outer_momentum < 1:
        problems.append(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if "temperature" in args and not 0 <= args.temperature < math.inf:
        problems.append(f"--temperature must be 0 (greedy) or positive and finite, got {args.temperature}")
    if "top_k" in args and args.top_k > args.experts >= 1:
        problems.append(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if getattr(args, "generate", 0) > 0 and "prompt" in args and not args.prompt:  # failed after the training
        problems.append("--prompt must not be empty with --generate: give the text to continue")
    data = getattr(args, "data", None) or []
    problems += [f"--data {f} is a directory: give the text files in it (e.g. --data {Path(f) / '*.txt'})"
                 for f in data if Path(f).is_dir()]
    missing = [f for f in data if not Path(f).is_file() and not Path(f).is_dir()]
    if missing:
        problems.append(f"--data: no such file: {', '.join(missing)}")
    if args.out:
        problems += _out_problems(args.out)
    return problems


def _out_problems(where: str) -> list[str]:
    """--out: a directory, or one that can be made, and writable."""
    # deferred: train.files imports torch, which takes seconds; --help must not pay it
    from ..train.files import nearest_existing

    out = Path(where).absolute()
    parent = nearest_existing(out)
    if parent == out and not out.is_dir():
        return [f"--out {where} exists and is not a directory"]
    if parent != out and not parent.is_dir():
        return [f"--out {where}: cannot create it, {parent} is not a directory"]
    if not os.access(parent, os.W_OK):
        return [f"--out {where}: {parent} is not writable"]
    return []


def run(args: argparse.Namespace, command: str = "train") -> int:
    """`thunderep train` (or `thunderep demo`, `command`) with these arguments."""
    ranks = f"{args.nproc} ranks" if args.nproc else "the ranks (one per GPU, or 2 on CPU)"
    say(command, f"starting {ranks}", args.quiet)  # before the seconds that importing torch takes
    # deferred: torch and the training stack take seconds to import; --help must not pay them
    from ..comm.launch import launch, ranks_for_host

    # deferred, as comm.launch
    from ..train.loop import train

    if args.nproc is None:
        args.nproc = ranks_for_host(2)  # experts that the ranks do not divide get a slot more on some ranks
    problems = argument_problems(args)
    for line in problems:
        print(f"thunderep {command}: {line}", file=sys.stderr)
    if problems:
        return 2
    launch(train, args.nproc, to_config(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))
