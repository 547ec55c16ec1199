"""`thunderep train`: expert-parallel training of a byte-level MoE language model on local text.

    torchrun --nproc_per_node=2 -m thunderep.cli train --steps 200      # or: thunderep train --nproc 2

Data: any text files (`--data FILE ...`), read as bytes (vocabulary 256, no tokenizer); by default the
English reference text that ships with Python (`pydoc_data.topics`), so it works offline. Each rank
draws its own batches; a fixed held-out slice gives the evaluation loss. NCCL with one GPU per rank
when the host has a GPU for each of its ranks (under torchrun, LOCAL_WORLD_SIZE of them), else gloo on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from . import count_problems

__all__ = ["argument_problems", "main", "parse_config", "parser", "to_config"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunderep train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to start on this host (default: one per GPU of this host, 2 CPU ranks on a host "
                        "without GPUs; ignored under torchrun)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--sync", choices=("every_step", "delta"), default="every_step")
    p.add_argument("--delta-steps", type=int, default=16)
    p.add_argument("--delta-dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0, help="every_step sync steps before delta mode")
    p.add_argument("--overlap", action="store_true", help="overlap the delta all-reduce with the next window")
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--balance", action="store_true", help="run the Stable/Negotiate/Migrate balancer")
    p.add_argument("--redundant", type=int, default=1, help="redundant expert slots per rank with --balance")
    p.add_argument("--compression", choices=("none", "bf16", "fp8"), default="none")
    p.add_argument("--data", nargs="*", help="text files (default: Python's bundled reference text)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches scored after training; 0: none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory: metrics.json, sync-tax report, Chrome trace")
    p.add_argument("--generate", type=int, default=0, help="bytes to generate after training")
    p.add_argument("--prompt", default="The ", help="the text --generate continues (default 'The ')")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--quiet", action="store_true", help="no progress lines or bar")
    return p


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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # deferred: torch and the training stack take seconds to import; --help must not pay them
    from ..comm.launch import launch, ranks_for_host
    from ..train.loop import train  # deferred, as comm.launch

    if args.nproc is None:
        args.nproc = ranks_for_host(2)  # experts that the ranks do not divide get a slot more on some ranks
    problems = argument_problems(args)
    for line in problems:
        print(f"thunderep train: {line}", file=sys.stderr)
    if problems:
        return 2
    launch(train, args.nproc, to_config(args))
    return 0
