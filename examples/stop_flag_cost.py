"""What `thunderep finetune`'s stop flag costs a step: the all-reduce a step takes for its loss, alone, with
the flag beside the loss (two float32 values, `train.stopping.mean_loss_and_stop`), and with the flag in an
all-reduce of its own. Ranks on this host, gloo on CPU, the three ways interleaved round by round.

    python examples/stop_flag_cost.py --world 2 --calls 1000 --rounds 15

Prints each way's median time per call over the rounds (each round: `--calls` calls, timed together) and
its ratio to the loss alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from thunderep.train.stopping import mean_loss_and_stop
from thunderep.comm.launch import launch


def _loss_alone(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().float().reshape(1)
    dist.all_reduce(total)
    return total.item() / world


def _flag_apart(loss: torch.Tensor, world: int) -> tuple[float, bool]:
    flag = torch.zeros(1)
    dist.all_reduce(flag)
    return _loss_alone(loss, world), flag.item() > 0


def _rank(rank: int, world: int, calls: int, rounds: int) -> None:
    ways = {"loss alone": lambda loss: _loss_alone(loss, world),
            "loss and flag, one all-reduce": lambda loss: mean_loss_and_stop(loss, False, world),
            "loss, then the flag apart": lambda loss: _flag_apart(loss, world)}
    loss = torch.tensor(2.5)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name, way in ways.items():  # warm-up
        for _ in range(50):
            way(loss)
    for _ in range(rounds):
        for name, way in ways.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                way(loss)
            times[name].append((time.perf_counter() - start) / calls)
    if rank == 0:
        base = statistics.median(times["loss alone"])
        print(f"{world} gloo ranks, {calls} calls x {rounds} rounds, median per call:")
        for name, samples in times.items():
            us = statistics.median(samples) * 1e6
            print(f"  {name:<32} {us:8.1f} us  {us / (base * 1e6):.2f}x")
    dist.destroy_process_group()


def _main_rank(rank: int, world: int, calls: int, rounds: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _rank(rank, world, calls, rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    launch(_main_rank, args.world, args.calls, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
