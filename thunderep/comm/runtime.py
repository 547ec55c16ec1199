"""`ExpertParallel`: the per-process runtime shared by every MoE layer of a model.

It owns the EP process groups, the control plane and the `Dispatcher`, and provides the collectives of
latency mode (all-reduce) and all-gather mode (all-gather, reduce-scatter). Create it once, pass it to
every `ThunderMoELayer`, `close()` it at the end.

With THUNDEREP_HOST_COLLECTIVE=1 on CUDA ranks of one host, latency mode's all-reduce and all-gather mode's
gathers and reduce-scatters (an all-reduce of the whole, this rank's block kept) of at most
`HOST_COLLECTIVE_BYTES` run through pinned host memory (`host_collective.HostCollective`: one kernel,
no host work per call, capturable in CUDA graphs) instead of NCCL. It is opt-in until its threshold against
NCCL is measured on several GPUs; a peer that never arrives raises PeerTimeout at the next call.

Shape legend: T tokens, D hidden size, C columns, R ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import env
from ..config import EPConfig
from ..errors import ConfigError
from .control import ControlPlane, all_gather_single, make_control_plane
from .control_records import RecordExchange
from .dispatcher import Dispatcher
from .groups import EPGroups, init_expert_parallel, peer_errors, wait_work
from .host_collective import SUM_DTYPES, HostCollective, use_host_path

__all__ = ["ExpertParallel", "GatherFromEP", "ScatterToEP"]

# Newer torch deprecates reduce_scatter_tensor in favour of reduce_scatter_single (see control.py).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

HOST_COLLECTIVE_BYTES = 256 << 10  # the host-memory all-reduce's segment: latency mode's messages are 8-64 KiB


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
        self.host_collective: HostCollective | None = None
        if env.host_collective() and groups.device.type == "cuda" and groups.ep_size > 1:
            self.host_collective = HostCollective.for_group(HOST_COLLECTIVE_BYTES, groups.ep_group,
                                                            device=groups.device)
            self.dispatcher.records = RecordExchange.for_group(self.config.record_bytes, groups.ep_group,
                                                               device=groups.device, timeout_s=self.config.timeout_s)

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
        """In-place sum over the EP group, bounded by the timeout: through host memory where that is on
        (module docstring) and the message fits, else NCCL / gloo."""
        nbytes = x_TD.numel() * x_TD.element_size()
        if x_TD.is_contiguous() and self._host_path(x_TD, nbytes, sums=True):
            return self._on_host(op, x_TD, lambda: self.host_collective.all_reduce_(x_TD), x_TD)
        return self._collective(op, x_TD, lambda: dist.all_reduce(x_TD, group=self.groups.ep_group, async_op=True))

    def all_gather_rows(self, x_TC: torch.Tensor, op: str = "allgather", stats=None) -> torch.Tensor:
        """[T, C] on every rank (the same T everywhere) -> [R * T, C], rank r's rows at r * T: through host
        memory where that is on and every rank's rows fit (module docstring), else NCCL / gloo.
        `stats`: a further `CommStats` (e.g. the layer's) that records the bytes."""
        x_TC = x_TC.contiguous()
        R = self.groups.ep_size
        out = x_TC.new_empty(R * x_TC.shape[0], *x_TC.shape[1:])
        if self._host_path(x_TC, R * x_TC.numel() * x_TC.element_size(), sums=False):
            return self._on_host(op, x_TC, lambda: self.host_collective.all_gather(x_TC, out.view(R, *x_TC.shape)),
                                 out, stats)
        return self._collective(op, x_TC, lambda: all_gather_single(
            out, x_TC, group=self.groups.ep_group, async_op=True), out, stats)

    def reduce_scatter_rows(self, x_RTC: torch.Tensor, op: str = "reduce_scatter", stats=None) -> torch.Tensor:
        """[R * T, C] partial sums on every rank -> [T, C]: this rank's block of the sum over ranks. Through
        host memory where that is on and the whole [R * T, C] fits: a one-shot all-reduce of it (R times the
        bytes, all in host memory; float32 sums in rank order), this rank's block taken."""
        x_RTC = x_RTC.contiguous()
        R, me = self.groups.ep_size, self.groups.ep_rank
        T = x_RTC.shape[0] // R
        if self._host_path(x_RTC, x_RTC.numel() * x_RTC.element_size(), sums=True):
            summed = x_RTC.clone()
            return self._on_host(op, x_RTC, lambda: self.host_collective.all_reduce_(summed),
                                 summed[me * T:(me + 1) * T], stats)
        out = x_RTC.new_empty(T, *x_RTC.shape[1:])
        return self._collective(op, out, lambda: _reduce_scatter_single(
            out, x_RTC, group=self.groups.ep_group, async_op=True), out, stats)

    def _host_path(self, x: torch.Tensor, nbytes: int, sums: bool) -> bool:
        """Whether a collective of `x` moving `nbytes` per rank goes through the host collective."""
        hc = self.host_collective
        return hc is not None and x.is_cuda and x.numel() > 0 and (not sums or x.dtype in SUM_DTYPES) and \
            use_host_path(nbytes, same_host=True, capacity=hc.capacity)

    def _on_host(self, op: str, sent: torch.Tensor, launch, result: torch.Tensor, stats=None) -> torch.Tensor:
        """Enqueue `launch()` on the host collective (a peer that gave up before: PeerTimeout naming it) and
        record `sent`'s bytes under op + "_host"; nothing waits."""
        started = time.perf_counter()
        self.host_collective.check()
        launch()
        nbytes = sent.numel() * sent.element_size()
        sent_R = [0 if r == self.groups.ep_rank else nbytes for r in range(self.groups.ep_size)]
        for sink in self._sinks(stats):
            sink.record(op + "_host", sent_R, time.perf_counter() - started, blocked=0.0)
        return result

    def auto_mode(self, T: int, stats=None, allgather_wins: Callable[[int], bool] | None = None) -> str:
        """Mode "auto" for a layer call with T tokens on this rank: "allgather" when every EP rank holds
        the same T, T <= `config.allgather_max_tokens` (None: no bound) and `allgather_wins(T)` (None:
        always), else "ep". One control-plane exchange of [T, -T] (host data only: no wait for the
        GPU); `allgather_wins` must depend only on T and what every rank shares, so every rank gets
        the same answer."""
        bound = self.config.allgather_max_tokens
        if self.groups.ep_size == 1 or bound == 0:
            return "ep"
        most, neg_least = self._token_range(T, stats)
        if most != -neg_least or (bound is not None and most > bound):
            return "ep"
        return "allgather" if allgather_wins is None or allgather_wins(most) else "ep"

    def check_same_tokens(self, T: int, what: str = "all-gather mode", stats=None) -> None:
        """Raise ConfigError unless every EP rank passes the same T (one control-plane exchange)."""
        most, neg_least = self._token_range(T, stats)
        if most != -neg_least:
            raise ConfigError(
                f"{what} needs the same number of tokens on every EP rank; rank {self.groups.ep_rank} has {T}, "
                f"others between {-neg_least} and {most} (pad the batch, or use ep mode)"
            )

    def all_gather_mode(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, partial,
                        stats=None, checked: bool = False) -> torch.Tensor:
        """All-gather mode's exchange around this rank's expert work: every rank's tokens, routing
        weights and ids are gathered, `partial(x_all, weights_all, ids_all)` computes this rank's share
        ([R * T, D]) and a reduce-scatter returns [T, D] for this rank's tokens (differentiable in x and
        the weights). `checked`: the token counts are already known to be equal (auto mode)."""
        if not checked:
            self.check_same_tokens(x_TD.shape[0], stats=stats)
        x_all = GatherFromEP.apply(x_TD, self, stats)
        w_all = GatherFromEP.apply(weights_TK, self, stats)
        ids_all = self.all_gather_rows(ids_TK, op="allgather_ids", stats=stats)  # ids carry no gradient
        return ScatterToEP.apply(partial(x_all, w_all, ids_all), self, stats)

    def _sinks(self, stats) -> tuple:
        """The runtime's `CommStats`, and `stats` (e.g. a layer's) when it is another one."""
        return (self.stats,) if stats is None or stats is self.stats else (self.stats, stats)

    def _token_range(self, T: int, stats=None) -> list[int]:
        """[max T, -min T] over the EP ranks (one control-plane exchange, recorded as "control" here and
        in `stats`)."""
        me, R = self.groups.ep_rank, self.groups.ep_size
        started = time.perf_counter()
        with peer_errors(f"token-count exchange on EP rank {me}", "the process group's timeout", self.control):
            out = self.control.allreduce_max([T, -T])
        seconds = time.perf_counter() - started
        for sink in self._sinks(stats):
            sink.record("control", [0 if r == me else 16 for r in range(R)], seconds)
        return out

    def _collective(self, op: str, sent_TC: torch.Tensor, launch, result: torch.Tensor | None = None,
                    stats=None) -> torch.Tensor:
        """Run `launch()` (an async collective over the EP group), wait bounded by the timeout, and record
        `sent_TC`'s bytes as sent to every peer."""
        started = time.perf_counter()
        with peer_errors(f"{op} on EP rank {self.groups.ep_rank}", f"{self.groups.timeout_s:g} s", self.control):
            wait_work(launch(), self.groups.timeout_s, sent_TC.is_cuda)
        nbytes = sent_TC.numel() * sent_TC.element_size()
        sent = [0 if r == self.groups.ep_rank else nbytes for r in range(self.groups.ep_size)]
        seconds = time.perf_counter() - started
        for sink in self._sinks(stats):
            sink.record(op, sent, seconds)
        return sent_TC if result is None else result

    def close(self) -> None:
        if self.host_collective is not None:
            self.host_collective.close()
            self.host_collective = None
        if self.dispatcher.records is not None:
            self.dispatcher.records.close()
            self.dispatcher.records = None
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


class GatherFromEP(torch.autograd.Function):
    """Forward: all-gather rows over the EP group ([T, C] -> [R * T, C]). Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x_TC, ep: ExpertParallel, stats=None):
        ctx.ep, ctx.stats = ep, stats
        return ep.all_gather_rows(x_TC, stats=stats)

    @staticmethod
    def backward(ctx, grad_RTC):
        return ctx.ep.reduce_scatter_rows(grad_RTC, op="allgather_backward", stats=ctx.stats), None, None


class ScatterToEP(torch.autograd.Function):
    """Forward: reduce-scatter partial sums ([R * T, C] -> this rank's [T, C]). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x_RTC, ep: ExpertParallel, stats=None):
        ctx.ep, ctx.stats = ep, stats
        return ep.reduce_scatter_rows(x_RTC, stats=stats)

    @staticmethod
    def backward(ctx, grad_TC):
        return ctx.ep.all_gather_rows(grad_TC, op="reduce_scatter_backward", stats=ctx.stats), None, None
