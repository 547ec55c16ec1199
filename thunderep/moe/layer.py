"""`ThunderMoELayer`: router + routed experts + optional shared experts, single process or expert-parallel.

Shape legend: T tokens (of this rank), D hidden size, K experts per token, E experts, S local slots,
N = T * K pairs, M rows this rank's experts compute.

Expert-parallel ("ep") mode: each rank routes its own tokens (attention and dense weights replicated,
"DP attention"), rows travel to the ranks holding their experts and back (`comm.Dispatcher`), split
into `EPConfig.waves` waves so communication overlaps expert compute; shared experts run on the local
tokens while the dispatch is in flight.

Latency mode: every rank holds the same tokens (batch-1 decode), computes only the pairs whose expert
it owns, and one all-reduce sums the partial outputs; no dispatch. `mode="auto"` picks latency mode
when the caller passes `replicated=True` (all ranks hold the same tokens); otherwise all-gather mode
for small equal batches (below) and EP mode for the rest.

All-gather mode: each rank holds its own tokens (the same number on every rank); every rank gathers
all tokens and routings, computes its own experts on all of them, and a reduce-scatter returns each
rank its tokens' sums. Each rank sends (R - 1) T rows each way where EP mode sends about
T K (R - 1) / R; it is the baseline that frameworks without an EP kernel library use (vLLM's
`allgather_reducescatter`). For small batches it is also the faster mode: no split sizes, no host
synchronization, and few bytes either way. `mode="auto"` uses it when every rank holds the same number
of tokens, at most `EPConfig.allgather_max_tokens` (decode steps; one control-plane exchange decides).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..balance.placement import Placement
from ..comm.dispatcher import CommStats
from ..config import LayerConfig, SharedExpertsConfig
from ..errors import ConfigError
from .experts import ACTIVATION_FNS, FusedExperts
from .router import Routing, TopKRouter, expert_counts

__all__ = ["SharedExperts", "ThunderMoELayer"]

MODES = ("auto", "ep", "latency", "allgather")


class SharedExperts(nn.Module):
    """A gated MLP every token uses; names match Hugging Face (`gate_proj`, `up_proj`, `down_proj`).

    With `SharedExpertsConfig.gated`, the output is scaled by sigmoid(x @ gate.weight.T), the
    Qwen2-MoE `shared_expert_gate`.
    """

    def __init__(self, config: SharedExpertsConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        D, I = config.hidden_size, config.intermediate_size
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(D, I, **kw)
        self.up_proj = nn.Linear(D, I, **kw)
        self.down_proj = nn.Linear(I, D, **kw)
        self.gate = nn.Linear(D, 1, **kw) if config.gated else None
        self.act = ACTIVATION_FNS[config.activation]
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.02)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        y_TD = self.down_proj(self.act(self.gate_proj(x_TD)) * self.up_proj(x_TD))
        if self.gate is not None:
            y_TD = F.sigmoid(self.gate(x_TD)) * y_TD
        return y_TD


def _wave_bounds(T: int, waves: int) -> list[tuple[int, int]]:
    sizes = [T // waves + (1 if w < T % waves else 0) for w in range(waves)]
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


class ThunderMoELayer(nn.Module):
    """One MoE layer. forward(x) with x [..., D] returns y of the same shape and dtype.

    ep: an `ExpertParallel` runtime; without it the layer holds all experts in this process.
    placement: which logical experts each EP rank holds (default: contiguous blocks); the local
        `experts` hold the slots of this rank, in slot order (`local_experts`).
    `forward(x, return_routing=True)` also returns the `Routing` (for auxiliary losses and logging).
    """

    def __init__(self, config: LayerConfig, *, ep=None, placement: Placement | None = None,
                 balancer=None, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.ep = ep
        experts_config = config.experts
        if ep is not None:
            E, R = config.experts.num_experts, ep.groups.ep_size
            placement = placement or Placement.contiguous(E, R)
            if placement.num_experts != E or placement.ep_size != R:
                raise ConfigError(
                    f"placement ({placement.num_experts} experts on {placement.ep_size} ranks) does not match "
                    f"the layer ({E} experts) and the EP group ({R} ranks)"
                )
            experts_config = replace(experts_config, num_experts=placement.slots_per_rank)
            device = device if device is not None else ep.groups.device
        self.placement = placement
        # The layer's balancer (a `BalancerConfig` turns it on; EP mode only).
        self.balancer = None
        if balancer is not None and ep is not None:
            from ..balance.layer_balancer import LayerBalancer

            self.balancer = LayerBalancer(placement, balancer)
        # This layer's own traffic, loads and times (the runtime's stats hold the totals).
        self.stats = CommStats(ep.groups.ep_size, ep.groups.ep_rank) if ep is not None else None
        self.router = TopKRouter(config.router, device=device, dtype=dtype)
        self.experts = FusedExperts(experts_config, device=device, dtype=dtype)
        self.shared_experts = (
            SharedExperts(config.shared, device=device, dtype=dtype) if config.shared is not None else None
        )

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Logical expert id of each local slot."""
        if self.ep is None:
            return tuple(range(self.config.experts.num_experts))
        return self.placement.experts_of(self.ep.groups.ep_rank)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A single-process layer's state dict -> this rank's (expert tensors cut to the local slots)."""
        local = torch.tensor(self.local_experts, dtype=torch.int64)
        out = {}
        for name, value in full.items():
            out[name] = value[local.to(value.device)] if name.startswith("experts.") else value
        return out

    def _slot_bytes(self, optimizer=None) -> int:
        """Bytes one slot's migration moves (`balance.migrate.slot_bytes` of this layer's experts)."""
        from ..balance.migrate import slot_bytes

        return slot_bytes(self.experts.parameters(), optimizer)

    def balance_step(self, optimizer=None):
        """At a step boundary (after the optimizer step): run the balancer on this step's exchanged
        records; on a migration decision, move expert weights (and `optimizer`'s state) to the new
        placement. Collective over the EP group. Returns the `Decision` or None. The layer's stats
        give the balancer this step's all-to-all bytes and times (its bandwidth measurement)."""
        if self.balancer is None:
            return None
        if self.balancer.sized_by_layer:
            self.balancer.set_slot_bytes(self._slot_bytes(optimizer))
        decision = self.balancer.step(self.stats)
        if decision is not None and decision.migrated:
            import time

            from ..balance.migrate import migrate_layer

            started = time.perf_counter()
            sent = migrate_layer(self, decision.placement, optimizer)
            R = self.ep.groups.ep_size
            self.stats.record("migration", [sent // max(1, R - 1)] * R, time.perf_counter() - started)
        return decision

    def forward(self, x: torch.Tensor, *, return_routing: bool = False, mode: str = "auto",
                replicated: bool = False):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        x_TD = x.reshape(-1, x.shape[-1])
        routing: Routing = self.router(x_TD)
        if self.ep is None:
            y_TD = self.experts(x_TD, routing)
            if self.shared_experts is not None:
                y_TD = y_TD + self.shared_experts(x_TD)
        elif mode == "latency" or (mode == "auto" and replicated):
            y_TD = self._forward_latency(x_TD, routing)
            if self.shared_experts is not None:
                y_TD = y_TD + self.shared_experts(x_TD)
        elif mode == "allgather" or (mode == "auto" and self.balancer is None  # the balancer works in ep mode
                                     and self.ep.auto_mode(x_TD.shape[0], self.stats) == "allgather"):
            y_TD = self._forward_allgather(x_TD, routing, checked=mode == "auto")
            if self.shared_experts is not None:
                y_TD = y_TD + self.shared_experts(x_TD)
        else:
            y_TD = self._forward_ep(x_TD, routing)
        y = y_TD.view(x.shape)
        return (y, routing) if return_routing else y

    def _forward_ep(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        dispatcher = self.ep.dispatcher
        bounds = _wave_bounds(x_TD.shape[0], self.ep.config.waves)
        waves = [routing]  # one wave: the routing as it is, no slicing or recount
        if len(bounds) > 1:
            waves = []
            for start, stop in bounds:
                ids = routing.ids_TK[start:stop]
                counts = expert_counts(ids, routing.counts_E.numel())  # no wait for the GPU, unlike bincount
                waves.append(Routing(routing.weights_TK[start:stop], ids, counts, routing.logits_TE[start:stop]))
        metas = dispatcher.plan(waves, self.placement, self.stats, self.balancer)
        dispatches = [dispatcher.dispatch_async(x_TD[a:b], m) for (a, b), m in zip(bounds, metas)]
        shared_TD = self.shared_experts(x_TD) if self.shared_experts is not None else None
        combines = []
        for pending, meta in zip(dispatches, metas):
            y_MD = self.experts.compute_sorted(pending.wait(), meta.counts_S)
            combines.append(dispatcher.combine_async(y_MD, meta))
        y_TD = torch.cat([c.wait() for c in combines]).to(x_TD.dtype)
        return y_TD if shared_TD is None else y_TD + shared_TD

    def _forward_latency(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        from ..comm.runtime import CopyToEP, ReduceFromEP

        x_e = CopyToEP.apply(x_TD, self.ep)
        w_e = CopyToEP.apply(routing.weights_TK, self.ep)
        partial_TD = self.local_partial(x_e, w_e, routing.ids_TK)
        return ReduceFromEP.apply(partial_TD, self.ep).to(x_TD.dtype)

    def _forward_allgather(self, x_TD: torch.Tensor, routing: Routing, checked: bool = False) -> torch.Tensor:
        y_TD = self.ep.all_gather_mode(x_TD, routing.weights_TK, routing.ids_TK, self.local_partial, self.stats,
                                       checked)
        return y_TD.to(x_TD.dtype)

    def local_partial(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        """sum_k weights_TK * expert(x) over the (token, k) pairs whose expert this rank owns (its first
        replica), zero elsewhere: this rank's share of the output when every rank holds the same tokens."""
        T, K = ids_TK.shape
        S = self.placement.slots_per_rank

        def sorted_partial(local_TK: torch.Tensor) -> torch.Tensor:  # the local pairs, sorted (a host sync)
            pairs, local_slot = self.placement.sorted_local_pairs(local_TK)
            y_MD = self.experts.compute_sorted(x_TD[pairs // K], torch.bincount(local_slot, minlength=S))
            weighted_MD = y_MD * weights_TK.reshape(-1)[pairs].unsqueeze(-1)
            full_ND = weighted_MD.new_zeros(T * K, weighted_MD.shape[-1]).index_copy(0, pairs, weighted_MD)
            return full_ND.view(T, K, full_ND.shape[-1]).sum(dim=1)

        local_TK = self.placement.local_slots(ids_TK, self.ep.groups.ep_rank)
        # decode: no sync, no sort (on a few tokens where it measured faster)
        partial_TD = self.experts.pairs_partial(x_TD, local_TK, weights_TK, sorted_partial, self.placement.num_experts)
        return partial_TD if partial_TD is not None else sorted_partial(local_TK)
