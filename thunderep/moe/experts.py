"""Routed experts as packed weights and a grouped GEMM.

Shape legend: T tokens, D hidden size, K experts per token, E (local) experts, I intermediate size,
N = rows sorted by expert (T * K for a single process; the received rows under expert parallelism).

Weights use the Hugging Face transformers 5.x layout so checkpoints load without copies:
    gate_up_proj [E, 2I, D]  (gate rows first, then up rows; alternating rows when `interleaved`)
    down_proj    [E, D, I]
    gate_up_bias [E, 2I], down_bias [E, D]  (only with `ExpertsConfig.bias`)

Two levels: `expert_mlp(x_ND, counts_E, ...)` computes rows already grouped by expert (the expert-
parallel runtime calls it on received rows); `FusedExperts.forward(x_TD, routing)` sorts tokens by
expert once, runs it, applies the routing weights and sums each token's K outputs.

On CUDA both levels run ThunderEP's Triton kernels (`thunderep.kernels`) where they cover the experts
(`_use_triton`): the gather of token rows, the gate/up activation, the routing-weight multiply and the
un-permute are fused into two grouped GEMMs. Elsewhere: torch's grouped GEMM, or a loop of matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import ExpertsConfig
from ..errors import ConfigError, InputError, RoutingError
from .router import Routing

__all__ = ["ACTIVATION_FNS", "FusedExperts", "activation_name", "expert_mlp", "gated_activation", "grouped_mm_supported",
           "sort_by_expert"]

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

ACTIVATION_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation_name(act_fn) -> str | None:
    """Which of ACTIVATION_FNS `act_fn` computes (probed on values, so any class that implements it
    matches), or None."""
    probe = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
    for name in ("silu", "gelu", "gelu_tanh", "relu"):
        try:
            if torch.allclose(act_fn(probe), ACTIVATION_FNS[name](probe), rtol=1e-6, atol=1e-9):
                return name
        except Exception:  # noqa: BLE001 - an activation that cannot take the probe matches nothing
            return None
    return None


def gated_activation(h_N2I: torch.Tensor, config: ExpertsConfig) -> torch.Tensor:
    """[N, 2I] gate/up projections -> [N, I] activations."""
    if config.interleaved:
        gate, up = h_N2I[..., ::2], h_N2I[..., 1::2]
    else:
        gate, up = h_N2I.chunk(2, dim=-1)
    if config.activation == "gpt_oss_swiglu":
        limit = config.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * config.swiglu_alpha))
    return ACTIVATION_FNS[config.activation](gate) * up


def grouped_mm_supported(x_ND: torch.Tensor, w_EOD: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM can run `x_ND @ w_EOD[e].T` for these tensors on this build."""
    if _GROUPED_MM is None or x_ND.dtype != w_EOD.dtype:
        return False
    if x_ND.device.type == "cuda":
        return x_ND.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_ND.device) >= (8, 0)
    if x_ND.device.type != "cpu" or x_ND.dtype not in (torch.float32, torch.bfloat16):
        return False
    # The CPU kernel needs 16-byte aligned rows and base pointers.
    item = x_ND.element_size()
    dims_ok = all((n * item) % 16 == 0 for n in w_EOD.shape[1:])
    ptrs_ok = x_ND.data_ptr() % 16 == 0 and w_EOD.data_ptr() % 16 == 0
    return dims_ok and ptrs_ok


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (torch's CPU grouped GEMM
    backward rejects the stride-0 gradients that `sum()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _use_triton(x: torch.Tensor, gate_up_proj: torch.Tensor, config: ExpertsConfig) -> bool:
    """Whether the Triton kernels run these experts: backend "auto" on CUDA where they cover them,
    or "triton" (which raises where they cannot)."""
    ok = False
    if config.backend in ("auto", "triton") and x.device.type == "cuda":
        if kernels.available(x.device):
            from ..kernels import ops  # triton: optional (the Triton kernels import it)

            ok = ops.supported(x, gate_up_proj, config.activation, config.bias)
    if config.backend == "triton" and not ok:
        raise ConfigError(
            f"ExpertsConfig.backend is 'triton' but the Triton kernels cannot run these experts (device "
            f"{x.device}, dtype {x.dtype}, activation {config.activation!r}, bias {config.bias}); they need a "
            f"CUDA device, Triton, no bias and activation silu/gelu/gelu_tanh/relu: use backend 'auto'"
        )
    return ok


def _grouped_linear(x_ND, w_EOD, offsets_E, counts, bias_EO, row_expert_N, use_grouped: bool):
    """y[n] = x[n] @ w[e(n)].T (+ bias[e(n)]) for rows grouped by expert."""
    if use_grouped:
        y_NO = _GROUPED_MM(x_ND, w_EOD.transpose(-2, -1), offs=offsets_E)
        if x_ND.requires_grad or w_EOD.requires_grad:
            y_NO = _ContiguousGrad.apply(y_NO)
    else:
        parts = [F.linear(x_nD, w_EOD[e]) for e, x_nD in enumerate(x_ND.split(counts)) if counts[e]]
        y_NO = torch.cat(parts) if parts else x_ND.new_zeros(0, w_EOD.shape[1])
    if bias_EO is not None:
        y_NO = y_NO + bias_EO[row_expert_N]
    return y_NO


def expert_mlp(
    x_ND: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    config: ExpertsConfig,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert MLP over rows grouped by expert: rows [offset_e, offset_e + counts_E[e]) use expert e.

    x_ND: [N, D] with N == counts_E.sum(). counts_E: [E] integer, on any device (the host avoids a
    sync). gate_up_proj: [E, 2I, D].
    down_proj: [E, D, I]. Biases: [E, 2I] and [E, D]. Returns [N, D] in x's dtype (unweighted).
    """
    E = gate_up_proj.shape[0]
    counts = counts_E.tolist()  # one host sync; the loop path and bias rows need the sizes
    if x_ND.shape[0] != sum(counts) or len(counts) != E:
        raise RoutingError(
            f"expert rows ({x_ND.shape[0]}) must equal counts_E.sum() ({sum(counts)}) and counts_E must "
            f"have one entry per expert ({len(counts)} given, {E} experts)"
        )
    if x_ND.shape[0] == 0:
        # Keep the input and every parameter in the graph: autograd then gives (zero) gradients, and
        # under expert parallelism the backward still reaches the dispatch all-to-all, which every
        # rank must join even when it received no rows.
        zero = x_ND.sum() + gate_up_proj.flatten()[:0].sum() + down_proj.flatten()[:0].sum()
        return x_ND.new_zeros(0, down_proj.shape[1]) + zero.to(x_ND.dtype)
    x_ND = x_ND.to(gate_up_proj.dtype)
    if _use_triton(x_ND, gate_up_proj, config):
        from ..kernels.ops import moe_mlp  # triton: optional (the Triton kernels import it)

        return moe_mlp(x_ND, gate_up_proj, down_proj, counts_E, activation=config.activation,
                       interleaved=config.interleaved)
    backend = config.backend
    use_grouped = backend == "grouped_mm" or (
        backend == "auto"
        and grouped_mm_supported(x_ND, gate_up_proj)
        and grouped_mm_supported(x_ND.new_empty(1, down_proj.shape[2]), down_proj)
    )
    offsets_E = None
    if use_grouped:  # counts may live on the host (the dispatcher's): no device-to-host sync then
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32).to(x_ND.device, non_blocking=True)
    row_expert_N = None
    if gate_up_bias is not None or down_bias is not None:
        row_expert_N = torch.repeat_interleave(torch.arange(E, device=x_ND.device),
                                               counts_E.to(x_ND.device, non_blocking=True),
                                               output_size=x_ND.shape[0])
    h_N2I = _grouped_linear(x_ND, gate_up_proj, offsets_E, counts, gate_up_bias, row_expert_N, use_grouped)
    a_NI = gated_activation(h_N2I, config)
    return _grouped_linear(a_NI, down_proj, offsets_E, counts, down_bias, row_expert_N, use_grouped)


def sort_by_expert(ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the T*K (token, slot) pairs by expert id.

    Returns (order_N, inverse_N): `flat[order_N]` is grouped by expert, `sorted[inverse_N]` restores
    the flat (token-major) order.
    """
    order_N = torch.argsort(ids_TK.reshape(-1), stable=True)
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return order_N, inverse_N


class FusedExperts(nn.Module):
    """E routed experts as packed weights (Hugging Face 5.x layout, see the module docstring).

    forward(x_TD, routing) -> y_TD: [T, D] in x's dtype, already weighted by the routing weights.
    """

    def __init__(self, config: ExpertsConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        E, D, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(E, D, I, device=device, dtype=dtype))
        if config.bias:
            self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * I, device=device, dtype=dtype))
            self.down_bias = nn.Parameter(torch.empty(E, D, device=device, dtype=dtype))
        else:
            self.gate_up_bias = self.down_bias = None
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, std)

    def compute_sorted(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """[N, D] rows grouped by local expert -> [N, D] unweighted expert outputs."""
        return expert_mlp(
            x_ND, counts_E, self.gate_up_proj, self.down_proj, self.config, self.gate_up_bias, self.down_bias
        )

    def compute_summed(self, x_MD: torch.Tensor, counts_E: torch.Tensor, pairs_Q: torch.Tensor,
                       weights_N: torch.Tensor, top_k: int, positions_N: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """[M, D] rows, each row m's pairs m * top_k + k listed in `pairs_Q` (grouped by local expert per
        counts_E) weighted by weights_N ([M * top_k], or [M, top_k] of any strides) and summed in float32,
        through the kernels (the expert-parallel receiving rank: the expand is the kernels' row gather, the
        pre-sum one pass after them); positions_N: where each flat pair sits in pairs_Q, where the caller has
        it. None where the kernels do not apply (no CUDA kernels here, or gradients needed)."""
        if not _use_triton(x_MD, self.gate_up_proj, self.config):
            return None
        from ..kernels.ops import moe_mlp_summed  # triton: optional (the Triton kernels import it)

        return moe_mlp_summed(x_MD.to(self.gate_up_proj.dtype), self.gate_up_proj, self.down_proj, counts_E,
                              order_Q=pairs_Q, weights_N=weights_N, top_k=top_k, activation=self.config.activation,
                              interleaved=self.config.interleaved, positions_N=positions_N)

    def pairs_partial(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, fallback=None,
                      experts: int | None = None, kind: str = "sorted") -> torch.Tensor | None:
        """sum over k of weights_TK * expert_{ids_TK}(x_TD) [T, D] through the decode pair kernels, where
        id -1 marks a pair these experts do not compute (it adds nothing); None where the pair kernels do
        not apply (no CUDA kernels here, gradients needed, or more tokens than `pairs_max_tokens()`, or,
        given the caller's `fallback(ids_TK)` and the model's `experts`, than the tokens at which the
        pair kernels measured faster: `thunderep.kernels.paths.pairs_win`).

        For expert parallelism's latency and all-gather modes: each rank's share of the output, with no
        sort, no compaction of its pairs and no device-to-host sync."""
        if not x_TD.shape[0] or not _use_triton(x_TD, self.gate_up_proj, self.config):
            return None
        from ..kernels.ops import pairs_if_decode  # triton: optional (the Triton kernels import it)

        return pairs_if_decode(x_TD, self.gate_up_proj, self.down_proj, ids_TK, weights_TK, self.config.activation,
                               self.config.interleaved, fallback, experts, kind)

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        T, K = routing.ids_TK.shape
        if x_TD.shape[0] != T:
            raise RoutingError(f"x_TD has {x_TD.shape[0]} tokens but the routing has {T}")
        if x_TD.dim() != 2 or x_TD.shape[1] != self.config.hidden_size:
            raise InputError(f"x_TD {tuple(x_TD.shape)} must be [T, hidden_size] with hidden_size "
                             f"{self.config.hidden_size}")
        if routing.ids_TK.is_floating_point() or routing.ids_TK.dtype == torch.bool:
            raise InputError(f"routing.ids_TK must be an integer tensor, got {routing.ids_TK.dtype}")
        if _use_triton(x_TD, self.gate_up_proj, self.config) and T:
            from ..kernels.ops import routed_moe_mlp  # triton: optional (the Triton kernels import it)

            y_TD = routed_moe_mlp(x_TD.to(self.gate_up_proj.dtype), self.gate_up_proj, self.down_proj,
                                  routing.ids_TK, routing.weights_TK, counts_E=routing.counts_E,
                                  activation=self.config.activation, interleaved=self.config.interleaved)
            return y_TD.to(x_TD.dtype)
        order_N, inverse_N = sort_by_expert(routing.ids_TK)
        y_ND = self.compute_sorted(x_TD[order_N // K], routing.counts_E)
        weighted_ND = y_ND * routing.weights_TK.reshape(-1)[order_N].unsqueeze(-1)
        y_TD = weighted_ND[inverse_N].view(T, K, weighted_ND.shape[-1]).sum(dim=1)
        return y_TD.to(x_TD.dtype)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"experts={c.num_experts}, hidden={c.hidden_size}, intermediate={c.intermediate_size}, "
            f"activation={c.activation}, backend={c.backend}"
        )
