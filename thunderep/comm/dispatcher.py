"""Dispatch tokens to the ranks that hold their experts, and combine the results back.

Shape legend: T local tokens, K experts per token, N = T * K (token, expert) pairs, D hidden size,
R ranks of the EP group, S slots per rank, P = R * S global slots, M rows this rank receives,
Q (token, k) pairs this rank's experts compute.

    plan(slots_W, weights_W, S) -> Plan        one control-plane exchange for all W waves
    dispatch_async(x_TD, meta)  -> handle; wait() -> x_QD pair rows grouped by local slot (meta.counts_S)
    combine_async(y_QD, handle.received) -> handle; wait() -> y_TD = sum_k weights_TK * y(t, k)

The dispatcher moves rows and knows no policy: the caller maps each (token, k) pair to a global slot
(`slots_TK`, slot p on rank p // S) before it (the placement, or the balancer's trade plan) and reads the
slot loads after it. Words of the caller's own (the balancer's fingerprint) may ride in the split-size
record (`Rider`), so that they cost no extra exchange.

Bytes are the cost on PCIe, so a token's hidden row travels once to each rank that holds at least one
of its experts (never more than R - 1 remote copies, however large K), with its K routing weights and
local slots (S where the pair is another rank's) in a small float32 side row. The receiver expands
rows to its (token, slot) pairs on the device; after the experts it sums each row's weighted outputs
(float32) and sends one row back per (token, rank); the token's own rank adds at most R rows. Where the
experts' kernels run (inference), both steps are theirs instead: the rows go to them as received
(`dispatch_async(expand=False)`), their row gather is the expand, and one pass after them sums each row's
weighted outputs (kernels/presum.py; `combine_async(summed=True)`). Counts
per global slot and rows per rank travel in the one split-size exchange: the plan's single wait for
the GPU, none in backward. Rows travel with variable-size `all_to_all_single`; nothing is dropped;
within a slot, pairs keep source-rank then token order. Autograd runs through both directions (the
backward of an all-to-all is the reverse all-to-all; the routing weights' gradients return through
the side rows). Every rank takes part in every collective, even with no tokens, and every wait is
bounded by the groups' timeout, so a dead or silent peer raises `CommError` naming the operation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..errors import CommError
from ..kernels import available
from .codec import Codec, get_codec
from .control import ControlPlane
from .control_records import RecordExchange
from .groups import EPGroups, peer_errors, wait_work
from .stats import CommStats

__all__ = ["DispatchMeta", "Dispatcher", "Pending", "Plan", "Received", "Rider", "row_layout"]


@dataclass(frozen=True, eq=False)
class DispatchMeta:
    """One wave's plan: which rows this rank sends, how many it receives, and its experts' load.

    num_tokens, top_k: T and K of the wave. send_tokens_N: int64 [n] the token of each row sent, rows
    grouped by destination rank (token order within a rank); send_rows_N: int64 [n] the same rows as
    flat (rank, token) indices r * T + t. side_NK2: float32 [n, 2K] each sent row's routing weights
    (differentiable; 0 for other ranks' pairs) and local slots on its destination (S: not there).
    send_splits / recv_splits: rows sent to / received from each EP rank (tuples of R ints).
    counts_S: [S] int64 pairs per local slot this rank computes (on the host: sizes are host data).
    sinks: the `CommStats` that record this wave's bytes and times.
    """

    num_tokens: int
    top_k: int
    send_tokens_N: torch.Tensor
    send_rows_N: torch.Tensor
    side_NK2: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    counts_S: torch.Tensor
    sinks: tuple = ()  # CommStats that record this wave's traffic (the runtime's and the layer's)


@dataclass(frozen=True, eq=False)
class Received:
    """What one wave's dispatch brought this rank, for its combine.

    meta: the wave's `DispatchMeta`. rows: M rows received. pairs_Q: [Q] flat (row, k) index of each pair
    this rank computes, in local-slot order (int32 where the kernels ordered them, else int64). weights_MK:
    [M, K] every received pair's routing weight (0: another rank's; differentiable), the side rows' own
    columns (strided, no copy). positions_N: int32 [M * K] where each flat pair sits in pairs_Q (-1: another
    rank's), where the kernels computed the order, else None. weights_N / weights_Q: [M * K] flat and [Q] the
    pairs' own, made on first use (the kernels' fused path and `presum_at` read weights_MK as it is)."""

    meta: DispatchMeta
    rows: int
    pairs_Q: torch.Tensor
    weights_MK: torch.Tensor
    positions_N: torch.Tensor | None = None

    @functools.cached_property
    def weights_N(self) -> torch.Tensor:
        return self.weights_MK.reshape(-1)

    @functools.cached_property
    def weights_Q(self) -> torch.Tensor:
        return self.weights_N[self.pairs_Q]


@dataclass(frozen=True)
class Rider:
    """Words that ride in the split-size record of `Dispatcher.plan`.

    on_device: int32 [n], copied to the host together with the split sizes (one device-to-host copy).
    encode: host int32 [n] -> int32 [w], the words this rank sends (w the same on every rank); None: the
    words are sent as they are on the device (then the counting kernel can write them into the record
    itself, `control_records`).
    """

    on_device: torch.Tensor
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True, eq=False)
class Plan:
    """What `Dispatcher.plan` agreed for one step.

    metas: one `DispatchMeta` per wave. rider_RW: int32 [R, w] every rank's rider words (w = 0 without a
    rider). counts_RP: int64 [R, R * S] the pairs each rank routed to each global slot this step (all
    waves; the same on every rank).
    """

    metas: list
    rider_RW: torch.Tensor
    counts_RP: torch.Tensor

    @property
    def load_P(self) -> torch.Tensor:
        """int64 [R * S] rows each global slot computes this step (all waves, all ranks)."""
        return self.counts_RP.sum(dim=0)


def _slot_counts(slots_N: torch.Tensor, P: int) -> torch.Tensor:
    """[P] int64 pairs per global slot; unlike torch.bincount on CUDA, no wait for the GPU."""
    return torch.zeros(P, dtype=torch.int64, device=slots_N.device).scatter_add_(0, slots_N, torch.ones_like(slots_N))


class Pending:
    """An all-to-all in flight. `wait()` returns its (decoded) result; call it exactly once."""

    def __init__(self, dispatcher: "Dispatcher", op: str, work, wire: torch.Tensor, out: torch.Tensor,
                 sent_R: list[int], started: float, sinks: tuple, codec: Codec, finish=None):
        self._d, self._op, self._work, self._wire, self._out = dispatcher, op, work, wire, out
        self._sent_R, self._started, self._sinks, self._codec, self._finish = sent_R, started, sinks, codec, finish
        self.received: Received | None = None  # a dispatch's, once waited for

    def wait(self) -> torch.Tensor:
        d = self._d
        if self._work is not None:
            blocked_from = time.perf_counter()
            with peer_errors(f"{self._op} all_to_all on EP rank {d.groups.ep_rank}", f"{d.groups.timeout_s:g} s",
                             d.control):
                wait_work(self._work, d.groups.timeout_s, self._wire.is_cuda)
            self._work = None
            if self._out is not self._wire:
                with torch.no_grad():
                    self._out.copy_(self._codec.decode(self._wire, self._out.dtype))
            now = time.perf_counter()
            for sink in self._sinks:
                sink.record(self._op, self._sent_R, now - self._started, now - blocked_from)
        return self._out if self._finish is None else self._finish(self._out)


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-size all-to-all; forward is asynchronous (see `Pending`)."""

    @staticmethod
    def forward(ctx, x_ND, dispatcher, send_splits, recv_splits, op, sinks, codec, box):
        ctx.args = (dispatcher, send_splits, recv_splits, op, sinks, codec)
        pending = dispatcher._launch(x_ND.detach(), send_splits, recv_splits, op, sinks, codec)
        box.append(pending)
        return pending._out

    @staticmethod
    def backward(ctx, grad_MD):
        dispatcher, send_splits, recv_splits, op, sinks, codec = ctx.args
        grad_ND = dispatcher._launch(grad_MD.contiguous(), recv_splits, send_splits, op + "_backward",
                                     sinks, codec).wait()
        return grad_ND, None, None, None, None, None, None, None


class Dispatcher:
    """Moves token rows between the ranks of one EP group (see the module docstring)."""

    def __init__(self, groups: EPGroups, control: ControlPlane, compression: str = "none"):
        self.groups = groups
        self.control = control
        self.codec: Codec = get_codec(compression)
        self.exact: Codec = get_codec("none")  # the side rows: weights and slot numbers, never rounded
        self.stats = CommStats(groups.ep_size, groups.ep_rank)
        # GPU-written split-size records (control_records.RecordExchange), set by the runtime where on
        self.records: RecordExchange | None = None

    # -- planning

    def plan(self, slots_W: list[torch.Tensor], weights_W: list[torch.Tensor], slots_per_rank: int,
             rider: Rider | None = None, stats: CommStats | None = None) -> Plan:
        """Split sizes of every wave, exchanged in one control-plane round.

        slots_W[w]: int64 [T_w, K] global slot of each (token, k) pair of wave w, in [0, R * slots_per_rank).
        weights_W[w]: [T_w, K] routing weights, applied where the experts run. rider: words sent in the
        same record. stats: a further `CommStats` (e.g. the layer's) that records this step. With `records`
        (ranks of one host, THUNDEREP_HOST_COLLECTIVE=1) and no rider or one sent as it is on the device,
        the counting kernel writes the records into host memory every rank maps: no device-to-host copy,
        no control-plane exchange."""
        R, S = self.groups.ep_size, slots_per_rank
        P, W, me = R * S, len(slots_W), self.groups.ep_rank
        # 1. per wave: pairs per global slot, rows per destination rank, the rows in send order (device)
        layouts = [row_layout(slots.reshape(weights.shape), weights, R, S) for slots, weights in zip(slots_W, weights_W)]
        records = self.records
        rider_V = None if rider is None or not rider.on_device.numel() else rider.on_device.to(torch.int32)
        if records is not None and (rider is None or rider.encode is None) and \
                records.fits(W, S, 0 if rider_V is None else rider_V.numel()):
            rows, record, started, on_host = self._records_on_device(records, slots_W, weights_W, S, rider_V)
            send_W = rows[me, :W * (P + R)].view(W, P + R)
        else:
            send_W, rows, record, started, on_host = self._records_through_host(slots_W, layouts, rider, P)
        all_RW = rows[:, :W * (P + R)].reshape(R, W, P + R)
        sinks = (self.stats,) if stats is None or stats is self.stats else (self.stats, stats)
        to_host_s, control_s = on_host - started, time.perf_counter() - on_host
        for sink in sinks:
            sink.record("split_sizes_to_host", [0] * R, to_host_s, blocked=0.0)
            sink.record("control", [record.numel() * 4 if r != me else 0 for r in range(R)], control_s)
        metas = []
        for w, (_, order_RT, side_RTK2) in enumerate(layouts):
            T, K = weights_W[w].shape
            send_splits = tuple(send_W[w, P:].tolist())
            send_rows = order_RT[:sum(send_splits)]
            metas.append(DispatchMeta(
                num_tokens=T, top_k=K, send_tokens_N=send_rows % max(T, 1), send_rows_N=send_rows,
                side_NK2=side_RTK2.reshape(R * T, 2 * K)[send_rows], send_splits=send_splits,
                recv_splits=tuple(all_RW[:, w, P + me].tolist()),
                counts_S=all_RW[:, w, me * S:(me + 1) * S].to(torch.int64).sum(0), sinks=sinks,
            ))
        return Plan(metas, rows[:, W * (P + R):], all_RW[:, :, :P].sum(dim=1).to(torch.int64))

    def _records_through_host(self, slots_W, layouts, rider: Rider | None, P: int):
        """The split-size records counted on the device, copied to the host (the plan's one wait for the
        GPU) and exchanged through the control plane -> (this rank's [W, P + R] counts, every rank's [R, L]
        record, this rank's record, start time, time on the host)."""
        R, W, me = self.groups.ep_size, len(slots_W), self.groups.ep_rank
        device = slots_W[0].device
        send_W = torch.stack([torch.cat([_slot_counts(slots.reshape(-1), P), rows_R])
                              for slots, (rows_R, _, _) in zip(slots_W, layouts)]).to(torch.int32)
        if rider is not None:  # the rider's device words come to the host in the same copy
            send_W = torch.cat([send_W.reshape(-1), rider.on_device.to(device, torch.int32)])
        started = time.perf_counter()
        with record_function("thunderep.split_sizes_to_host"):  # waits for this rank's GPU
            host = send_W.cpu().reshape(-1)
            send_W = host[:W * (P + R)].view(W, P + R)
            words = host[W * (P + R):]
            words = rider.encode(words) if rider is not None and rider.encode is not None else words
            record = torch.cat([send_W.reshape(-1), words])
        on_host = time.perf_counter()
        # one exchange; a collective control plane reports dead peers through torch errors
        with record_function("thunderep.control_exchange"), peer_errors(
                f"split-size exchange on EP rank {me}", "the process group's timeout", self.control):
            rows = self.control.exchange_tensor(record)
        return send_W, rows, record, started, on_host

    def _records_on_device(self, records, slots_W, weights_W, S: int, rider_V: torch.Tensor | None = None):
        """The split-size records (and the rider's device words, rider_V int32 [V]) written by the counting
        kernel into the host segment every rank of this host maps (`control_records.RecordExchange`), read
        back here -> (every rank's [R, L] record, this rank's record, start time, time on the host)."""
        me = self.groups.ep_rank
        started = time.perf_counter()
        with record_function("thunderep.device_records"), peer_errors(
                f"split-size exchange on EP rank {me}", "the records' timeout", self.control):
            rows = records.exchange([slots.reshape(weights.shape).to(torch.int64).contiguous()
                                     for slots, weights in zip(slots_W, weights_W)], S,
                                    None if rider_V is None else rider_V.contiguous())
        return rows, rows[me], started, started

    # -- data movement

    def _launch(self, x_ND: torch.Tensor, send_splits, recv_splits, op: str, sinks: tuple,
                codec: Codec | None = None) -> Pending:
        codec = codec or self.codec
        width, dtype = x_ND.shape[-1], x_ND.dtype
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
        return Pending(self, op, work, wire_out, out, [n * row_bytes for n in send_splits], started, sinks, codec)

    def _all_to_all(self, x_ND: torch.Tensor, send_splits, recv_splits, op: str, sinks: tuple,
                    codec: Codec) -> Pending:
        """A differentiable all-to-all in flight: wait() -> the received rows."""
        box: list[Pending] = []
        out = _AllToAll.apply(x_ND, self, send_splits, recv_splits, op, sinks, codec, box)
        box[0]._out = out  # the autograd output: what wait() fills and returns
        return box[0]

    def dispatch_async(self, x_TD: torch.Tensor, meta: DispatchMeta, expand: bool = True) -> Pending:
        """Send each token's row once to each rank holding one of its experts. wait() -> x_QD, one row per
        pair this rank computes, grouped by local slot (meta.counts_S); then `.received` is set. With
        `expand` False, wait() -> the M rows as received (`expand` them, or hand them to kernels that
        gather the pairs themselves)."""
        rows = self._all_to_all(x_TD[meta.send_tokens_N], meta.send_splits, meta.recv_splits, "dispatch",
                                meta.sinks, self.codec)
        side = self._all_to_all(meta.side_NK2, meta.send_splits, meta.recv_splits, "dispatch_side", meta.sinks,
                                self.exact)
        K = meta.top_k

        def arrived(x_MD: torch.Tensor) -> torch.Tensor:
            side_MK2 = side.wait()
            # the slots travel exactly (float32 of small integers, the exact codec): no rounding needed
            weights_MK, slot_MK = side_MK2[:, :K], side_MK2[:, K:].detach()
            # pairs of this rank in local-slot order (row order within a slot); where the kernels run, one
            # launch over the side rows as they arrived that also says where each pair landed (the pre-sum's
            # positions), else a stable sort (on 16-bit keys where they fit: 2 radix passes, not 8)
            positions_N = None
            if available(slot_MK.device):
                from ..kernels.slot_order import slot_order  # triton: optional, imported where the kernels run

                pairs_Q, positions_N = slot_order(slot_MK, meta.counts_S)
            else:
                key = torch.int16 if meta.counts_S.shape[0] < 2**15 else torch.int32
                pairs_Q = torch.argsort(slot_MK.to(key).reshape(-1), stable=True)[:int(meta.counts_S.sum())]
            rows.received = Received(meta, x_MD.shape[0], pairs_Q, weights_MK, positions_N)
            return self.expand(x_MD, rows.received) if expand else x_MD

        rows._finish = arrived
        return rows

    @staticmethod
    def expand(x_MD: torch.Tensor, received: Received) -> torch.Tensor:
        """The received rows -> x_QD, one per pair this rank computes, grouped by local slot."""
        return x_MD[received.pairs_Q // received.meta.top_k]

    def combine_async(self, y_QD: torch.Tensor, received: Received, summed: bool = False) -> Pending:
        """Sum each received row's weighted expert outputs (float32), return one row per (token, rank) to
        the token's rank. wait() -> [T, D] = sum_k weights_TK * y(t, k), in y_QD's dtype. summed: y is
        already [M, D], each received row's weighted sum (the experts' kernels did it)."""
        meta, K, D = received.meta, received.meta.top_k, y_QD.shape[-1]
        if summed:
            y_MD = y_QD
        elif available(y_QD.device):  # one pass over the pairs, in registers
            from ..kernels.presum import presum, presum_at  # triton: optional, imported where the kernels run

            grads = torch.is_grad_enabled() and (y_QD.requires_grad or received.weights_MK.requires_grad)
            if received.positions_N is not None and not grads:  # the positions the slot order gave
                y_MD = presum_at(y_QD, received.weights_MK, received.positions_N, received.rows, K)
            else:
                y_MD = presum(y_QD, received.weights_N, received.pairs_Q, received.rows, K)
        else:
            weighted_QD = y_QD.float() * received.weights_Q.float().unsqueeze(-1)
            full_ND = weighted_QD.new_zeros(received.rows * K, D).index_copy(0, received.pairs_Q, weighted_QD)
            y_MD = full_ND.view(received.rows, K, D).sum(dim=1).to(y_QD.dtype)  # k in order: deterministic
        back = self._all_to_all(y_MD, meta.recv_splits, meta.send_splits, "combine", meta.sinks, self.codec)
        T, R = meta.num_tokens, self.groups.ep_size

        def finish(back_ND: torch.Tensor) -> torch.Tensor:
            full_RTD = back_ND.new_zeros(R * T, D, dtype=torch.float32).index_copy(
                0, meta.send_rows_N, back_ND.float())
            return full_RTD.view(R, T, D).sum(dim=0).to(y_QD.dtype)  # at most R rows per token, in rank order

        back._finish = finish
        return back

    def dispatch(self, x_TD: torch.Tensor, slots_TK: torch.Tensor, weights_TK: torch.Tensor, slots_per_rank: int):
        """Synchronous single-wave dispatch: returns (x_QD grouped by local slot, `Received`)."""
        meta = self.plan([slots_TK], [weights_TK], slots_per_rank).metas[0]
        pending = self.dispatch_async(x_TD, meta)
        x_QD = pending.wait()
        return x_QD, pending.received

    def combine(self, y_QD: torch.Tensor, received: Received) -> torch.Tensor:
        """Synchronous combine: [Q, D] expert outputs in local-slot order -> [T, D]."""
        return self.combine_async(y_QD, received).wait()


def row_layout(slots_TK: torch.Tensor, weights_TK: torch.Tensor, R: int, S: int):
    """One wave's rows on the device, no wait for the GPU: (rows per destination rank int64 [R], flat
    (rank, token) indices in send order int64 [R * T] (the rows that travel first, rank-major, token
    order within a rank), side rows float32 [R, T, 2K]: each pair's routing weight where rank r holds
    it (else 0), then its local slot there (else S, one past its slots: the receiver's sort puts them last))."""
    T, K = slots_TK.shape
    dest_TK = torch.div(slots_TK, S, rounding_mode="floor")
    on_RTK = dest_TK.unsqueeze(0) == torch.arange(R, device=slots_TK.device).view(R, 1, 1)
    goes_RT = on_RTK.any(dim=2)
    order_RT = torch.argsort((~goes_RT).reshape(-1).to(torch.int8), stable=True)
    local_RTK = torch.where(on_RTK, slots_TK.unsqueeze(0) % S, S)
    weights_RTK = torch.where(on_RTK, weights_TK.unsqueeze(0).float(), 0.0)
    side_RTK2 = torch.cat([weights_RTK, local_RTK.float()], dim=2)
    return goes_RT.sum(dim=1), order_RT, side_RTK2
