"""The expert-parallel forward of one MoE layer: the modes, the waves, the local partial, the mode choice.

Shape legend: T tokens of this rank, D hidden size, K experts per token, E experts, S local slots,
R ranks of the EP group, P = R * S global slots, M rows this rank's experts compute.

`ThunderMoELayer` and the transformers experts binding (`thunderep.hf.experts`) both route with their
own router and call `ExpertParallelMoE.forward` with their experts' compute passed in (`LocalExperts`),
as torchtitan's `ExpertParallel` wraps an unmodified `GroupedExperts`:

    ep mode        each rank its own tokens; rows travel to the ranks holding their experts and back
    latency mode   every rank the same tokens (batch-1 decode): local partial, one all-reduce
    allgather      each rank its own T tokens, the same T everywhere: gather all, local partial on all,
                   reduce-scatter (the baseline of frameworks without an EP kernel library; the faster
                   mode for small batches)

`mode="auto"` picks latency mode when the caller says every rank holds the same tokens
(`replicated=True`), ep mode under a balancer (its words ride in ep mode's dispatch record), ep mode
when the ranks' token counts differ, else the mode `mode_seconds` estimates faster from T, the
placement and per-backend constants (`COSTS`): data every rank has after one exchange of (T, -T), so
every rank picks the same (docs/benchmarks/2026-12-05-auto-mode.md).
Each layer carries one `ExpertParallelMoE`; `moe_layers(model)` lists them for training sync,
checkpoints and telemetry whatever the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..balance.layer_balancer import LayerBalancer
from ..balance.migrate import migrate_slots, slot_bytes
from ..balance.placement import Placement
from ..comm.dispatcher import Rider
from ..comm.runtime import CopyToEP, ExpertParallel, ReduceFromEP
from ..comm.stats import CommStats
from ..errors import ConfigError
from ..kernels.graphs import capturing
from .router import expert_counts
from .staging import to_device

__all__ = ["COSTS", "MODES", "ExpertParallelMoE", "LocalExperts", "MoELayer", "ModeCosts", "attach", "mode_seconds",
           "moe_layers", "reach_per_rank", "wave_bounds"]

MODES = ("auto", "ep", "latency", "allgather")
ATTRIBUTE = "_thunderep_moe"  # the attribute of the module holding a layer's expert tensors


@dataclass(frozen=True)
class LocalExperts:
    """This rank's experts as the core calls them; every output is unweighted, [M, D].

    sorted(x_MD, counts_S): rows grouped by local slot, counts_S int64 [S] on the host.
    by_slot(x_MD, slot_M): rows in any order, slot_M int64 [M] on the device (no host sync; the
        capturable latency path). None: the caller never runs capturable.
    pairs(x_TD, local_TK, weights_TK, fallback, num_experts, kind): the decode pair kernels' weighted
        [T, D] share (local_TK -1: another rank's expert), or None where they do not apply. None: no
        such kernels.
    summed(x_MD, counts_S, pairs_Q, weights_MK, top_k, positions_N): ep mode's received rows, weighted [M, D]:
        row m sums its pairs m * top_k + k listed in pairs_Q (grouped by slot) with weights_MK [M, top_k]
        (any strides, or flat [M * top_k]),
        the expand fused into the experts' input gather and the pre-sum one pass after them (positions_N:
        where each flat pair sits in pairs_Q, or None); None where that does not apply (gradients). None:
        no such kernels.
    """

    sorted: Callable
    by_slot: Callable | None = None
    pairs: Callable | None = None
    summed: Callable | None = None


def wave_bounds(T: int, waves: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `waves` waves over T tokens; the first T % waves waves one token longer.
    Every rank has the same number of waves (their collectives pair up), some maybe empty."""
    bounds, start = [], 0
    for w in range(waves):
        stop = start + T // waves + (1 if w < T % waves else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class ModeCosts:
    """The constants of mode "auto"'s rule for one backend (`mode_seconds`; measurements and sources in
    docs/benchmarks/2026-12-05-auto-mode.md).

    a2a_us / ring_us: latency per message of an all-to-all / an all-gather or reduce-scatter (one over
    R ranks costs R - 1 of them). link_GBps: bytes a rank sends to its peers per second (1e9).
    local_GBps: bytes of float32 pair rows ([rows * K, D]) a rank's local work fills and sums per second
    (inf: counted as free). ep_extra_us / ep_extra_backward_us: what ep mode costs beyond all-gather
    mode per forward / backward whatever T (the plan's host work, its wait for the GPU, the split-size
    exchange)."""

    a2a_us: float
    ring_us: float
    link_GBps: float
    local_GBps: float
    ep_extra_us: float
    ep_extra_backward_us: float = 0.0


COSTS = {  # by the EP group's device: "gloo" for CPU ranks, "nccl" for GPUs (fitted to PCIe without P2P)
    "gloo": ModeCosts(a2a_us=322.0, ring_us=704.0, link_GBps=0.29, local_GBps=0.27, ep_extra_us=0.0),
    "nccl": ModeCosts(a2a_us=76.7, ring_us=89.1, link_GBps=22.81, local_GBps=math.inf, ep_extra_us=299.0),
}


def reach_per_rank(placement: Placement, top_k: int) -> list[float]:
    """[R] the chance that a token's K distinct experts, drawn uniformly from E, include one that rank r
    holds: 1 - C(E - n_r, K) / C(E, K), n_r the distinct experts on rank r."""
    E = placement.num_experts
    return [1.0 - math.comb(E - len(set(placement.experts_of(r))), top_k) / math.comb(E, top_k)
            for r in range(placement.ep_size)]


def mode_seconds(T: int, reach_R: Sequence[float], K: int, D: int, row_bytes: int, element_bytes: int,
                 costs: ModeCosts, backward: bool = False) -> dict[str, float]:
    """Estimated seconds of one layer call with T tokens on each of R = len(reach_R) ranks, in "ep" and
    "allgather" mode: collectives x (R - 1) x latency + bytes sent / link_GBps + local pair-row bytes /
    local_GBps (+ ep mode's fixed extra). Every input is the same on every rank: so is the answer. backward: a training call (every collective and byte again, mirrored).

    reach_R: `reach_per_rank`. row_bytes: one dispatched row on the wire (the codec's). element_bytes:
    one element of the model's dtype (all-gather mode sends rows uncompressed).
      ep: rows per token to other ranks sum(reach) - min(reach) (the busiest sender), each with a
          float32 side row of 2K (weights, slots), and the same rows back; 3 all-to-alls per pass; the
          busiest receiver fills R T max(reach) K float32 pair rows.
      allgather: (R - 1) T rows of x, K float32 weights and K int64 ids out, (R - 1) T rows back
          (reduce-scatter); 4 collectives forward, 3 backward; every rank fills R T K pair rows."""
    R, passes = len(reach_R), 2 if backward else 1
    c = costs
    ep_link = T * (sum(reach_R) - min(reach_R)) * (2 * row_bytes + 8 * K)
    ep_local = R * T * max(reach_R) * K * D * 4
    ep = (c.ep_extra_us + (c.ep_extra_backward_us if backward else 0.0) + passes * 3 * (R - 1) * c.a2a_us) * 1e-6
    ep += passes * (ep_link / (c.link_GBps * 1e9) + ep_local / (c.local_GBps * 1e9))
    ag_link = (R - 1) * T * (2 * D * element_bytes + 12 * K)
    ag_local = R * T * K * D * 4
    allgather = (4 + (3 if backward else 0)) * (R - 1) * c.ring_us * 1e-6
    allgather += passes * (ag_link / (c.link_GBps * 1e9) + ag_local / (c.local_GBps * 1e9))
    return {"ep": ep, "allgather": allgather}


class ExpertParallelMoE:
    """One MoE layer's experts spread over an EP group: where they are (`placement`), the runtime that
    moves rows (`ep`), the optional balancer, this layer's traffic (`stats`) and calls per mode."""

    def __init__(self, ep: ExpertParallel, placement: Placement, balancer: LayerBalancer | None = None):
        R = ep.groups.ep_size
        if placement.ep_size != R:
            raise ConfigError(f"placement is for {placement.ep_size} ranks but the EP group has {R}")
        self.ep, self.placement, self.balancer = ep, placement, balancer
        if balancer is not None and (balancer.config.probes == "all" or (
                balancer.config.probes == "auto" and ep.dispatcher.records is not None)):
            balancer.replicate(ep.groups.ep_rank)  # nothing in the forward needs the host for the balancer
        self.stats = CommStats(R, ep.groups.ep_rank)
        self.calls = {"ep": 0, "latency": 0, "allgather": 0}
        # mode "auto"'s constants for this backend (replaceable), and its last estimate (seconds per mode)
        self.costs: ModeCosts = COSTS["gloo" if ep.groups.device.type == "cpu" else "nccl"]
        self.last_estimate: dict[str, float] | None = None
        self._reach: tuple = (None, 0, [])

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Logical expert id of each local slot."""
        return tuple(self.placement.experts_of(self.ep.groups.ep_rank))

    # -- the forward

    def choose_mode(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, mode: str = "auto",
                    replicated: bool = False) -> str:
        """The mode a call with x_TD ([T, D]) and ids_TK ([T, K]) on this rank runs in (see the module
        docstring); "auto" with neither `replicated` nor a balancer costs one control-plane exchange."""
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if mode != "auto":
            return mode
        if replicated:
            return "latency"
        if self.balancer is not None:
            return "ep"
        K, D = ids_TK.shape[1], x_TD.shape[1]
        row_bytes = self.ep.dispatcher.codec.row_bytes(D, x_TD.dtype)
        backward = torch.is_grad_enabled()  # a training call: the backward moves as much again

        def allgather_wins(T: int) -> bool:  # T: every rank's, so every rank decides alike
            self.last_estimate = mode_seconds(T, self.reach(K), K, D, row_bytes, x_TD.element_size(), self.costs,
                                              backward)
            return self.last_estimate["allgather"] < self.last_estimate["ep"]

        return self.ep.auto_mode(x_TD.shape[0], self.stats, allgather_wins)

    def reach(self, top_k: int) -> list[float]:
        """`reach_per_rank` of the current placement (cached per placement and K)."""
        placement, k, reach_R = self._reach
        if placement is not self.placement or k != top_k:
            reach_R = reach_per_rank(self.placement, top_k)
            self._reach = (self.placement, top_k, reach_R)
        return reach_R

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, experts: LocalExperts, *,
                mode: str = "auto", replicated: bool = False, capturable: bool = False,
                shared: Callable | None = None) -> torch.Tensor:
        """sum_k weights_TK * expert_{ids_TK}(x_TD) (+ shared(x_TD)): [T, D] in x_TD's dtype.

        x_TD: [T, D]. ids_TK: int64 [T, K] global expert ids. weights_TK: [T, K]. capturable (latency
        mode): no host sync, shapes fixed by T alone, so that a CUDA graph can capture the call.
        shared: the layer's shared experts, run while ep mode's rows are in flight."""
        chosen = self.choose_mode(x_TD, ids_TK, mode, replicated)
        if capturable and chosen != "latency":
            raise ConfigError(f"capturable runs need latency mode, not {chosen!r}")
        self.calls[chosen] += 1
        if chosen == "ep":
            return self._forward_ep(x_TD, ids_TK, weights_TK, experts, shared)
        if chosen == "latency":
            x_e, w_e = CopyToEP.apply(x_TD, self.ep), CopyToEP.apply(weights_TK, self.ep)
            partial_TD = self.local_partial(x_e, w_e, ids_TK, experts, capturable)
            y_TD = ReduceFromEP.apply(partial_TD, self.ep).to(x_TD.dtype)
        else:  # reduce-scattered in the model's dtype, as the frameworks this mode stands for do
            y_TD = self.ep.all_gather_mode(
                x_TD, weights_TK, ids_TK, lambda x, w, ids: self.local_partial(x, w, ids, experts).to(x_TD.dtype),
                self.stats, checked=mode == "auto")
        return y_TD if shared is None else y_TD + shared(x_TD)

    def _forward_ep(self, x_TD, ids_TK, weights_TK, experts: LocalExperts, shared) -> torch.Tensor:
        dispatcher = self.ep.dispatcher
        bounds = wave_bounds(x_TD.shape[0], self.ep.config.waves)
        # 1. slots, 2. one control exchange for every wave (the balancer's words riding along)
        metas = self.plan([ids_TK[a:b] for a, b in bounds], [weights_TK[a:b] for a, b in bounds])
        # 3. dispatch every wave
        pending = [dispatcher.dispatch_async(x_TD[a:b], meta, expand=False) for (a, b), meta in zip(bounds, metas)]
        # 4. shared experts on the local tokens while the rows are in flight
        shared_TD = shared(x_TD) if shared is not None else None
        # 5. compute each wave's rows as they arrive, 6. combine them back
        combines = []
        for rows, meta in zip(pending, metas):
            combines.append(self._compute_wave(rows, meta, experts))
        y_TD = torch.cat([c.wait() for c in combines]).to(x_TD.dtype)
        return y_TD if shared_TD is None else y_TD + shared_TD

    def _compute_wave(self, rows, meta, experts: LocalExperts):
        """One wave's rows as they arrive -> its combine in flight: the kernels' fused expand and pre-sum
        where they apply (`LocalExperts.summed`), else the rows expanded to pairs, the experts, the
        dispatcher's pre-sum."""
        dispatcher = self.ep.dispatcher
        x_MD = rows.wait()  # one row per (token, rank), as received
        received = rows.received
        if experts.summed is not None:
            K = meta.top_k
            y_MD = experts.summed(x_MD, meta.counts_S, received.pairs_Q, received.weights_MK, K, received.positions_N)
            if y_MD is not None:
                return dispatcher.combine_async(y_MD, received, summed=True)
        x_QD = dispatcher.expand(x_MD, received)  # one row per pair of this rank, grouped by local slot
        return dispatcher.combine_async(experts.sorted(x_QD, meta.counts_S), received)

    def plan(self, ids_W: list[torch.Tensor], weights_W: list[torch.Tensor]) -> list:
        """ep mode's layout and split sizes for waves of ids ([T_w, K] each): the balancer's trade plan
        (else the placement) maps pairs to slots, one exchange agrees the split sizes, and the step's
        loads go to the stats and the balancer. Returns one `DispatchMeta` per wave."""
        me, R, S = self.ep.groups.ep_rank, self.ep.groups.ep_size, self.placement.slots_per_rank
        rider = None
        if self.balancer is not None:
            slots_W = [self.balancer.assign(me, ids).to(ids.device) for ids in ids_W]
            if self.balancer.replicated:  # the bandwidth word alone, written as it is
                rider = Rider(to_device(self.balancer.words(), ids_W[0].device))
            else:
                counts_E = sum(expert_counts(ids, self.num_experts) for ids in ids_W)
                rider = Rider(counts_E.to(torch.int32), self.balancer.record)
        else:
            table_E = self.placement.slot_table(me, ids_W[0].device)
            slots_W = [table_E[ids] for ids in ids_W]
        plan = self.ep.dispatcher.plan(slots_W, weights_W, S, rider, self.stats)
        load_P = plan.load_P
        load_R = load_P.view(R, S).sum(dim=1).tolist()
        if self.balancer is not None:  # every rank holds every rank's splits: the same totals everywhere
            counts_RE = torch.zeros(R, self.num_experts, dtype=torch.int64).index_add_(
                1, self.placement.slot_experts_P, plan.counts_RP) if self.balancer.replicated else None
            self.balancer.received(plan.rider_RW, load_R, counts_RE)  # counts_RE: each rank's pairs per expert
        load_E = torch.zeros(self.num_experts, dtype=torch.int64).index_add_(
            0, self.placement.slot_experts_P, load_P).tolist()
        for sink in {id(s): s for s in (self.ep.stats, self.stats)}.values():
            sink.loads_R.append(load_R)
            sink.loads_E.append(load_E)
        return plan.metas

    def local_partial(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                      experts: LocalExperts, capturable: bool = False) -> torch.Tensor:
        """sum_k weights_TK * expert(x) over the (token, k) pairs whose expert this rank owns (its first
        replica), zero elsewhere: float32 [T, D], this rank's share when every rank holds every token."""
        T, K = ids_TK.shape
        D = x_TD.shape[-1]

        def sorted_partial(local_TK: torch.Tensor) -> torch.Tensor:
            if capturable and experts.by_slot is not None:  # every pair, other ranks' as slot 0, masked: no sync
                here_N1 = local_TK.reshape(-1, 1) >= 0
                y_ND = experts.by_slot(x_TD.repeat_interleave(K, dim=0), local_TK.reshape(-1).clamp(min=0))
                weighted_ND = torch.where(here_N1, y_ND * weights_TK.reshape(-1, 1).to(y_ND.dtype), 0)
                return weighted_ND.view(T, K, D).float().sum(dim=1)
            pairs, local_slot = self.placement.sorted_local_pairs(local_TK)  # a host sync
            counts_S = torch.bincount(local_slot, minlength=self.placement.slots_per_rank).cpu()
            y_MD = experts.sorted(x_TD[pairs // K], counts_S)
            weighted_MD = y_MD * weights_TK.reshape(-1)[pairs].unsqueeze(-1).to(y_MD.dtype)
            full_ND = weighted_MD.new_zeros(T * K, D).index_copy(0, pairs, weighted_MD)
            return full_ND.view(T, K, D).float().sum(dim=1)

        local_TK = self.placement.local_slots(ids_TK, self.ep.groups.ep_rank)
        if experts.pairs is not None:  # the decode pair kernels (or offloaded tiers' calls): no sort, no host sync
            partial_TD = experts.pairs(x_TD, local_TK, weights_TK, sorted_partial, self.num_experts,
                                       "every pair" if capturable else "sorted")
            if partial_TD is not None:
                return partial_TD.float()
        if capturable and experts.by_slot is None and capturing(x_TD.device):
            raise ConfigError("capturable latency mode needs experts that compute rows in any order (by_slot)")
        return sorted_partial(local_TK)  # outside a capture (its eager step) the sorted rows, with their sync

    # -- at step boundaries

    def balance_step(self, params: list[nn.Parameter], optimizer=None):
        """After the optimizer step: run the balancer on this step's exchanged records; on a migration,
        move `params` (this layer's expert-sharded parameters) and `optimizer`'s state for them to the
        new placement, in place. Collective over the EP group. Returns the `Decision` or None."""
        if self.balancer is None:
            return None
        if self.balancer.sized_by_layer:  # one slot's weights and optimizer state, the same on every rank
            self.balancer.set_slot_bytes(slot_bytes(params, optimizer))
        decision = self.balancer.step(self.stats)
        if decision is not None and decision.migrated:
            started = time.perf_counter()
            sent = migrate_slots(params, self.placement, decision.placement, self.ep.groups, optimizer)
            self.placement = decision.placement
            R = self.ep.groups.ep_size
            self.stats.record("migration", [sent // max(1, R - 1)] * R, time.perf_counter() - started)
        return decision


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a model as training sync, checkpoints and telemetry see it.

    name: path (from the model's root) of the module holding the expert tensors; their state-dict keys
    are f"{name}.{tensor}". module: that module. owner: the layer object that attached it (a
    `ThunderMoELayer`, or an `ExpertsBinding` of a wrapped transformers model), read live: `core` (its
    `ExpertParallelMoE`, None where every expert is local), `num_experts`, `tensors` (names of the
    expert-sharded tensors on `module`, leading dim = local slots), `checkpoint_key` (its name in
    checkpoints, or None for the path above `module`), `restores_placement` (a checkpoint's placement
    is set back on resume).
    """

    name: str
    module: nn.Module
    owner: object

    @property
    def core(self) -> ExpertParallelMoE | None:
        return self.owner.core

    @property
    def num_experts(self) -> int:
        return self.owner.num_experts

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(self.owner.tensors)

    @property
    def key(self) -> str:
        """The layer's name in checkpoints: the owner's own, else the path of the module above `module`."""
        return self.owner.checkpoint_key or self.name.rpartition(".")[0]

    @property
    def placement(self) -> Placement:
        if self.core is not None:
            return self.core.placement
        return Placement(self.num_experts, (tuple(range(self.num_experts)),))

    def parameters(self) -> list[nn.Parameter]:
        """The expert-sharded parameters (one leading entry per local slot)."""
        return [t for t in (getattr(self.module, n) for n in self.tensors) if isinstance(t, nn.Parameter)]


def attach(module: nn.Module, owner) -> None:
    """Mark `module` as holding the expert tensors of the MoE layer `owner` (a plain attribute: not a
    submodule, not in the state dict), so that `moe_layers` finds it (see `MoELayer` for `owner`)."""
    module.__dict__[ATTRIBUTE] = owner


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every MoE layer of `model` (ThunderEP layers and wrapped transformers experts alike), in module
    order: the modules `attach` marked."""
    return [MoELayer(name, module, module.__dict__[ATTRIBUTE]) for name, module in model.named_modules()
            if ATTRIBUTE in module.__dict__]
