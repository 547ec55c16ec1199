"""Gradient-sync convergence study: every_step vs delta (DiLoCo) with H in {4, 16, 64}, equal tokens.

    python examples/convergence_study.py --steps 600 --nproc 2

Trains the byte-level MoE model on Python's bundled reference text on `--nproc` CPU ranks, once per
sync mode with the same seed and data order, and prints final evaluation loss and gradient-sync bytes
side by side, with ratios against every_step.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.multiprocessing as mp

from thunderep.comm.launch import launch
from thunderep.cli.train import argument_problems, parser, to_config
from thunderep.train.loop import train


def run(args: argparse.Namespace, nproc: int) -> dict:
    queue = mp.get_context("spawn").SimpleQueue()
    launch(train, nproc, to_config(args), queue)
    return queue.get()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--h", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    a = p.parse_args()
    common = ["--steps", str(a.steps), "--seq-len", "64", "--batch", "8", "--nproc", str(a.nproc), "--quiet"]
    outer = ["--outer-lr", str(a.outer_lr), "--outer-momentum", str(a.outer_momentum)]
    runs = [("every_step", common + ["--sync", "every_step"])]
    runs += [(f"delta H={h}", common + ["--sync", "delta", "--delta-steps", str(h)] + outer) for h in a.h]
    runs = [(name, parser().parse_args(extra)) for name, extra in runs]
    # every run's arguments checked before the first starts (--nproc 0 waited forever for a result)
    problems = list(dict.fromkeys(problem for _, args in runs for problem in argument_problems(args)))
    if problems:
        p.error("; ".join(problems).replace("--delta-steps", "--h"))
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{a.nproc} gloo ranks; {a.steps} steps x 8 sequences x 64 bytes per rank; "
          f"delta: outer lr {a.outer_lr}, momentum {a.outer_momentum}")
    rows = [(name, run(args, a.nproc)) for name, args in runs]
    base = rows[0][1]
    print(f"{'mode':<12} | {'eval loss':>9} | {'vs every_step':>13} | {'sync MB/rank':>12} | {'bytes ratio':>11} | "
          f"{'tok/s':>7}")
    for name, m in rows:
        print(f"{name:<12} | {m['eval_loss']:9.4f} | {100 * (m['eval_loss'] / base['eval_loss'] - 1):+12.2f}% | "
              f"{m['sync']['bytes'] / 1e6:12.2f} | {base['sync']['bytes'] / max(1, m['sync']['bytes']):10.1f}x | "
              f"{m['tokens_per_s']:7,.0f}")


if __name__ == "__main__":
    main()
