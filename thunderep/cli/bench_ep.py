"""Two `thunderep bench` targets of the expert-parallel core: `auto-mode` (mode="auto"'s choice against the
faster measured mode) and `integrity` (what the mailbox's per-record checksum costs). Registered in
`thunderep.cli.bench`; here to keep that module's size."""

from __future__ import annotations

import argparse

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
}
