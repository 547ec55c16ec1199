"""`ThunderMoELayer`: router + routed experts + optional shared experts, single process or expert-parallel.

Shape legend: T tokens (of this rank), D hidden size, K experts per token, E experts, S local slots.

Without an `ExpertParallel` runtime the layer holds every expert. With one, its experts are spread over
the EP group by a `Placement` and `ExpertParallelMoE` (thunderep.moe.ep) runs the forward in ep, latency
or all-gather mode, with this layer's `FusedExperts` as the local compute.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..balance.placement import Placement
from ..balance.layer_balancer import LayerBalancer
from ..balance.migrate import slot_bytes
from ..config import LayerConfig, SharedExpertsConfig
from ..errors import ConfigError
from .ep import MODES, ExpertParallelMoE, LocalExperts, attach
from .experts import ACTIVATION_FNS, FusedExperts
from .router import Routing, TopKRouter

__all__ = ["SharedExperts", "ThunderMoELayer"]


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


class ThunderMoELayer(nn.Module):
    """One MoE layer. forward(x) with x [..., D] returns y of the same shape and dtype.

    ep: an `ExpertParallel` runtime; without it the layer holds all experts in this process.
    placement: which logical experts each EP rank holds (default: contiguous blocks); the local
        `experts` hold the slots of this rank, in slot order (`local_experts`).
    `forward(x, return_routing=True)` also returns the `Routing` (for auxiliary losses and logging).
    """

    checkpoint_key = None  # checkpoints name the layer by its path (`moe_layers`)
    restores_placement = True  # a checkpoint's placement is set back on resume

    def __init__(self, config: LayerConfig, *, ep=None, placement: Placement | None = None,
                 balancer=None, device=None, dtype=None):
        super().__init__()
        self.config = config
        experts_config = config.experts
        self.core = None
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
            # A `BalancerConfig` turns the layer's balancer on (it works in ep mode).
            self.core = ExpertParallelMoE(ep, placement, LayerBalancer(placement, balancer) if balancer else None)
        self.router = TopKRouter(config.router, device=device, dtype=dtype)
        self.experts = FusedExperts(experts_config, device=device, dtype=dtype)
        self.shared_experts = (
            SharedExperts(config.shared, device=device, dtype=dtype) if config.shared is not None else None
        )
        attach(self.experts, self)
        self._local = LocalExperts(self.experts.compute_sorted, pairs=self.experts.pairs_partial,
                                   summed=self.experts.compute_summed)

    # The EP core's state, as the layer's own (None without expert parallelism).

    @property
    def ep(self):
        return self.core.ep if self.core is not None else None
    placement = property(lambda self: self.core.placement if self.core is not None else None)
    balancer = property(lambda self: self.core.balancer if self.core is not None else None)
    stats = property(lambda self: self.core.stats if self.core is not None else None)

    @property
    def num_experts(self) -> int:
        return self.config.experts.num_experts

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.experts.named_parameters())

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Logical expert id of each local slot."""
        return self.core.local_experts if self.core is not None else tuple(range(self.num_experts))

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A single-process layer's state dict -> this rank's (expert tensors cut to the local slots)."""
        local = torch.tensor(self.local_experts, dtype=torch.int64)
        out = {}
        for name, value in full.items():
            out[name] = value[local.to(value.device)] if name.startswith("experts.") else value
        return out

    def slot_bytes(self, optimizer=None) -> int:
        """Bytes one slot's migration moves (`balance.migrate.slot_bytes` of this layer's experts)."""
        return slot_bytes(self.experts.parameters(), optimizer)

    def balance_step(self, optimizer=None):
        """At a step boundary (after the optimizer step): the balancer's decision for this step's records;
        on a migration the expert weights (and `optimizer`'s state) move to the new placement. Collective
        over the EP group. Returns the `Decision` or None."""
        if self.core is None:
            return None
        return self.core.balance_step(list(self.experts.parameters()), optimizer)

    def forward(self, x: torch.Tensor, *, return_routing: bool = False, mode: str = "auto",
                replicated: bool = False):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        x_TD = x.reshape(-1, x.shape[-1])
        routing: Routing = self.router(x_TD)
        if self.core is None:
            y_TD = self.experts(x_TD, routing)
            if self.shared_experts is not None:
                y_TD = y_TD + self.shared_experts(x_TD)
        else:
            y_TD = self.core.forward(x_TD, routing.ids_TK, routing.weights_TK, self._local, mode=mode,
                                     replicated=replicated, shared=self.shared_experts)
        y = y_TD.view(x.shape)
        return (y, routing) if return_routing else y
