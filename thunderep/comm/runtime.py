"""`ExpertParallel`: the per-process runtime shared by every MoE layer of a model.

It owns the EP process groups, the control plane and the `Dispatcher`, and provides the two
collectives of latency mode. Create it once, pass it to every `ThunderMoELayer`, `close()` it at the end.

Shape legend: T tokens, D hidden size.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ..config import EPConfig
from ..errors import CommError
from .control import ControlPlane, make_control_plane
from .dispatcher import Dispatcher
from .groups import EPGroups, init_expert_parallel

__all__ = ["ExpertParallel"]


class ExpertParallel:
    """Groups + control plane + dispatcher for one process (collective to construct and close)."""

    def __init__(self, groups: EPGroups, config: EPConfig | None = None):
        self.groups = groups
        self.config = config or EPConfig()
        self.control: ControlPlane = make_control_plane(
            self.config.control, groups.ep_group, record_bytes=self.config.record_bytes,
            timeout_s=self.config.timeout_s,
        )
        self.dispatcher = Dispatcher(groups, self.control, self.config.compression)

    @classmethod
    def init(cls, ep_size: int | None = None, config: EPConfig | None = None, **dist_kwargs) -> "ExpertParallel":
        """Initialise torch.distributed from torchrun's environment (or `dist_kwargs`) and build it."""
        config = config or EPConfig()
        groups = init_expert_parallel(ep_size, timeout_s=config.timeout_s, **dist_kwargs)
        return cls(groups, config)

    @property
    def stats(self):
        return self.dispatcher.stats

    def all_reduce_sum(self, x_TD: torch.Tensor, op: str = "latency_allreduce") -> torch.Tensor:
        """In-place sum over the EP group, bounded by the timeout."""
        started = time.perf_counter()
        try:
            work = dist.all_reduce(x_TD, group=self.groups.ep_group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.groups.timeout_s))
        except RuntimeError as exc:
            raise CommError(
                f"{op} on EP rank {self.groups.ep_rank} failed: a peer died or did not answer within "
                f"{self.groups.timeout_s:g} s ({str(exc).splitlines()[0][:200]})"
            ) from exc
        nbytes = x_TD.numel() * x_TD.element_size()
        sent = [0 if r == self.groups.ep_rank else nbytes for r in range(self.groups.ep_size)]
        self.stats.record(op, sent, time.perf_counter() - started)
        return x_TD

    def close(self) -> None:
        self.control.close()

    def __enter__(self) -> "ExpertParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReduceFromEP(torch.autograd.Function):
    """Forward: sum over the EP group. Backward: identity (every rank already holds the full grad)."""

    @staticmethod
    def forward(ctx, x_TD, ep: ExpertParallel):
        return ep.all_reduce_sum(x_TD.clone())

    @staticmethod
    def backward(ctx, grad_TD):
        return grad_TD, None


class CopyToEP(torch.autograd.Function):
    """Forward: identity (the input is replicated). Backward: sum the partial gradients over the group."""

    @staticmethod
    def forward(ctx, x, ep: ExpertParallel):
        ctx.ep = ep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ep.all_reduce_sum(grad.contiguous().clone(), op="latency_allreduce_backward"), None
