"""`thunderep bench` targets of the expert-parallel core: `auto-mode` (mode="auto"'s choice against the
faster measured mode), `integrity` (what the mailbox's per-record checksum costs), and three that take their
benchmark module's own options (`offload`, `local-compute`, `host-collective`). Registered in
`thunderep.cli.bench`; here to keep that module's size."""

from __future__ import annotations

import argparse
import importlib

from . import count_problems, say

__all__ = ["BENCHES"]

SHAPES = ("qwen3", "mixtral")  # bench.auto_mode.SHAPES (tests/cli checks that they are equal)


def _auto_mode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="EP sizes to run")
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help="layer shapes")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096],
                   help="tokens per rank of each point")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per point")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per point")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo ranks in float32; cuda: NCCL, one GPU per rank, bfloat16")


def _run_auto_mode(a: argparse.Namespace) -> int:
    problems = count_problems(a, ("iters",)) + [f"--ranks must be 2 or more, got {r}" for r in a.ranks if r < 2]
    problems += [f"--tokens must be 1 or more, got {t}" for t in a.tokens if t < 1]
    problems += [f"--warmup must be 0 or more, got {a.warmup}"] if a.warmup < 0 else []
    if problems:
        raise SystemExit("thunderep bench auto-mode: " + "; ".join(problems))
    say("bench auto-mode", "importing torch, then starting ranks")
    from ..bench.auto_mode import AutoModeBench, report  # deferred: imports torch, which --help must not wait for

    print(report(AutoModeBench(ranks=tuple(a.ranks), shapes=tuple(a.shapes), tokens=tuple(a.tokens), iters=a.iters,
                               warmup=a.warmup, device=a.device)))
    return 0


def _integrity_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20_000, help="exchanges per timed block")
    p.add_argument("--blocks", type=int, default=21, help="timed blocks per setting; the fastest is shown")


def _run_integrity(a: argparse.Namespace) -> int:
    problems = count_problems(a, ("rounds", "blocks"))
    if problems:
        raise SystemExit("thunderep bench integrity: " + "; ".join(problems))
    from ..bench import integrity  # deferred: compiles C and maps the mailbox

    print(integrity.report(a.rounds, a.blocks))
    return 0


def _passthrough(module: str, name: str):
    """(options, run) of a target whose benchmark module parses its own options (`main(argv)`)."""
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("args", nargs=argparse.REMAINDER,
                       help=f"the benchmark's own options, after --; `thunderep bench {name} -- --help` lists them")

    def run(a: argparse.Namespace) -> int:
        argv = a.args[1:] if a.args[:1] == ["--"] else a.args
        say(f"bench {name}", "importing torch, then running")
        return int(importlib.import_module(module).main(argv) or 0)  # deferred: imports torch

    return options, run


# target -> (one-line help, description, options, run), as thunderep.cli.bench's
BENCHES = {
    "auto-mode": ("mode=\"auto\"'s choice against the faster measured mode (ep vs all-gather), 2 and 4 ranks",
                  ("Each equal-batch MoE layer call timed in ep mode and in all-gather mode, beside the cost rule's "
                   "estimates and the mode mode=\"auto\" picks: right where it picks the faster one."),
                  _auto_mode_options, _run_auto_mode),
    "integrity": ("what the mailbox's per-record XXH3 checksum costs",
                  ("The XXH3-64 hash of a record in C, and a mailbox exchange with the checksum off and on, per "
                   "record size (needs a source checkout and a C compiler)."),
                  _integrity_options, _run_integrity),
    "offload": ("expert offload: hot experts on the GPU, the rest in host memory, against accelerate's offload",
                ("Decode at batch 1 and 8 and prefill of a random MoE model with --gpu-memory budgets, against "
                 "transformers with accelerate's device_map=\"auto\", every expert on the host, and the whole "
                 "model on the GPU; the cost model's predictions beside the measured rates."),
                *_passthrough("thunderep.bench.offload", "offload")),
    "local-compute": ("one rank's local compute in ep mode, before and after one row per (token, rank)",
                      ("The receiving rank's expand, experts and pre-sum against the old path of one row per "
                       "(token, expert) pair, on the same inputs, outputs checked equal."),
                      *_passthrough("thunderep.bench.local_compute", "local-compute")),
    "host-collective": ("the all-reduce through pinned host memory on one GPU: the floor and the kernel",
                        ("A counter ping-ponged through mapped host memory (the floor), and the one-shot "
                         "all-reduce with ranks as streams of one GPU, in CUDA graphs (needs cupy)."),
                        *_passthrough("thunderep.bench.host_collective", "host-collective")),
}
