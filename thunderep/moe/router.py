"""The MoE router: hidden states -> which experts each token uses, and with what weight.

Shape legend: T tokens, D hidden size, E experts, K experts per token (top_k), G expert groups.

`TopKRouter` reproduces the scoring schemes of the Hugging Face transformers 5.x MoE families, chosen
by `RouterConfig` fields (see `RouterConfig.for_family` for the field values of each family).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import RouterConfig
from ..errors import RoutingError

__all__ = ["Routing", "TopKRouter", "expert_counts", "route"]


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens.

    weights_TK: [T, K] float32 or the input dtype (`RouterConfig.weights_dtype`); differentiable.
    ids_TK: [T, K] int64 expert ids in [0, E).
    counts_E: [E] int64, tokens routed to each expert (sum = T * K).
    logits_TE: [T, E] raw router logits (for auxiliary losses and logging).
    """

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor
    counts_E: torch.Tensor
    logits_TE: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids_TK.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids_TK.shape[1]


def _check_finite(logits_TE: torch.Tensor) -> None:
    if not bool(torch.isfinite(logits_TE).all()):
        bad = (~torch.isfinite(logits_TE)).any(dim=-1).nonzero().flatten()
        raise RoutingError(
            f"router logits contain NaN or inf for {bad.numel()} of {logits_TE.shape[0]} tokens "
            f"(first token index {int(bad[0])}); the hidden states or the router weight hold non-finite "
            "values. Check the previous layer's output, the learning rate and loss scaling, or set "
            "RouterConfig.check_finite=False to skip this check."
        )


def _group_mask(choice_TE: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """[T, E] bool: True for experts inside the `topk_group` best groups of each token."""
    T, E, G = choice_TE.shape[0], config.num_experts, config.n_group
    grouped_TGn = choice_TE.view(T, G, E // G)
    if config.group_score == "top2_sum":
        group_TG = grouped_TGn.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_TG = grouped_TGn.max(dim=-1).values
    best_Tg = torch.topk(group_TG, k=config.topk_group, dim=-1, sorted=False)[1]
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_Tg, True)
    return keep_TG.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)


def expert_counts(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 rows per expert. Unlike torch.bincount on CUDA, no device-to-host sync (CUDA graphs)."""
    flat = ids_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def route(
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    config: RouterConfig,
    bias_E: torch.Tensor | None = None,
    score_bias_E: torch.Tensor | None = None,
) -> Routing:
    """Functional router.

    x_TD: [T, D] hidden states (any float dtype). weight_ED: [E, D] router weight. bias_E: [E] linear
    bias (`router_bias`). score_bias_E: [E] float32 selection-only bias (`score_correction_bias`).
    """
    if x_TD.dim() != 2 or x_TD.shape[-1] != config.hidden_size:
        raise RoutingError(
            f"router input must be [T, {config.hidden_size}], got {tuple(x_TD.shape)}"
        )
    if config.logits_fp32:
        logits_TE = F.linear(
            x_TD.float(), weight_ED.float(), None if bias_E is None else bias_E.float()
        )
    else:
        logits_TE = F.linear(x_TD, weight_ED, bias_E)
    if config.check_finite:
        _check_finite(logits_TE)
    k = config.top_k
    score_dtype = torch.float32 if config.score_dtype == "float32" else logits_TE.dtype

    if config.scoring == "topk_softmax":
        top_TK, ids_TK = torch.topk(logits_TE.to(score_dtype), k, dim=-1)
        weights_TK = torch.softmax(top_TK, dim=-1)
    else:
        if config.scoring == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=score_dtype)
        else:
            scores_TE = torch.sigmoid(logits_TE.to(score_dtype))
        with torch.no_grad():
            choice_TE = scores_TE if score_bias_E is None else scores_TE + score_bias_E
            if config.grouped:
                choice_TE = choice_TE.masked_fill(~_group_mask(choice_TE, config), float("-inf"))
            ids_TK = torch.topk(choice_TE, k, dim=-1)[1]
        weights_TK = scores_TE.gather(1, ids_TK)
        if config.normalize:
            denominator_T1 = weights_TK.sum(dim=-1, keepdim=True)
            if config.scoring == "sigmoid":
                denominator_T1 = denominator_T1 + 1e-20
            weights_TK = weights_TK / denominator_T1
    if config.scaling_factor != 1.0:
        weights_TK = weights_TK * config.scaling_factor
    out_dtype = torch.float32 if config.weights_dtype == "float32" else x_TD.dtype
    counts_E = expert_counts(ids_TK, config.num_experts)
    return Routing(weights_TK.to(out_dtype), ids_TK, counts_E, logits_TE)


class TopKRouter(nn.Module):
    """Router module; parameter names match Hugging Face (`weight`, `bias`, `e_score_correction_bias`).

    forward(x) with x [..., D] returns a `Routing` over the flattened T = prod(x.shape[:-1]) tokens.
    """

    def __init__(self, config: RouterConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        E, D = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, D, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(E, device=device, dtype=dtype)) if config.router_bias else None
        if config.score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, std)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        x_TD = x.reshape(-1, x.shape[-1])
        return route(x_TD, self.weight, self.config, self.bias, self.e_score_correction_bias)

    def extra_repr(self) -> str:
        c = self.config
        return f"experts={c.num_experts}, top_k={c.top_k}, scoring={c.scoring}, n_group={c.n_group}"
