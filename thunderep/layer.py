"""`ThunderMoELayer`: router + routed experts + optional shared experts.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size.

This is the single-process layer; the expert-parallel path extends this same class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LayerConfig, SharedExpertsConfig
from .experts import FusedExperts, ACTIVATION_FNS
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

    `forward(x, return_routing=True)` also returns the `Routing` (for auxiliary losses and logging).
    """

    def __init__(self, config: LayerConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config.router, device=device, dtype=dtype)
        self.experts = FusedExperts(config.experts, device=device, dtype=dtype)
        self.shared_experts = (
            SharedExperts(config.shared, device=device, dtype=dtype) if config.shared is not None else None
        )

    def forward(self, x: torch.Tensor, *, return_routing: bool = False):
        x_TD = x.reshape(-1, x.shape[-1])
        routing: Routing = self.router(x_TD)
        y_TD = self.experts(x_TD, routing)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        y = y_TD.view(x.shape)
        return (y, routing) if return_routing else y
