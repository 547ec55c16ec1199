"""Dispatch tokens to the ranks that hold their experts, and combine the results back.

Shape legend: T local tokens, K experts per token, N = T * K (token, expert) pairs, D hidden size,
R ranks of the EP group, S slots per rank, P = R * S global slots, M rows this rank receives.

    plan(slots_W, weights_W, S) -> Plan        one control-plane exchange for all W waves
    dispatch_async(x_TD, meta)  -> handle; wait() -> x_MD rows grouped by local slot (meta.counts_S)
    combine_async(y_MD, meta)   -> handle; wait() -> y_TD = sum_k weights_TK * y(t, k)

The dispatcher moves rows and knows no policy: the caller maps each (token, k) pair to a global slot
(`slots_TK`, slot p on rank p // S) before it (the placement, or the balancer's trade plan) and reads the
slot loads after it. Words of the caller's own (the balancer's fingerprint) may ride in the split-size
record (`Rider`), so that they cost no extra exchange.

Rows travel with variable-size `all_to_all_single`; nothing is dropped; the permutation is stable
(pairs sorted by global slot, ties in token order). Autograd runs through both directions: the
backward of an all-to-all is the reverse all-to-all. Every rank takes part in every collective, even
with no tokens, and every wait is bounded by the groups' timeout, so a dead or silent peer raises
`CommError` naming the operation instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from collections.abc import Callable

from ..errors import CommError
from .codec import Codec, get_codec
from .control import ControlPlane
from .groups import EPGroups, peer_errors, wait_work
from .stats import CommStats

__all__ = ["DispatchMeta", "Dispatcher", "Pending", "Plan", "Rider"]


@dataclass(frozen=True, eq=False)
class DispatchMeta:
    """Everything combine() needs to undo dispatch() for one wave of tokens.

    send_order_N / send_inverse_N: pairs sorted by global slot and back (int64 [N]).
    send_splits / recv_splits: rows sent to / received from each EP rank (tuples of R ints).
    local_order_M / local_inverse_M: received rows (grouped by source rank) to local-slot order and back.
    counts_S: [S] int64 rows per local slot, in local-slot order (on the host: sizes are host data).
    weights_TK: the routing weights, applied in combine (differentiable).
    sinks: the `CommStats` that record this wave's bytes and times.
    """

    num_tokens: int
    top_k: int
    send_order_N: torch.Tensor
    send_inverse_N: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    local_order_M: torch.Tensor
    local_inverse_M: torch.Tensor
    counts_S: torch.Tensor
    weights_TK: torch.Tensor
    sinks: tuple = ()  # CommStats that record this wave's traffic (the runtime's and the layer's)


@dataclass(frozen=True)
class Rider:
    """Words that ride in the split-size record of `Dispatcher.plan`.

    on_device: int32 [n], copied to the host together with the split sizes (one device-to-host copy).
    encode: host int32 [n] -> int32 [w], the words this rank sends (w the same on every rank).
    """

    on_device: torch.Tensor
    encode: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class Plan:
    """What `Dispatcher.plan` agreed for one step.

    metas: one `DispatchMeta` per wave. load_P: int64 [R * S] rows each global slot computes this step
    (all waves, all ranks; the same on every rank). rider_RW: int32 [R, w] every rank's rider words
    (w = 0 without a rider).
    """

    metas: list
    load_P: torch.Tensor
    rider_RW: torch.Tensor


def _slot_counts(slots_N: torch.Tensor, P: int) -> torch.Tensor:
    """[P] int64 pairs per global slot; unlike torch.bincount on CUDA, no wait for the GPU."""
    return torch.zeros(P, dtype=torch.int64, device=slots_N.device).scatter_add_(0, slots_N, torch.ones_like(slots_N))


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _slot_major_order(recv_RS: list[list[int]], device: torch.device) -> torch.Tensor:
    """The order that takes received rows (grouped by source rank, each rank's rows by local slot) to
    local-slot order (source ranks in order within a slot), built on `device` from the host counts
    recv_RS[r][s]. Only R * S numbers are worked on the host; the M indices are made on the device
    without waiting for it: `repeat_interleave` with a known output size, after one small copy (the
    CPU `repeat_interleave` would fork torch's thread pool for a handful of groups)."""
    R = len(recv_RS)
    S = len(recv_RS[0]) if R else 0
    start_RS, src = [], 0
    for counts in recv_RS:  # where each (rank, slot) group begins in the received rows
        start_RS.append([])
        for n in counts:
            start_RS[-1].append(src)
            src += n
    shift_G, length_G, dst = [], [], 0  # groups G = (slot, rank) in local order
    for s in range(S):
        for r in range(R):
            n = recv_RS[r][s]
            shift_G.append(start_RS[r][s] - dst)
            length_G.append(n)
            dst += n
    # non_blocking: a host-to-device copy that would otherwise wait for this rank's GPU
    shift_length = torch.tensor([shift_G, length_G], dtype=torch.int64).to(device, non_blocking=True)
    return torch.arange(dst, device=device) + torch.repeat_interleave(shift_length[0], shift_length[1],
                                                                      output_size=dst)


class Pending:
    """An all-to-all in flight. `wait()` returns its (decoded) result; call it exactly once."""

    def __init__(self, dispatcher: "Dispatcher", op: str, work, wire: torch.Tensor, out: torch.Tensor,
                 sent_R: list[int], started: float, sinks: tuple, finish=None):
        self._d, self._op, self._work, self._wire, self._out = dispatcher, op, work, wire, out
        self._sent_R, self._started, self._sinks, self._finish = sent_R, started, sinks, finish

    def wait(self) -> torch.Tensor:
        d = self._d
        if self._work is not None:
            blocked_from = time.perf_counter()
            with peer_errors(f"{self._op} all_to_all on EP rank {d.groups.ep_rank}", f"{d.groups.timeout_s:g} s"):
                wait_work(self._work, d.groups.timeout_s, self._wire.is_cuda)
            self._work = None
            if self._out is not self._wire:
                with torch.no_grad():
                    self._out.copy_(d.codec.decode(self._wire, self._out.dtype))
            now = time.perf_counter()
            for sink in self._sinks:
                sink.record(self._op, self._sent_R, now - self._started, now - blocked_from)
        return self._out if self._finish is None else self._finish(self._out)


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-size all-to-all; forward is asynchronous (see `Pending`)."""

    @staticmethod
    def forward(ctx, x_ND, dispatcher, send_splits, recv_splits, op, sinks, box):
        ctx.args = (dispatcher, send_splits, recv_splits, op, sinks)
        pending = dispatcher._launch(x_ND.detach(), send_splits, recv_splits, op, sinks)
        box.append(pending)
        return pending._out

    @staticmethod
    def backward(ctx, grad_MD):
        dispatcher, send_splits, recv_splits, op, sinks = ctx.args
        grad_ND = dispatcher._launch(grad_MD.contiguous(), recv_splits, send_splits, op + "_backward",
                                     sinks).wait()
        return grad_ND, None, None, None, None, None, None


class Dispatcher:
    """Moves token rows between the ranks of one EP group (see the module docstring)."""

    def __init__(self, groups: EPGroups, control: ControlPlane, compression: str = "none"):
        self.groups = groups
        self.control = control
        self.codec: Codec = get_codec(compression)
        self.stats = CommStats(groups.ep_size, groups.ep_rank)

    # -- planning

    def plan(self, slots_W: list[torch.Tensor], weights_W: list[torch.Tensor], slots_per_rank: int,
             rider: Rider | None = None, stats: CommStats | None = None) -> Plan:
        """Split sizes of every wave, exchanged in one control-plane round.

        slots_W[w]: int64 [T_w, K] (or [T_w * K]) global slot of each (token, k) pair of wave w, in
        [0, R * slots_per_rank). weights_W[w]: [T_w, K] routing weights, applied in combine. rider: words
        sent in the same record. stats: a further `CommStats` (e.g. the layer's) that records this step."""
        R, S = self.groups.ep_size, slots_per_rank
        P, W, me = R * S, len(slots_W), self.groups.ep_rank
        device = slots_W[0].device
        flat_W = [slots.reshape(-1) for slots in slots_W]
        orders = [torch.argsort(slots_N, stable=True) for slots_N in flat_W]
        send_WP = torch.stack([_slot_counts(slots_N, P) for slots_N in flat_W]).to(torch.int32)
        if rider is not None:  # the rider's device words come to the host in the same copy
            send_WP = torch.cat([send_WP.reshape(-1), rider.on_device.to(device, torch.int32)])
        started = time.perf_counter()
        with record_function("thunderep.split_sizes_to_host"):  # waits for this rank's GPU
            host = send_WP.cpu()  # the one device-to-host copy of the plan; the rest is host data
            send_WP = host[:W * P].view(W, P)
            words = rider.encode(host[W * P:]) if rider is not None else torch.zeros(0, dtype=torch.int32)
            record = torch.cat([send_WP.reshape(-1), words])
        on_host = time.perf_counter()
        # A collective control plane reports dead peers through torch errors.
        with record_function("thunderep.control_exchange"), peer_errors(
                f"split-size exchange on EP rank {me}", "the process group's timeout"):
            rows = self.control.exchange_tensor(record)
        all_RWP = rows[:, :W * P].reshape(R, W, P)
        sinks = (self.stats,) if stats is None or stats is self.stats else (self.stats, stats)
        to_host_s, control_s = on_host - started, time.perf_counter() - on_host
        for sink in sinks:
            sink.record("split_sizes_to_host", [0] * R, to_host_s, blocked=0.0)
            sink.record("control", [record.numel() * 4 if r != me else 0 for r in range(R)], control_s)
        metas = []
        for w in range(W):
            recv_RS = all_RWP[:, w, me * S:(me + 1) * S].to(torch.int64)
            local_order_M = _slot_major_order(recv_RS.tolist(), device)
            metas.append(DispatchMeta(
                num_tokens=weights_W[w].shape[0], top_k=weights_W[w].shape[1],
                send_order_N=orders[w], send_inverse_N=_inverse(orders[w]),
                send_splits=tuple(send_WP[w].view(R, S).sum(1).tolist()),
                recv_splits=tuple(recv_RS.sum(1).tolist()),
                local_order_M=local_order_M, local_inverse_M=_inverse(local_order_M),
                counts_S=recv_RS.sum(0), weights_TK=weights_W[w], sinks=sinks,
            ))
        return Plan(metas, all_RWP.sum(dim=(0, 1)).to(torch.int64), rows[:, W * P:])

    # -- data movement

    def _launch(self, x_ND: torch.Tensor, send_splits, recv_splits, op: str, sinks: tuple) -> Pending:
        codec, width, dtype = self.codec, x_ND.shape[-1], x_ND.dtype
        wire_in = codec.encode(x_ND)
        rows = sum(recv_splits)
        wire_out = torch.empty(rows, codec.wire_width(width, dtype), dtype=codec.wire_dtype(dtype),
                               device=x_ND.device)
        out = wire_out if wire_out.dtype == dtype else torch.empty(rows, width, dtype=dtype, device=x_ND.device)
        row_bytes = codec.row_bytes(width, dtype)
        started = time.perf_counter()
        try:
            work = dist.all_to_all_single(wire_out, wire_in, list(recv_splits), list(send_splits),
                                          group=self.groups.ep_group, async_op=True)
        except RuntimeError as exc:
            raise CommError(f"{op} all_to_all on EP rank {self.groups.ep_rank} failed to start: "
                            f"{str(exc).splitlines()[0][:200]}") from exc
        return Pending(self, op, work, wire_out, out, [n * row_bytes for n in send_splits], started, sinks)

    def dispatch_async(self, x_TD: torch.Tensor, meta: DispatchMeta) -> Pending:
        """Send each (token, k) row to its slot's rank. wait() -> [M, D] grouped by local slot."""
        x_ND = x_TD[meta.send_order_N // meta.top_k]
        box: list[Pending] = []
        recv_MD = _AllToAll.apply(x_ND, self, meta.send_splits, meta.recv_splits, "dispatch", meta.sinks, box)
        pending = box[0]
        pending._out = recv_MD
        pending._finish = lambda recv: recv[meta.local_order_M]
        return pending

    def combine_async(self, y_MD: torch.Tensor, meta: DispatchMeta) -> Pending:
        """Return expert outputs to their tokens' ranks. wait() -> [T, D] weighted sum over k."""
        y_recv = y_MD[meta.local_inverse_M]
        box: list[Pending] = []
        back_ND = _AllToAll.apply(y_recv, self, meta.recv_splits, meta.send_splits, "combine", meta.sinks, box)
        pending = box[0]
        pending._out = back_ND
        T, K = meta.num_tokens, meta.top_k

        def finish(back: torch.Tensor) -> torch.Tensor:
            pairs_ND = back[meta.send_inverse_N]
            weighted = pairs_ND.view(T, K, pairs_ND.shape[-1]) * meta.weights_TK.unsqueeze(-1)
            return weighted.sum(dim=1).to(y_MD.dtype)

        pending._finish = finish
        return pending

    def dispatch(self, x_TD: torch.Tensor, slots_TK: torch.Tensor, weights_TK: torch.Tensor, slots_per_rank: int):
        """Synchronous single-wave dispatch: returns (x_MD grouped by local slot, DispatchMeta)."""
        meta = self.plan([slots_TK], [weights_TK], slots_per_rank).metas[0]
        return self.dispatch_async(x_TD, meta).wait(), meta

    def combine(self, y_MD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """Synchronous combine: [M, D] expert outputs in local-slot order -> [T, D]."""
        return self.combine_async(y_MD, meta).wait()
