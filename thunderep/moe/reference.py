"""Slow plain-PyTorch references: one token and one chosen expert at a time.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size.

These are written independently of the fast paths (no shared helpers beyond the configs) so that the
tests comparing the two catch mistakes in routing, weighting and expert math. They keep autograd, so
gradients can be compared too. Selection uses Python sorting of the scores; ties (measure zero for
random inputs) may break differently from `torch.topk`.
"""

from __future__ import annotations

import math

import torch

from ..config import ExpertsConfig, RouterConfig

__all__ = ["reference_experts", "reference_layer", "reference_route"]


def _select(choice: list[float], config: RouterConfig) -> list[int]:
    """Indices of the top_k experts by `choice`, within the best groups when grouped."""
    E, k = config.num_experts, config.top_k
    allowed = list(range(E))
    if config.grouped:
        size = E // config.n_group
        group_scores = []
        for g in range(config.n_group):
            members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_scores.append(members[0] + members[1] if config.group_score == "top2_sum" else members[0])
        best = sorted(range(config.n_group), key=lambda g: -group_scores[g])[: config.topk_group]
        allowed = [e for g in sorted(best) for e in range(g * size, (g + 1) * size)]
    return sorted(allowed, key=lambda e: -choice[e])[:k]


def reference_route(
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    config: RouterConfig,
    bias_E: torch.Tensor | None = None,
    score_bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights_TK, ids_TK) computed token by token."""
    weights, ids = [], []
    for t in range(x_TD.shape[0]):
        x_D, w_ED, b_E = x_TD[t], weight_ED, bias_E
        if config.logits_fp32:
            x_D, w_ED = x_D.float(), w_ED.float()
            b_E = None if b_E is None else b_E.float()
        logits_E = (w_ED * x_D).sum(dim=-1)
        if b_E is not None:
            logits_E = logits_E + b_E
        score_dtype = torch.float32 if config.score_dtype == "float32" else logits_E.dtype
        logits_E = logits_E.to(score_dtype)
        if config.scoring == "topk_softmax":
            chosen = _select(logits_E.tolist(), config)
            top_K = logits_E[chosen]
            exp_K = torch.exp(top_K - top_K.max())
            w_K = exp_K / exp_K.sum()
        else:
            if config.scoring == "softmax":
                exp_E = torch.exp(logits_E - logits_E.max())
                scores_E = exp_E / exp_E.sum()
            else:
                scores_E = 1.0 / (1.0 + torch.exp(-logits_E))
            choice = scores_E.detach().float()
            if score_bias_E is not None:
                choice = choice + score_bias_E.float()
            chosen = _select(choice.tolist(), config)
            w_K = scores_E[chosen]
            if config.normalize:
                w_K = w_K / (w_K.sum() + (1e-20 if config.scoring == "sigmoid" else 0.0))
        w_K = w_K * config.scaling_factor
        weights.append(w_K.to(torch.float32 if config.weights_dtype == "float32" else x_TD.dtype))
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids, dtype=torch.int64, device=x_TD.device)


def _activation(gate: torch.Tensor, up: torch.Tensor, name: str, alpha: float, limit: float) -> torch.Tensor:
    if name == "silu":
        return gate / (1.0 + torch.exp(-gate)) * up
    if name == "gelu":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if name == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1.0 + torch.tanh(inner)) * up
    if name == "relu":
        return torch.clamp(gate, min=0.0) * up
    if name == "gpt_oss_swiglu":
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
        return (up + 1.0) * gate / (1.0 + torch.exp(-alpha * gate))
    raise AssertionError(f"unknown activation {name}")


def reference_experts(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    config: ExpertsConfig,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_TD[t] = sum_k weights_TK[t, k] * MLP_{ids_TK[t, k]}(x_TD[t]), one matrix-vector product at a time."""
    I = config.intermediate_size
    rows = []
    for t in range(x_TD.shape[0]):
        acc_D = torch.zeros_like(x_TD[t], dtype=torch.promote_types(x_TD.dtype, weights_TK.dtype))
        for j in range(ids_TK.shape[1]):
            e = int(ids_TK[t, j])
            h = gate_up_proj[e] @ x_TD[t]
            if gate_up_bias is not None:
                h = h + gate_up_bias[e]
            if config.interleaved:
                gate = torch.stack([h[2 * i] for i in range(I)])
                up = torch.stack([h[2 * i + 1] for i in range(I)])
            else:
                gate, up = h[:I], h[I:]
            a = _activation(gate, up, config.activation, config.swiglu_alpha, config.swiglu_limit)
            y = down_proj[e] @ a
            if down_bias is not None:
                y = y + down_bias[e]
            acc_D = acc_D + weights_TK[t, j] * y
        rows.append(acc_D)
    return torch.stack(rows).to(x_TD.dtype)


def reference_layer(layer, x: torch.Tensor) -> torch.Tensor:
    """The whole `ThunderMoELayer` computed from its parameters by the slow references."""
    x_TD = x.reshape(-1, x.shape[-1])
    r, e = layer.router, layer.experts
    weights_TK, ids_TK = reference_route(x_TD, r.weight, r.config, r.bias, r.e_score_correction_bias)
    y_TD = reference_experts(
        x_TD, ids_TK, weights_TK, e.gate_up_proj, e.down_proj, e.config, e.gate_up_bias, e.down_bias
    )
    shared = layer.shared_experts
    if shared is not None:
        outs = []
        for t in range(x_TD.shape[0]):
            g = shared.gate_proj.weight @ x_TD[t]
            u = shared.up_proj.weight @ x_TD[t]
            s = shared.down_proj.weight @ _activation(g, u, shared.config.activation, 0.0, 1.0)
            if shared.gate is not None:
                s = s / (1.0 + torch.exp(-(shared.gate.weight[0] @ x_TD[t])))
            outs.append(s)
        y_TD = y_TD + torch.stack(outs)
    return y_TD.view(x.shape)
