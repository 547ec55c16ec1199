"""The routed-expert MLP as torch.library custom ops over the Triton kernels (forward and backward).

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N routed rows in expert order, P = ceil(I / BLOCK_N) column tiles.

    thunderep::moe_mlp(x, w_gate_up_E2ID, w_down_EDI, order_N, counts_E, weights, top_k, ...)
        -> (y, h_NI, gu_N2I)
    thunderep::moe_mlp_backward(dy, x, ..., h_NI, gu_N2I) -> (dx, dw_gate_up, dw_down, dweights)

Two entry modes, one op:
  * gathered (`order_N` given; routed_moe_mlp, below): x is x_TD; row r reads token order_N[r] // K;
    the down projection's epilogue multiplies by weights[order_N[r]] (the flat [T*K] routing weights)
    and writes flat row order_N[r]; y = y_TKD.sum(K) -> [T, D].
  * sorted (`order_N` None, the expert-parallel runtime): x is x_ND already grouped by expert; y is
    the unweighted [N, D] in the same order.

Two GEMM paths (`gemm`; forward and backward choose separately, `grouped_gemm.gemm_path`):
  * "triton": the fused kernels of moe_triton.py (gather in the A load, activation and
    weight/un-permute epilogues); portable, the only path on sm_89 / sm_120.
  * "torch" (Hopper): rows gathered once, torch's grouped GEMM (CUTLASS, TMA + warp specialization)
    for the GEMMs, and Triton passes for what the fused epilogues did (activation, its backward,
    un-permute + sum over K). Chosen on sm_90 in bf16 when experts get many rows (`grouped_gemm.gemm_path`).

Decode: `routed_moe_mlp` (FusedExperts' entry, from the router's ids and weights) runs inference on
one token, and on a few more where it measured faster (`pairs.pairs_win`), through a third op
(pairs.py), with no sort:

    thunderep::moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, ...) -> y_TD

and otherwise sorts the pairs by expert and calls `moe_mlp` (gathered mode).

`h_NI` and `gu_N2I` are returned for backward only (empty [0, ...] unless `save`). The ops carry
`register_fake`, so torch.compile traces through them; `register_autograd` chains forward to backward
(the pair op is inference-only).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ..errors import InputError
from . import grouped_gemm as G
from . import moe_triton as K
from . import pairs as P
from . import passes
from .fp8 import FP8, FP8_MAX, Fp8Weight, scale_args
from .fp8 import quantize_rows as fp8_rows
from .fp8 import weight_data as _data
from .pairs import needs_grad as _needs_grad
from .tuning import cdiv, fp8_only, kernel_configs, next_power_of_2
from .tuning import launch as _launch
from .tuning import precision as _precision
from .tuning import tuned

__all__ = ["moe_mlp", "routed_moe_mlp", "kernel_configs", "supported"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str, bias: bool) -> bool:
    """Whether the Triton kernels can run this expert MLP."""
    return (
        activation in K.ACTIVATIONS
        and not bias
        and x.dtype == w_gate_up.dtype
        and x.dtype in _DTYPES
        and w_gate_up.is_contiguous()
    )


def _m_key(n_rows: int, E: int) -> tuple[int, int]:
    """The row kernels' key of rows per expert, (class, fill), from the mean rows per active expert.

    class: BLOCK_M. Up to 32 rows per expert on average, the smallest of 16/32/64 that holds twice the
    mean, fill 0. Counts spread about as a Poisson's, so with tiles that just hold the mean about half
    of the experts need a second, nearly empty tile, and it reads the expert's weights again; at twice
    the mean an expert rarely needs a second (at a mean of 8 rows, 0.4% get more than 16). On the H200,
    16 rows per expert in 32-row tiles instead of 16-row ones: Mixtral's forward at 64 tokens 0.703 ->
    0.651 ms (graph), DeepSeek-V3's at 512 tokens 5.83 -> 5.13 ms; 32 rows in 64-row tiles instead of
    32-row ones: Mixtral at 128 tokens 0.726 -> 0.672 ms, DeepSeek-V3 at 1024 tokens 6.38 -> 5.39 ms
    (docs/BENCHMARKS.md, "GPU checks at 0576706", "Row tiles that hold twice the mean"). From 33 to 60
    rows, 64-row tiles, fill 1: there a tile of twice the mean computes more than a second tile costs (48
    and 56 rows per expert took 8-11% less time in 64-row tiles than in 128-row ones); above 60, 128-row
    tiles, fill 1, or 2 where experts average more than two of them (long prompts): at 64 rows 128-row
    tiles ran Mixtral's forward at 256 tokens 0.982 -> 0.793 ms and DeepSeek-V3's at 2048 7.48 -> 6.63
    ("Rows 33 to 64 per expert").

    Plain comparisons: this runs at every launch (a generator over the classes took 2.6 us a call on a
    CPU)."""
    mean = G._mean_rows(n_rows, E)
    if mean <= 32:
        return (16 if mean <= 8 else 32 if mean <= 16 else 64), 0
    bm = 64 if mean <= 60 else 128
    return bm, 2 if mean > 2 * bm else 1


def _wgrad_key(n_rows: int, E: int) -> tuple[int, int]:
    """The weight-gradient kernel's key, (class, fill): the smallest of 16/32/64/128 that holds the mean
    rows per active expert, fill 0 up to half of it, 2 above two 128-row tiles, else 1. The kernel walks
    each expert's rows whatever their number, so the class only sorts tunings by how short the sums
    are (`_prune_wgrad`)."""
    mean = G._mean_rows(n_rows, E)
    bm = 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean <= 64 else 128
    return bm, 0 if mean <= bm / 2 else 2 if mean > 2 * bm else 1


# Rows per expert that reach every (class, fill) tuning key once, from 4 (16-row class, fill 0) to 384
# (128-row class, fill 2): the batches `thunderep.hf.tune` tunes ahead of serving. All below the forward's
# G.TORCH_GEMM_MIN_ROWS: from there a Hopper GPU runs torch's grouped GEMM and no row kernel, so a tuning
# call there would leave the fill-2 key to the first prompt that gives 257 to 511 rows per expert. Large
# experts' forward takes that path from G.LARGE_EXPERT_MIN_ROWS (192) rows; there the 384-row call runs
# no row kernel, and no forward needs its key: every mean that maps to it (above 256) takes that path too.
TUNING_ROWS = (4, 16, 32, 48, 128, 384)


def _cfg(bm, bn, bk, warps, stages, group=8, **flags):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, **flags},
                         num_warps=warps, num_stages=stages)


def _row_cfg(bm, bn, bk, warps, stages, tail=False, group=8):
    """A row kernel's config; `tail`: an expert's last tile also takes up to bm / 2 rows past bm
    (moe_triton._row_tile); `group`: row tiles launched together (moe_triton._swizzle)."""
    return _cfg(bm, bn, bk, warps, stages, group, TAIL=tail)


# Row kernels: BLOCK_M is fixed by the size class (the mean rows per expert), the rest is tuned. Where
# experts get 64 or more rows on average, their counts scatter around a multiple of the tile: the
# configs with a tail let the last tile take the few rows over it instead of a nearly empty tile. Each
# tile comes with row tiles launched 8 at a time (GROUP_M, sharing weight tiles when an expert has
# several) and one at a time (an expert with about one tile: its column tiles then run together and
# share its rows). On the H200, DeepSeek-V3 at 4096 tokens (128 rows per expert): one at a time, forward
# 8.87 -> 8.08 ms and 9.09 -> 8.46 ms (docs/BENCHMARKS.md, "Row tiles one at a time").
_ROW_TILES = [
    (16, 32, 128, 4, 5), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4),
    (16, 32, 256, 4, 4), (16, 64, 128, 4, 6),
    (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (32, 64, 256, 4, 3),
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3), (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4),
]
# FP8 weights alone: 128 x 64 tiles on 8 warps. With scale blocks along k each chunk's products are
# summed apart before its scales multiply them (moe_triton._dot_gate_up), and the up kernel's two
# 128 x 128 accumulators with those sums spill registers; on the H200 (DeepSeek-V3's D and I, 64 experts,
# 4096 tokens, W8A8, fixed configs) the layer took 9.08 -> 5.32 ms with 128 x 128 weight blocks and
# 16.13 -> 7.36 ms with the block scales by rows (from_pretrained's layout); per-row scales keep
# 128 x 128 (4.23 against 4.63 ms) (docs/BENCHMARKS.md, "W8A8 FP8 experts").
_FP8_ROW_TILES = [(128, 64, 64, 8, 3)]
_ROW_CONFIGS = [_row_cfg(*t, tail=tail, group=group) for group in (8, 1) for tail in (False, True)
                for t in _ROW_TILES if t[0] >= 64 or not tail]
_ROW_CONFIGS += [fp8_only(_row_cfg(*t, tail=tail, group=group)) for group in (8, 1) for tail in (False, True)
                 for t in _FP8_ROW_TILES]
# Weight gradients. Where experts get at most 32 rows on average (`_prune_wgrad`) a dW value is a short
# sum and the kernel is bound by writing dW; the few-row tiles, 16 and 32 rows a step on 4 warps, join
# the 32-row ones there. On the H200 at 64 tokens they wrote dW 4-19% faster than the best of the
# others: 16 rows a step where experts get 2 to 4 rows (DeepSeek-V3, Qwen3), 4 warps on wide tiles at
# 16 rows (Mixtral) (docs/BENCHMARKS.md, "GPU checks at 0576706; weight-gradient tiles for few rows").
_WGRAD_FEW_ROWS = [
    _cfg(64, 256, 16, 4, 4), _cfg(64, 128, 16, 4, 3), _cfg(64, 128, 16, 4, 2), _cfg(128, 128, 16, 4, 3),
    _cfg(128, 128, 32, 4, 2), _cfg(64, 256, 32, 4, 3),
]
_WGRAD_CONFIGS = [
    _cfg(128, 128, 32, 8, 4), _cfg(128, 128, 64, 8, 3), _cfg(128, 128, 64, 8, 4), _cfg(128, 256, 32, 8, 3),
    _cfg(128, 256, 64, 8, 3), _cfg(64, 128, 32, 4, 4), _cfg(128, 64, 64, 4, 4), *_WGRAD_FEW_ROWS,
]
# Fixed choices where autotuning is off (THUNDEREP_TRITON_AUTOTUNE=0, or the CPU interpreter).
_DEFAULT = {16: _row_cfg(16, 64, 128, 4, 4), 32: _row_cfg(32, 64, 128, 4, 4), 64: _row_cfg(64, 128, 64, 4, 4),
            128: _row_cfg(128, 128, 64, 8, 3)}
_DEFAULT_WGRAD = _cfg(128, 128, 32, 8, 4)


def _prune_rows(configs, named_args, **kwargs):
    bm = {**named_args, **kwargs}["m_class"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] == bm]
    return keep or [_DEFAULT[bm]]


def _prune_up(configs, named_args, **kwargs):
    # Two accumulators: keep BLOCK_M * BLOCK_N within 128 * 128 floats each.
    keep = [c for c in _prune_rows(configs, named_args, **kwargs)
            if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return keep or [_DEFAULT[{**named_args, **kwargs}["m_class"]]]


def _prune_wgrad(configs, named_args, **kwargs):
    if {**named_args, **kwargs}["m_class"] <= 32:  # few rows per expert: short row loops
        return [c for c in configs if c.kwargs["BLOCK_K"] <= 32] or configs
    few = {_signature(c) for c in _WGRAD_FEW_ROWS}
    return [c for c in configs if _signature(c) not in few]


def _signature(config: triton.Config) -> tuple:
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


# SCALE_K (FP8 weights' scale block along k; 1 for others) is in the keys: it bounds BLOCK_K (fp8.py); so
# is A_FP8 (FP8 inputs too, W8A8: other products, other best tiles).
_UP, _UP_PLAIN = tuned("up", K._up_kernel, _ROW_CONFIGS,
                      ["m_class", "m_fill", "I", "D", "GATHER", "SAVE_GU", "SCALE_K", "A_FP8"], _prune_up, "D")
_ROWS, _ROWS_PLAIN = tuned("rows", K._rows_kernel, _ROW_CONFIGS,
                            ["m_class", "m_fill", "N", "K", "SCATTER", "WEIGHTED", "SCALE_K", "A_FP8"], _prune_rows,
                            "K")
# The routing-weight partials dwp have one column per column tile of the config that ran: a trial with
# narrower tiles would leave partials the chosen config does not overwrite (wrong d weights on the
# first backward of each shape), so the autotuner zeroes dwp before every run.
_ACT_BWD, _ACT_BWD_PLAIN = tuned("act_bwd", K._act_bwd_kernel, _ROW_CONFIGS,
                                  ["m_class", "m_fill", "I", "D", "GATHER", "WEIGHTED"], _prune_up, "D",
                                  reset_to_zero=["dwp_ptr"])
_WGRAD, _WGRAD_PLAIN = tuned("wgrad", K._wgrad_kernel, _WGRAD_CONFIGS, ["m_class", "m_fill", "M", "N"], _prune_wgrad)


def _block_e(E: int) -> int:
    return max(16, next_power_of_2(E))


def _row_grid(n_rows: int, E: int, cols: int):
    return lambda meta: (min(cdiv(n_rows, meta["BLOCK_M"]) + E, n_rows) * cdiv(cols, meta["BLOCK_N"]),)


def _up(x, w_gu, order, counts, top_k, act, interleaved, save, n_rows, x_scale=None):
    """h [N, I] (and gu [N, 2I] with `save`) in the products' dtype; `x_scale`: x is FP8, row i standing
    for x[i] * x_scale[i] (W8A8)."""
    E, I2, D = w_gu.shape
    I = I2 // 2
    dtype = w_gu.dtype  # x's, or for FP8 inputs the weight's products
    h = torch.empty(n_rows, I, dtype=dtype, device=x.device)
    gu = torch.empty(n_rows if save else 0, I2, dtype=dtype, device=x.device)
    bm, fill = _m_key(n_rows, E)
    w = _data(w_gu)
    _launch(_UP, _UP_PLAIN, _DEFAULT[bm], _row_grid(n_rows, E, I), x.device,
            x_ptr=x, w_ptr=w, h_ptr=h, gu_ptr=gu, order_ptr=order if order is not None else counts,
            counts_ptr=counts, n_rows=n_rows, I=I, D=D, E=E, top_k=top_k,
            stride_xm=x.stride(0), stride_we=w.stride(0), stride_wn=w.stride(1), stride_hm=h.stride(0),
            stride_gm=I2, m_class=bm, m_fill=fill, ACT=act, INTERLEAVED=interleaved,
            GATHER=order is not None, SAVE_GU=save, PRECISION=_precision(dtype), BLOCK_E=_block_e(E),
            xs_ptr=x_scale if x_scale is not None else x, A_FP8=x_scale is not None,
            **scale_args(w_gu, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")))
    return h, gu


def _rows(a, b, b_strides, n_out, order, weights, counts, out, scatter, a_scale=None):
    """out[dst(r)] = w * a[r] @ B[e].T with B[e, n, k] at b + e*s0 + n*s1 + k*s2 (b: a tensor, or an
    Fp8Weight [E, n, k] whose strides are b_strides); `a_scale`: a is FP8, row r standing for
    a[r] * a_scale[r] (W8A8)."""
    n_rows, Kdim = a.shape
    E = counts.shape[0]
    bm, fill = _m_key(n_rows, E)
    _launch(_ROWS, _ROWS_PLAIN, _DEFAULT[bm], _row_grid(n_rows, E, n_out), a.device,
            a_ptr=a, b_ptr=_data(b), c_ptr=out, order_ptr=order if order is not None else counts,
            weight_ptr=weights if weights is not None else a, counts_ptr=counts,
            n_rows=n_rows, N=n_out, K=Kdim, E=E, stride_am=a.stride(0), stride_be=b_strides[0],
            stride_bn=b_strides[1], stride_bk=b_strides[2], stride_cm=out.stride(0), m_class=bm,
            m_fill=fill, SCATTER=scatter, WEIGHTED=weights is not None, PRECISION=_precision(out.dtype),
            BLOCK_E=_block_e(E), as_ptr=a_scale if a_scale is not None else a, A_FP8=a_scale is not None,
            **scale_args(b, "bs_ptr", ("stride_bse", "stride_bsn", "stride_bsk")))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows of a [R, C] tensor: on a GPU in one Triton pass (the same bits), elsewhere the
    torch reference (Triton's CPU interpreter does not round float32 to e4m3 as the GPU does)."""
    if x.device.type != "cuda":
        return fp8_rows(x)
    R, C = x.shape
    q = torch.empty(R, C, dtype=FP8, device=x.device)
    scale = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        passes._quantize_rows_kernel[(R,)](x, q, scale, R, C, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                          BLOCK_C=min(2048, max(16, next_power_of_2(C))))
    return q, scale


def _act_bwd(dy, w_down, gu, order, weights, counts, top_k, act, interleaved):
    """dgu [N, 2I], the routing-weight partials dwp [N, column tiles] in the pairs' flat order (empty
    without weights) and, with weights, hw = w * h [N, I] for the down projection's weight gradient
    (else None)."""
    n_rows, I2 = gu.shape
    E, D, I = w_down.shape
    bm, fill = _m_key(n_rows, E)
    dgu = dy.new_empty(n_rows, I2)
    tiles = cdiv(I, 16)  # at least the column tiles of any config; unused ones stay zero
    dwp = torch.zeros(n_rows if weights is not None else 0, tiles, dtype=torch.float32, device=dy.device)
    hw = dy.new_empty(n_rows, I) if weights is not None else None
    _launch(_ACT_BWD, _ACT_BWD_PLAIN, _DEFAULT[bm], _row_grid(n_rows, E, I), dy.device,
            dy_ptr=dy, w_ptr=w_down, gu_ptr=gu, dgu_ptr=dgu, dwp_ptr=dwp if weights is not None else dgu,
            hw_ptr=hw if hw is not None else dgu, order_ptr=order if order is not None else counts,
            weight_ptr=weights if weights is not None else dy,
            counts_ptr=counts, n_rows=n_rows, I=I, D=D, E=E, top_k=top_k, stride_dym=dy.stride(0),
            stride_we=w_down.stride(0), stride_wd=w_down.stride(1), stride_gm=I2, stride_dwp=tiles,
            m_class=bm, m_fill=fill, ACT=act, INTERLEAVED=interleaved, GATHER=order is not None,
            WEIGHTED=weights is not None, PRECISION=_precision(dy.dtype), BLOCK_E=_block_e(E))
    return dgu, dwp, hw


def _wgrad(a, b, counts, out):
    """out[e] = a_e.T @ b_e over expert e's rows (a, b in expert order), the portable kernel."""
    E, M, N = out.shape
    bm, fill = _wgrad_key(a.shape[0], E)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]), E)  # noqa: E731
    _launch(_WGRAD, _WGRAD_PLAIN, _DEFAULT_WGRAD, grid, a.device,
            a_ptr=a, b_ptr=b, c_ptr=out, counts_ptr=counts, M=M, N=N, E=E, R=a.shape[0],
            stride_am=a.stride(0), stride_bm=b.stride(0), stride_ce=out.stride(0), stride_cm=out.stride(1),
            m_class=bm, m_fill=fill, PRECISION=_precision(a.dtype), BLOCK_E=_block_e(E))


def _weight_grad(a, b, counts, weight, ends):
    """The gradient of `weight` ([E, M, N]): a_e.T @ b_e over expert e's rows, through torch's grouped
    GEMM where `ends` (its offsets, grouped_gemm.offsets; see grouped_gemm.wgrad_path) is given, else
    the portable kernel."""
    if ends is not None:
        return G.weight_grad(a, b, ends)
    out = torch.empty_like(weight)
    _wgrad(a, b, counts, out)
    return out


def _check(x, w_gu, w_d, order, counts, weights, top_k, activation, gemm):
    """InputError on inputs the kernels cannot take; `counts` None (the pair kernels take none) is not checked."""
    E, I2, D = w_gu.shape
    if gemm not in ("triton", "torch"):
        raise InputError(f"gemm must be 'triton' or 'torch', got {gemm!r}")
    if activation not in K.ACTIVATIONS:
        raise InputError(f"activation {activation!r} has no Triton kernel; use one of {sorted(K.ACTIVATIONS)}")
    if x.dtype not in _DTYPES:
        raise InputError(f"x has dtype {x.dtype}; the kernels take {', '.join(str(d) for d in _DTYPES)}")
    if w_gu.dtype != x.dtype or w_d.dtype != x.dtype:
        raise InputError(f"x ({x.dtype}), w_gate_up ({w_gu.dtype}) and w_down ({w_d.dtype}) must share one dtype: "
                         f"cast the weights or x first")
    if w_gu.device != x.device or w_d.device != x.device:
        raise InputError(f"x ({x.device}), w_gate_up ({w_gu.device}) and w_down ({w_d.device}) must be on one "
                         f"device")
    if w_d.shape != (E, D, I2 // 2) or x.shape[-1] != D:
        raise InputError(f"shapes do not match: x {tuple(x.shape)}, w_gate_up {tuple(w_gu.shape)}, "
                         f"w_down {tuple(w_d.shape)} (expected [E, 2I, D] and [E, D, I])")
    if counts is not None and counts.shape != (E,):
        raise InputError(f"counts_E has shape {tuple(counts.shape)}, expected ({E},)")
    if order is not None and order.shape[0] != x.shape[0] * top_k:
        raise InputError(f"order_N has {order.shape[0]} rows; x has {x.shape[0]} tokens x top_k {top_k} = "
                         f"{x.shape[0] * top_k}")
    if order is not None and weights is not None and weights.shape != order.shape:
        raise InputError(f"weights {tuple(weights.shape)} must match order {tuple(order.shape)}")
    if counts is not None and counts.device.type == "cpu":  # no sync here; on a GPU, see moe_mlp
        _check_rows(counts, order, x.shape[0], top_k)


def _check_rows(counts: torch.Tensor, order: Optional[torch.Tensor], n_tokens: int, top_k: int) -> None:
    """The checks of counts and order against the rows that read their values: on the CPU only (on a GPU
    each would be a host sync; there the kernels stay in bounds instead, see moe_mlp)."""
    n_rows = order.shape[0] if order is not None else n_tokens
    total = int(counts.sum())
    if total != n_rows or bool((counts < 0).any()):
        raise InputError(f"counts_E {counts.tolist()} must be >= 0 and sum to the {n_rows} rows "
                         f"({'order_N' if order is not None else 'x'}); they sum to {total}")
    if order is not None and order.numel() and not 0 <= int(order.min()) <= int(order.max()) < n_rows:
        raise InputError(f"order_N holds pairs {int(order.min())} to {int(order.max())}; x has "
                         f"{n_tokens} tokens x top_k {top_k}: use pairs in [0, {n_rows})")


def _integer(name: str, t: torch.Tensor) -> None:
    """InputError unless `t` holds integers: a float index would be truncated without a word."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor, got {t.dtype}")


def _moe_mlp_impl(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, order: Optional[torch.Tensor],
    counts: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, activation: str, interleaved: bool,
    save: bool, gemm: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, w_gate_up, w_down, order, counts, weights, top_k, activation, gemm)
    E, I2, D = w_gate_up.shape
    n_rows = order.shape[0] if order is not None else x.shape[0]
    if n_rows == 0:
        return x.new_zeros(x.shape[0], D), x.new_empty(0, I2 // 2), x.new_empty(0, I2)
    act = K.ACTIVATIONS[activation]
    if gemm == "torch":
        y, h, gu = G.forward(x, w_gate_up, w_down, order, counts, weights, top_k, act, interleaved)
        if not save:
            h, gu = x.new_empty(0, I2 // 2), x.new_empty(0, I2)
        return y, h, gu
    if getattr(w_gate_up, "w8a8", False):  # FP8 inputs too: x, then h, quantized per row (fp8.py)
        xq, x_scale = quantize_rows(x)
        h, gu = _up(xq, w_gate_up, order, counts, top_k, act, interleaved, save, n_rows, x_scale)
        a, a_scale = quantize_rows(h)
    else:
        h, gu = _up(x, w_gate_up, order, counts, top_k, act, interleaved, save, n_rows)
        a, a_scale = h, None
    if order is None:
        y = x.new_empty(n_rows, D)
        _rows(a, w_down, w_down.stride(), D, None, None, counts, y, scatter=False, a_scale=a_scale)
    else:
        y_flat = x.new_empty(n_rows, D)
        _rows(a, w_down, w_down.stride(), D, order, weights, counts, y_flat, scatter=True, a_scale=a_scale)
        y = y_flat.view(-1, top_k, D).sum(dim=1)
    if not save:
        h = x.new_empty(0, I2 // 2)
    return y, h, gu


_moe_mlp_op = torch.library.custom_op("thunderep::moe_mlp", mutates_args=())(_moe_mlp_impl)


@_moe_mlp_op.register_fake
def _(x, w_gate_up, w_down, order, counts, weights, top_k, activation, interleaved, save, gemm):
    E, I2, D = w_gate_up.shape
    n_rows = order.shape[0] if order is not None else x.shape[0]
    rows = n_rows if save else 0
    return x.new_empty(x.shape[0], D), x.new_empty(rows, I2 // 2), x.new_empty(rows, I2)


def _moe_mlp_backward_impl(
    dy: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    order: Optional[torch.Tensor], counts: torch.Tensor, weights: Optional[torch.Tensor], h: torch.Tensor,
    gu: torch.Tensor, top_k: int, activation: str, interleaved: bool, gemm: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    E, I2, D = w_gate_up.shape
    I = I2 // 2
    n_rows = h.shape[0]
    gather = order is not None
    dy = dy.contiguous()
    dw_dtype = weights.dtype if weights is not None else x.dtype
    if n_rows == 0:
        return (torch.zeros_like(x), torch.zeros_like(w_gate_up), torch.zeros_like(w_down),
                dy.new_zeros(0, dtype=dw_dtype))
    act = K.ACTIVATIONS[activation]
    dy_rows = None
    if gemm == "torch":
        dx, dgu, dweights, dy_rows, hw = G.backward_dx(dy, w_gate_up, w_down, order, counts, weights, gu,
                                                        top_k, act, interleaved)
    else:
        dgu, dwp, hw = _act_bwd(dy, w_down, gu, order, weights, counts, top_k, act, interleaved)
        # dx: dgu @ Wgu[e] (B[e, n=D, k=2I] = w_gate_up[e, k, n]), un-permuted to flat rows then summed per token.
        dx_rows = dy.new_empty(n_rows, D)
        wg = w_gate_up
        _rows(dgu, wg, (wg.stride(0), wg.stride(2), wg.stride(1)), D, order, None, counts, dx_rows, scatter=gather)
        dx = dx_rows.view(-1, top_k, D).sum(dim=1) if gather else dx_rows
        dweights = dy.new_empty(0, dtype=torch.float32)
        if weights is not None:  # partials per column tile, in flat (token, slot) order -> per pair
            dweights = dwp.sum(dim=1)
    # Weight gradients over rows in expert order: dWd[e] = dy_rows.T @ (w * h), dWgu[e] = dgu.T @ x_rows.
    # The token rows are gathered here for both paths: gathered again rather than kept from the forward
    # ([N, D] is K times the size of x; one memory pass), and not inside the weight-gradient GEMM, where
    # an index load before every row load costs more than the pass (docs/BENCHMARKS.md). One gathered
    # [N, D] copy is alive at a time.
    ends = G.offsets(counts, n_rows) if G.wgrad_path(dy, n_rows, E, D, I) == "torch" else None  # once for both
    if dy_rows is None:
        dy_rows = G.gather_rows(dy, order, top_k) if gather else dy
    dw_down = _weight_grad(dy_rows, hw if hw is not None else h, counts, w_down, ends)
    del dy_rows
    x_rows = G.gather_rows(x, order, top_k) if gather else x.contiguous()
    dw_gate_up = _weight_grad(dgu, x_rows, counts, w_gate_up, ends)
    return dx.to(x.dtype), dw_gate_up, dw_down, dweights.to(dw_dtype)


_moe_mlp_backward_op = torch.library.custom_op("thunderep::moe_mlp_backward", mutates_args=())(_moe_mlp_backward_impl)


@_moe_mlp_backward_op.register_fake
def _(dy, x, w_gate_up, w_down, order, counts, weights, h, gu, top_k, activation, interleaved, gemm):
    n = h.shape[0] if weights is not None else 0
    dtype = weights.dtype if weights is not None else x.dtype
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down), x.new_empty(n, dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, w_gate_up, w_down, order, counts, weights, top_k, activation, interleaved, save, gemm = inputs
    _, h, gu = output
    ctx.save_for_backward(x, w_gate_up, w_down, order, counts, weights, h, gu)
    ctx.set_materialize_grads(False)  # h and gu are never used downstream: no zero [N, 3I] gradients
    ctx.top_k, ctx.activation, ctx.interleaved, ctx.save = top_k, activation, interleaved, save


def _backward(ctx, dy, dh, dgu, backward_op=_moe_mlp_backward_op):
    """The op's autograd formula. `backward_op`: the backward custom op (what torch.compile traces, as an
    opaque node) or, from the eager autograd.Function, its implementation."""
    x, w_gate_up, w_down, order, counts, weights, h, gu = ctx.saved_tensors
    if dy is None:  # y did not reach the loss
        return (None,) * 11
    if not ctx.save:
        raise RuntimeError("thunderep::moe_mlp ran with save=False: its intermediates were not kept for backward")
    E, I2, D = w_gate_up.shape
    gemm = G.gemm_path(dy, h.shape[0], E, D, I2 // 2, backward=True)
    dx, dw_gu, dw_d, dweights = backward_op(
        dy, x, w_gate_up, w_down, order, counts, weights, h, gu, ctx.top_k, ctx.activation, ctx.interleaved,
        gemm)
    return dx, dw_gu, dw_d, None, None, (dweights if weights is not None else None), None, None, None, None, None


_moe_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def _moe_mlp_fp8_impl(
    x: torch.Tensor, q_gate_up: torch.Tensor, s_gate_up: torch.Tensor, block_gate_up: list[int],
    q_down: torch.Tensor, s_down: torch.Tensor, block_down: list[int], order: Optional[torch.Tensor],
    counts: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, activation: str, interleaved: bool,
    w8a8: bool = False,
) -> torch.Tensor:
    """The forward of `_moe_mlp_impl` on FP8 weights (fp8.Fp8Weight, as tensors for the custom op)."""
    w_gu = Fp8Weight(q_gate_up, s_gate_up, tuple(block_gate_up), x.dtype, w8a8)
    w_d = Fp8Weight(q_down, s_down, tuple(block_down), x.dtype, w8a8)
    y, _, _ = _moe_mlp_impl(x, w_gu, w_d, order, counts, weights, top_k, activation, interleaved, False, "triton")
    return y


_moe_mlp_fp8_op = torch.library.custom_op("thunderep::moe_mlp_fp8", mutates_args=())(_moe_mlp_fp8_impl)


@_moe_mlp_fp8_op.register_fake
def _(x, q_gate_up, s_gate_up, block_gate_up, q_down, s_down, block_down, order, counts, weights, top_k,
      activation, interleaved, w8a8=False):
    return x.new_empty(x.shape[0], q_gate_up.shape[2])


def check_fp8(x: torch.Tensor, w_gate_up, w_down, *tensors) -> None:
    """InputError unless both weights are Fp8Weight in x's dtype whose scale blocks the kernels can
    walk, and nothing asks for gradients (FP8 weights are for inference)."""
    if not (isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight)):
        raise InputError(f"w_gate_up ({type(w_gate_up).__name__}) and w_down ({type(w_down).__name__}) must both "
                         f"be Fp8Weight, or both tensors")
    if w_gate_up.w8a8 != w_down.w8a8:
        raise InputError(f"w_gate_up (w8a8={w_gate_up.w8a8}) and w_down (w8a8={w_down.w8a8}) must agree on "
                         f"whether the products run in FP8")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        cols, scale_k = w.shape[2], w.block[1]
        if scale_k < cols and scale_k % 16:
            raise InputError(f"{name}'s scale blocks are {scale_k} columns wide: the kernels take blocks of a "
                             f"multiple of 16 columns, or one block across all {cols}")
        if w.w8a8 and scale_k < cols and scale_k % 32:  # FP8 tensor-core products take 32 columns at once
            raise InputError(f"{name}'s scale blocks are {scale_k} columns wide: FP8 products (w8a8) take blocks "
                             f"of a multiple of 32 columns, or one block across all {cols}")
    if _needs_grad(x, *tensors):
        raise InputError("FP8 expert weights are for inference: nothing here differentiates through them (run "
                         "under torch.no_grad(), or train on their dequantized copy, Fp8Weight.dequantize())")


class _MoeMlpFunction(torch.autograd.Function):
    """The op's autograd in eager mode without the dispatcher's custom-op layer, whose host time a small
    training step's kernels do not cover (on the H200, 0.26-0.67 ms per forward + backward of Qwen3's
    layer at 64 and 512 tokens; docs/BENCHMARKS.md); torch.compile traces the custom ops instead. Same
    implementation, context and backward as the op."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _moe_mlp_impl(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[1], output[2])  # h and gu: kept for backward only
        return output

    @staticmethod
    def backward(ctx, dy, dh, dgu):
        return _backward(ctx, dy, dh, dgu, backward_op=_moe_mlp_backward_impl)


def moe_mlp(
    x: torch.Tensor,
    w_gate_up_E2ID: torch.Tensor,
    w_down_EDI: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    order_N: torch.Tensor | None = None,
    weights_N: torch.Tensor | None = None,
    top_k: int = 1,
    activation: str = "silu",
    interleaved: bool = False,
) -> torch.Tensor:
    """The expert MLP through the Triton kernels.

    x: [T, D] with `order_N` (gathered mode) or [N, D] sorted by expert (sorted mode).
    w_gate_up_E2ID: [E, 2I, D]; w_down_EDI: [E, D, I] (Hugging Face 5.x layout), x's dtype; weights that
    are not contiguous (a transposed view) are copied on every call.
    counts_E: [E] rows per expert (any integer dtype, any device; moved to x's device), >= 0, summing to
    N. Checked where x is on the CPU; on a GPU that would cost a sync, so the kernels instead
    take negative counts as 0 and read and write no row past N: rows the counts leave out come out
    undefined, never out of bounds.
    order_N: [N] integer, the flat (token * top_k + slot) pair of each sorted row, in [0, N): checked
    where x is on the CPU; on a GPU a pair outside it reads out of bounds.
    weights_N: [T * K] routing weights in flat order (gathered mode only).
    Returns y_TD (gathered: weighted and summed over each token's K rows) or y_ND (sorted, unweighted).
    """
    _integer("counts_E", counts_E)
    if order_N is not None:
        _integer("order_N", order_N)
    counts = counts_E.to(device=x.device, dtype=torch.int32, non_blocking=True)
    order = order_N.to(torch.int32) if order_N is not None else None
    weights = weights_N.reshape(-1) if weights_N is not None else None
    if weights is not None and order is None:
        raise InputError("weights_N needs order_N (the sorted mode returns unweighted rows)")
    if isinstance(w_gate_up_E2ID, Fp8Weight) or isinstance(w_down_EDI, Fp8Weight):
        check_fp8(x, w_gate_up_E2ID, w_down_EDI, weights)
        op = _moe_mlp_fp8_op if torch.compiler.is_compiling() else _moe_mlp_fp8_impl
        w_gu, w_d = w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous()
        return op(x.contiguous(), w_gu.q, w_gu.scale, list(w_gu.block), w_d.q, w_d.scale, list(w_d.block), order,
                  counts, weights, top_k, activation, interleaved, w_gu.w8a8)
    needs_grad = _needs_grad(x, w_gate_up_E2ID, w_down_EDI, weights)
    E, I2, D = w_gate_up_E2ID.shape
    n_rows = order.shape[0] if order is not None else x.shape[0]
    gemm = G.gemm_path(x, n_rows, E, D, I2 // 2)
    # Eager mode calls the implementation itself (inference) or through an autograd.Function (training):
    # the dispatcher's custom-op layer costs host time comparable to a decode step's GPU time;
    # torch.compile needs the op.
    if torch.compiler.is_compiling():
        op = _moe_mlp_op
    else:
        op = _MoeMlpFunction.apply if needs_grad else _moe_mlp_impl
    y, _, _ = op(x.contiguous(), w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous(), order, counts, weights,
                 top_k, activation, interleaved, needs_grad, gemm)
    return y


# Up to this many (token, slot) pairs, a step (inference or training) sorts the pairs by expert and
# counts them in one Triton program (_route_kernel): one launch where torch takes five (a radix sort,
# the copy before it, a fill and a scatter for the counts, the index conversion: 17 us of Mixtral's
# 64-token step on the H200, against 2 us; docs/BENCHMARKS.md, "Decode"). One program holds the whole
# batch: the bound keeps it small.
ROUTE_MAX_PAIRS = 1024


def _route_impl(ids_TK: torch.Tensor, weights_TK: Optional[torch.Tensor], E: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N = ids_TK.numel()
    device = ids_TK.device
    order_N = torch.empty(N, dtype=torch.int32, device=device)
    counts_E = torch.empty(E, dtype=torch.int32, device=device)
    weights_N = torch.empty(N, dtype=weights_TK.dtype if weights_TK is not None else dtype, device=device)
    passes._route_kernel[(1,)](ids_TK.reshape(-1), weights_TK.reshape(-1) if weights_TK is not None else weights_N,
                               order_N, counts_E, weights_N, N, E, WEIGHTED=weights_TK is not None,
                               BLOCK_N=max(16, next_power_of_2(N)), BLOCK_E=_block_e(E),
                               RANKED=route_ranks(device))
    return order_N, counts_E, weights_N


def route_ranks(device: torch.device) -> bool:
    """Whether _route_kernel orders the pairs by counting ranks rather than with tl.sort: off a GPU,
    in Triton's CPU interpreter (`passes._route_kernel`)."""
    return device.type != "cuda"


_route_op = torch.library.custom_op("thunderep::route", mutates_args=())(_route_impl)


@_route_op.register_fake
def _(ids_TK, weights_TK, E, dtype):
    N = ids_TK.numel()
    w_dtype = weights_TK.dtype if weights_TK is not None else dtype
    return (ids_TK.new_empty(N, dtype=torch.int32), ids_TK.new_empty(E, dtype=torch.int32),
            ids_TK.new_empty(N, dtype=w_dtype))


def _route(ids_TK: torch.Tensor, weights_TK: torch.Tensor | None, E: int, dtype: torch.dtype):
    """(order_N [N] int32, counts_E [E] int32, weights_N [N]) for at most ROUTE_MAX_PAIRS pairs, through
    _route_kernel. ids_TK: [T, K] integer; weights_TK: [T, K] or None (weights_N is then 1 in `dtype`).
    Ids outside [0, E) count as expert 0 with weight 0 for -1, NaN otherwise. weights_N carries no
    gradient: with gradients, callers take it as a mask (weights_TK None) and multiply the routing
    weights by it (flat order is the same)."""
    op = _route_op if torch.compiler.is_compiling() else _route_impl
    return op(ids_TK.contiguous(), weights_TK.contiguous() if weights_TK is not None else None, E, dtype)


def _int32_counts(ids_TK: torch.Tensor, E: int) -> torch.Tensor:
    """[E] int32 rows per expert, without a device-to-host sync."""
    flat = ids_TK.reshape(-1)
    return torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))


def routed_moe_mlp(
    x_TD: torch.Tensor,
    w_gate_up_E2ID: torch.Tensor,
    w_down_EDI: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor | None = None,
    *,
    counts_E: torch.Tensor | None = None,
    activation: str = "silu",
    interleaved: bool = False,
) -> torch.Tensor:
    """y_TD = sum over k of weights_TK[t, k] * expert_{ids_TK[t, k]}(x_TD[t]): the expert MLP from the
    router's output.

    Inference on one token (decode) runs the pair kernels: one matrix-vector pass per (token, slot)
    pair, no sort, two launches; on a few more tokens, whichever of the two paths measured faster at
    that shape and T (`pairs.pairs_win`). Otherwise the pairs are sorted by expert and `moe_mlp` runs
    (counts_E [E], if the router computed it, saves recounting); on at most ROUTE_MAX_PAIRS pairs one
    Triton program sorts and counts them, with gradients too.
    x_TD: [T, D]; ids_TK: [T, K] integer; weights_TK: [T, K] or None (unweighted sum over K); the expert
    weights as for `moe_mlp`.
    Inference treats id -1 as a pair computed elsewhere (it adds nothing; the pair kernels skip it, the
    sorted path computes it as expert 0 with weight 0) and gives NaN for a token with any other id
    outside [0, E); so does training on at most ROUTE_MAX_PAIRS pairs (the -1 pair's gradients are zero).
    Larger batches with gradients need ids in [0, E).
    """
    if ids_TK.dim() != 2 or x_TD.dim() != 2 or ids_TK.shape[0] != x_TD.shape[0]:
        raise InputError(f"ids_TK {tuple(ids_TK.shape)} must be [T, K] for x_TD {tuple(x_TD.shape)}")
    _integer("ids_TK", ids_TK)
    if weights_TK is not None and weights_TK.shape != ids_TK.shape:
        raise InputError(f"weights_TK {tuple(weights_TK.shape)} must match ids_TK {tuple(ids_TK.shape)}")
    T, K = ids_TK.shape

    def sorted_path(ids: torch.Tensor) -> torch.Tensor:  # ids: ids_TK, or another routing when timing paths
        if T * K <= ROUTE_MAX_PAIRS:
            grad = _needs_grad(x_TD, w_gate_up_E2ID, w_down_EDI, weights_TK)
            # With gradients the program's weights are a mask, 1 for a known id, 0 for -1, NaN for any
            # other, and the routing weights themselves times it go on: their gradient flows, and ids
            # outside [0, E) give what inference gives.
            order_N, counts, weights_N = _route(ids, None if grad else weights_TK, w_gate_up_E2ID.shape[0],
                                                x_TD.dtype)
            if grad and weights_TK is not None:
                weights_N = weights_TK.reshape(-1) * weights_N
            return moe_mlp(x_TD, w_gate_up_E2ID, w_down_EDI, counts, order_N=order_N, weights_N=weights_N,
                           top_k=K, activation=activation, interleaved=interleaved)
        order_N = torch.argsort(ids.reshape(-1), stable=True)
        counts = counts_E if counts_E is not None and ids is ids_TK else _int32_counts(ids, w_gate_up_E2ID.shape[0])
        return moe_mlp(x_TD, w_gate_up_E2ID, w_down_EDI, counts, order_N=order_N, weights_N=weights_TK, top_k=K,
                       activation=activation, interleaved=interleaved)

    if T <= max(P.PAIRS_TUNE_MAX_TOKENS, P.pairs_max_tokens()):
        _check(x_TD, w_gate_up_E2ID, w_down_EDI, None, None, None, K, activation, "triton")
        if P.pairs_win(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved, sorted_path):
            return P.moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved)
    return sorted_path(ids_TK)
