"""The Hopper path: torch's grouped GEMM for the expert GEMMs, Triton passes for the rest.

Shape legend as in ops.py: T tokens, D hidden size, K experts per token, E experts, I intermediate
size, N routed rows in expert order.

On sm_90 torch's grouped GEMM runs CUTLASS's TMA, warp-specialized kernel, faster than Triton's GEMMs
once experts get many rows; it cannot gather rows or fuse epilogues, so the memory-bound work the fused
kernels do in their prologues and epilogues runs here as four small Triton passes (passes.py):

    forward    x_rows = x[order // K]  ->  gu = x_rows @ Wgu[e].T  ->  h = act(g) * u
               ->  y_rows = h @ Wd[e].T  ->  y[t] = sum_k w[t, k] * y_rows[inv[t, k]]
    backward   dy_rows = dy[order // K]  ->  dhu = dy_rows @ Wd[e]  ->  dgu, d routing weight, w * h
               ->  dx_rows = dgu @ Wgu[e]  ->  dx[t] = sum_k dx_rows[inv[t, k]]
    weights    dWd[e] = dy_rows.T @ (w * h),  dWgu[e] = dgu.T @ x_rows   (grouped over rows)

It saves the same g, u, h as the fused forward, so either backward can follow either forward.
`gemm_path` and `wgrad_path` choose between this path and the fused kernels.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .. import env
from ..errors import ConfigError
from . import passes
from .tuning import cdiv

__all__ = ["GROUPED_MM", "TORCH_GEMM_MIN_ROWS", "LARGE_EXPERT_MIN_ROWS", "WGRAD_TORCH_MIN_ROWS", "forced",
           "grouped_mm_usable", "mean_rows", "min_rows", "gemm_path", "pinned", "wgrad_path", "gather_rows",
           "offsets", "forward", "backward_dx", "weight_grad"]

GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# The Hopper path takes over when experts get at least this many rows on average (forward, backward):
# below it the gathers, epilogues and row-tile schedule the fused kernels save outweigh CUTLASS's
# faster tiles (docs/BENCHMARKS.md).
TORCH_GEMM_MIN_ROWS = (512, 256)
# Large experts take the Hopper path earlier, from LARGE_EXPERT_MIN_ROWS rows per expert on average
# (forward, backward): their GEMMs outweigh the path's extra traffic (the gathered rows, gate/up written
# and read back). A row's GEMM work over those elements is D*I / (D + 3*I) up to a constant: 1247 for
# Mixtral-8x7B, 1103 for DeepSeek-V3, 361 for Qwen3-30B-A3B; the bound on the ratio lies between Qwen3's
# and DeepSeek-V3's (their geometric mean, 631, rounded up; docs/BENCHMARKS.md, "... the Hopper path from
# fewer rows for large experts").
LARGE_EXPERT_MIN_ROWS = (192, 160)
LARGE_EXPERT_RATIO = 640
# The weight gradients take torch's grouped GEMM from this many rows per expert on average; with fewer
# the portable kernel is the faster (docs/BENCHMARKS.md, "Weight gradients over pre-gathered rows").
WGRAD_TORCH_MIN_ROWS = 64


def grouped_mm_usable(t: torch.Tensor, *dims: int) -> bool:
    """torch's grouped GEMM runs its TMA, warp-specialized CUTLASS kernel here: sm_90, bf16, 16-byte rows."""
    return (GROUPED_MM is not None and t.is_cuda and t.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(t.device) == (9, 0) and all(d % 8 == 0 for d in dims))


def mean_rows(n_rows: int, E: int) -> float:
    """Rows per expert on average, over the experts that can have rows (at most one per row)."""
    return n_rows / max(1, min(E, n_rows))


def forced(name: str) -> str:
    """The path THUNDEREP_EXPERT_GEMM or THUNDEREP_WGRAD (`name`) pins ("triton" / "torch"), or "" when
    it is unset. ConfigError for "torch" where this torch has no grouped GEMM."""
    pin = env.forced_gemm(name)
    if pin == "torch" and GROUPED_MM is None:
        raise ConfigError(f"{name}=torch needs torch's grouped GEMM (torch.nn.functional.grouped_mm or "
                          f"torch._grouped_mm), which this torch {torch.__version__} lacks")
    return pin


@contextlib.contextmanager
def pinned(name: str, value: str):
    """The environment variable `name` (one of the pins read here per call, e.g. THUNDEREP_EXPERT_GEMM)
    set to `value` within the block, then as it was (unset, or its old value)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def wgrad_path(t: torch.Tensor, n_rows: int, E: int, *dims: int) -> str:
    """"torch" (CUTLASS grouped GEMM, Hopper) or "triton" (the portable kernel) for the weight gradients.

    THUNDEREP_WGRAD=triton|torch forces one. On sm_90 torch's grouped GEMM computes these row-grouped
    products faster once the experts get WGRAD_TORCH_MIN_ROWS rows on average; with fewer, each
    output value is a short sum, writing dW decides, and the portable kernel is faster. Elsewhere
    (RTX 4090 / 5090, or without it) the Triton kernel runs. Both take rows gathered into expert order.
    """
    pin = forced("THUNDEREP_WGRAD")
    if pin:
        return pin
    return "torch" if mean_rows(n_rows, E) >= WGRAD_TORCH_MIN_ROWS and grouped_mm_usable(t, *dims) else "triton"


def min_rows(D: int, I: int, backward: bool = False) -> int:
    """Rows per expert on average from which an sm_90 GPU runs the Hopper path for experts of hidden size
    D and intermediate size I (`backward`: for dhu and dX): TORCH_GEMM_MIN_ROWS, or for large experts
    LARGE_EXPERT_MIN_ROWS."""
    large = D * I >= LARGE_EXPERT_RATIO * (D + 3 * I)
    return (LARGE_EXPERT_MIN_ROWS if large else TORCH_GEMM_MIN_ROWS)[1 if backward else 0]


def gemm_path(t: torch.Tensor, n_rows: int, E: int, D: int, I: int, backward: bool = False) -> str:
    """"torch" or "triton" for the forward GEMMs, or (`backward`) for the backward's dhu and dX
    (the weight gradients choose separately, `wgrad_path`).

    "triton": the fused kernels (gather in the A load, activation and weight/un-permute epilogues).
    "torch" (the Hopper path): torch's grouped GEMM for the GEMMs, with three memory-bound Triton
    passes around it (activation, activation backward, un-permute + sum over K); chosen on sm_90 when
    the experts get at least `min_rows` rows on average, where GEMM speed decides. Both
    forward paths save the same tensors, so the backward chooses on its own.
    THUNDEREP_EXPERT_GEMM=triton|torch forces one for both.
    """
    pin = forced("THUNDEREP_EXPERT_GEMM")
    if pin:
        return pin
    usable = mean_rows(n_rows, E) >= min_rows(D, I, backward) and grouped_mm_usable(t, D, I)
    return "torch" if usable else "triton"


def _elementwise_meta(device: torch.device) -> dict:
    return {} if device.type == "cuda" else {"num_warps": 1}


def _act_rows(gu, act, interleaved):
    n_rows, I2 = gu.shape
    I = I2 // 2
    h = gu.new_empty(n_rows, I)
    grid = (cdiv(n_rows, 8), cdiv(I, 256))
    passes.act_kernel[grid](gu, h, n_rows, I, gu.stride(0), h.stride(0), ACT=act, INTERLEAVED=interleaved,
                             BLOCK_R=8, BLOCK_C=256, **_elementwise_meta(gu.device))
    return h


def _act_bwd_rows(dhu, gu, order, weights, act, interleaved):
    """dgu [N, 2I], the routing-weight gradient in flat (token, slot) order (empty without weights) and
    hw = w * h [N, I] (None without weights)."""
    n_rows, I2 = gu.shape
    dgu = torch.empty_like(gu)
    dw = torch.empty(n_rows if weights is not None else 0, dtype=torch.float32, device=gu.device)
    hw = gu.new_empty(n_rows, I2 // 2) if weights is not None else None
    passes.act_bwd_rows_kernel[(cdiv(n_rows, 4),)](
        dhu, gu, dgu, dw if weights is not None else dgu, hw if hw is not None else dgu,
        order if order is not None else dhu,
        weights if weights is not None else dhu, n_rows, I2 // 2, dhu.stride(0), gu.stride(0),
        ACT=act, INTERLEAVED=interleaved, WEIGHTED=weights is not None, BLOCK_R=4, BLOCK_C=256,
        **_elementwise_meta(gu.device))
    return dgu, dw, hw


def gather_rows(src, order, top_k):
    """src[order[r] // top_k] for every sorted row r: [N, D] (the tokens' rows in expert order)."""
    n_rows, D = order.shape[0], src.shape[1]
    out = src.new_empty(n_rows, D)
    grid = (cdiv(n_rows, 8), cdiv(D, 1024))
    passes.gather_kernel[grid](src, order, out, n_rows, D, top_k, src.stride(0), out.stride(0), BLOCK_R=8,
                                BLOCK_D=1024, **_elementwise_meta(src.device))
    return out


def _inverse(order):
    """inv[order[r]] = r: where each flat (token, slot) pair sits in the sorted rows."""
    return torch.empty_like(order).index_put_(
        (order.long(),), torch.arange(order.shape[0], dtype=order.dtype, device=order.device))


def _combine(rows, inv, weights, T, top_k):
    """out[t] = sum over k of w[t, k] * rows[inv[t, k]] (un-permute and sum over K, one pass)."""
    D = rows.shape[1]
    out = rows.new_empty(T, D)
    grid = (cdiv(T, 4), cdiv(D, 512))
    passes.combine_kernel[grid](rows, inv, weights if weights is not None else rows, out, T, D, top_k,
                                 rows.stride(0), out.stride(0), WEIGHTED=weights is not None, BLOCK_T=4,
                                 BLOCK_D=512, **_elementwise_meta(rows.device))
    return out


def offsets(counts, n_rows: int):
    """Each expert's end row, counts taken as >= 0 and ends as <= n_rows: counts that do not sum to the
    rows (on the GPU they are not checked, ops.moe_mlp) read and write no row out of bounds."""
    return torch.cumsum(counts.clamp(min=0), dim=0, dtype=torch.int32).clamp_(max=n_rows)


def forward(x, w_gu, w_d, order, counts, weights, top_k, act, interleaved):
    """The Hopper path's forward -> (y, h_NI, gu_N2I).

    x: x_TD with `order` [N] int32 (gathered mode; y = y_TD, weighted by `weights` [T*K] and summed
    over K) or x_ND sorted by expert (`order` None; y = y_ND, unweighted). w_gu: [E, 2I, D];
    w_d: [E, D, I]; counts: [E] int32; all float tensors in x's dtype. `act` is a moe_triton code.
    """
    x_rows = gather_rows(x, order, top_k) if order is not None else x
    offs = offsets(counts, x_rows.shape[0])
    gu = GROUPED_MM(x_rows, w_gu.transpose(1, 2), offs=offs)
    h = _act_rows(gu, act, interleaved)
    y_rows = GROUPED_MM(h, w_d.transpose(1, 2), offs=offs)
    if order is None:
        return y_rows, h, gu
    return _combine(y_rows, _inverse(order), weights, x.shape[0], top_k), h, gu


def backward_dx(dy, w_gu, w_d, order, counts, weights, gu, top_k, act, interleaved):
    """The Hopper path's backward up to dX -> (dx, dgu_N2I, dweights, dy_rows_ND, hw_NI).

    dy: dy_TD (gathered mode) or dy_ND; gu: [N, 2I] saved by the forward; other arguments as in
    `forward`. dweights: [T*K] float32 in flat (token, slot) order (empty without weights); hw = w * h
    for the weight gradients (None without weights); dy_rows: dy gathered into expert order (dy itself in
    sorted mode), kept for the weight gradients.
    """
    dy_rows = gather_rows(dy, order, top_k) if order is not None else dy
    offs = offsets(counts, dy_rows.shape[0])
    dhu = GROUPED_MM(dy_rows, w_d, offs=offs)  # dy_rows @ Wd[e]: [N, I]
    dgu, dw, hw = _act_bwd_rows(dhu, gu, order, weights, act, interleaved)
    dx_rows = GROUPED_MM(dgu, w_gu, offs=offs)  # dgu @ Wgu[e]: [N, D]
    dx = _combine(dx_rows, _inverse(order), None, dy.shape[0], top_k) if order is not None else dx_rows
    return dx, dgu, dw, dy_rows, hw


def weight_grad(a_rows, b_rows, ends):
    """out[e] = a_rows_e.T @ b_rows_e over expert e's rows, through torch's grouped GEMM over the row
    dimension: [E, M, N] from a_rows [N_rows, M] and contiguous b_rows [N_rows, N] in expert order;
    ends: [E] int32 (`offsets`), computed once for the backward's two weight gradients: dW_down =
    dy_rows.T @ (w * h), dW_gate_up = dgu.T @ x_rows.
    """
    return GROUPED_MM(a_rows.t(), b_rows, offs=ends)
