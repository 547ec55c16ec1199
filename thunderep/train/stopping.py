"""SIGTERM on a fine-tuning run: every rank stops after the same step, which --checkpoint saves first.

Before the first step (loading, the first held-out score) SIGTERM raises `Stopped`: nothing is worth
keeping yet. From the first step on it only marks the request; the all-reduce of the loss that ends
every step carries it to all ranks (`mean_loss_and_stop`).
"""

from __future__ import annotations

import shlex

import torch
import torch.distributed as dist

from ..comm.stop import raise_stopped

__all__ = ["StopAtStep", "mean_loss_and_stop", "stopped_line"]


class StopAtStep:
    """SIGTERM on a fine-tuning rank (its handler, `comm.stop.stop_on_sigterm`, as a server has its own).
    Before the first step it raises `Stopped`; from the first step on (`training`) it only marks the
    request (`asked`), and all ranks then stop after the same step, with --checkpoint saving it first.
    SIGTERM again changes nothing here (systemd sends it to every process and the launcher passes its own
    on as well); the launcher ends the ranks at a second SIGTERM to it, or --stop-timeout after the first."""

    def __init__(self):
        self.training = False
        self.asked = False

    def __call__(self, signum, frame) -> None:
        if not self.training:
            raise_stopped(signum, frame)
        self.asked = True


def mean_loss_and_stop(loss: torch.Tensor, asked: bool, world: int) -> tuple[float, bool]:
    """The mean of the ranks' step losses and whether any rank was asked to stop, from one all-reduce of
    two float32 values: the one a step takes for its loss anyway, so that ranks which took SIGTERM at
    different steps, or one rank alone, all stop after the same step (collective: every rank calls it once
    per step). loss: [] (any float dtype, any device)."""
    both = torch.stack([loss.detach().float().reshape(()), loss.new_full((), float(asked), dtype=torch.float32)])
    dist.all_reduce(both)
    total, asked_ranks = both.tolist()  # waits for the step: the step times are real
    return total / world, asked_ranks > 0


def stopped_line(checkpoint: str | None, step: int, steps: int) -> str:
    """What a run of `steps` stopped by SIGTERM after step `step` (counted from 1) says it kept."""
    if checkpoint:
        return (f"stopped by SIGTERM after step {step}/{steps}: saved the checkpoint of step {step} in "
                f"{checkpoint}; the same command (--checkpoint {shlex.quote(checkpoint)}) resumes from "
                f"step {step}")
    return (f"stopped by SIGTERM after step {step}/{steps}: nothing was saved and --out was not written (no "
            f"--checkpoint; with --checkpoint DIR this run would have saved step {step} and the same command "
            f"would resume from it)")
