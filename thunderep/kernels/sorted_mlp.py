"""The host side of the sorted-row kernels: their launches, and the expert MLP's forward and backward
over them (what the ops in ops.py run).

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N routed rows in expert order, P = ceil(I / BLOCK_N) column tiles.

    forward(x, w_gate_up_E2ID, w_down_EDI, order_N, counts_E, weights, top_k, ...) -> (y, h_NI, gu_N2I)
    forward_summed(x_TD, ..., order_Q, counts_E, weights_N, top_k, ...) -> y_TD   (some pairs; inference)
    backward(dy, x, ..., h_NI, gu_N2I) -> (dx, dw_gate_up, dw_down, dweights)
    route(ids_TK, weights_TK, E, dtype) -> (order_N, counts_E, weights_N)

Two GEMM paths (`gemm`; forward and backward choose separately, `grouped_gemm.gemm_path`):
  * "triton": the fused kernels of moe_triton.py (gather in the A load, activation and
    weight/un-permute epilogues); portable, the only path on sm_89 / sm_120.
  * "torch" (Hopper): rows gathered once, torch's grouped GEMM (CUTLASS, TMA + warp specialization)
    for the GEMMs, and Triton passes for what the fused epilogues did (grouped_gemm.py).
Tile configs and the keys they are tuned by are tiles.py's.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from . import checks, passes, paths, tiles, tuning
from . import grouped_gemm as G
from .act import ACTIVATIONS
from .fp8 import FP8, FP8_MAX, scale_args, weight_data
from .fp8 import quantize_rows as fp8_rows
from .int4 import Int4Weight
from .presum import positions, presum_at
from .tuning import cdiv, next_power_of_2

__all__ = ["act_bwd", "backward", "block_e", "rows", "forward", "forward_summed", "quantize_rows", "route", "route_ranks",
           "row_grid", "up", "weight_grad", "wgrad"]


def block_e(E: int) -> int:
    """BLOCK_E of the row kernels: the experts' counts in one block."""
    return max(16, next_power_of_2(E))


def row_grid(n_rows: int, E: int, cols: int):
    """A row kernel's grid: an upper bound of its row tiles (row_tiles.py) times its column tiles."""
    return lambda meta: (min(cdiv(n_rows, meta["BLOCK_M"]) + E, n_rows) * cdiv(cols, meta["BLOCK_N"]),)


def up(x, w_gu, order, counts, top_k, act, interleaved, save, n_rows, x_scale=None):
    """h [N, I] (and gu [N, 2I] with `save`) in the products' dtype; `x_scale`: x is FP8, row i standing
    for x[i] * x_scale[i] (W8A8). 4-bit weights (int4.Int4Weight): the packed kernels, nothing saved."""
    E, I2, D = w_gu.shape
    I = I2 // 2
    dtype = w_gu.dtype  # x's, or for FP8 inputs the weight's products
    h = torch.empty(n_rows, I, dtype=dtype, device=x.device)
    gu = torch.empty(n_rows if save else 0, I2, dtype=dtype, device=x.device)
    bm, fill = tiles.m_key(n_rows, E)
    shared = dict(x_ptr=x, h_ptr=h, gu_ptr=gu, order_ptr=order if order is not None else counts, counts_ptr=counts,
                  n_rows=n_rows, I=I, D=D, E=E, top_k=top_k, stride_xm=x.stride(0), stride_hm=h.stride(0),
                  m_class=bm, m_fill=fill, ACT=act, INTERLEAVED=interleaved, GATHER=order is not None,
                  PRECISION=tuning.precision(dtype), BLOCK_E=block_e(E))
    if isinstance(w_gu, Int4Weight):
        if save:
            raise InputError("4-bit expert weights are for inference: nothing is saved for a backward pass")
        tuning.launch(tiles.UP4, tiles.UP4_PLAIN, tiles.DEFAULT_ROW[bm], row_grid(n_rows, E, I), x.device,
                      w_ptr=w_gu.packed, stride_we=w_gu.packed.stride(0), stride_wn=w_gu.packed.stride(1),
                      SCALED_DOT=paths.sorted4_scaled(w_gu), **w_gu.kernel_args(), **shared)
        return h, gu
    w = weight_data(w_gu)
    tuning.launch(tiles.UP, tiles.UP_PLAIN, tiles.DEFAULT_ROW[bm], row_grid(n_rows, E, I), x.device,
                  w_ptr=w, stride_we=w.stride(0), stride_wn=w.stride(1), stride_gm=I2, SAVE_GU=save,
                  xs_ptr=x_scale if x_scale is not None else x, A_FP8=x_scale is not None,
                  **scale_args(w_gu, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")), **shared)
    return h, gu


def rows(a, b, b_strides, n_out, order, weights, counts, out, scatter, a_scale=None):
    """out[dst(r)] = w * a[r] @ B[e].T with B[e, n, k] at b + e*s0 + n*s1 + k*s2 (b: a tensor, or an
    Fp8Weight [E, n, k] whose strides are b_strides; an int4.Int4Weight [E, n, k], its own strides, b_strides
    unused); `a_scale`: a is FP8, row r standing for a[r] * a_scale[r] (W8A8)."""
    n_rows, Kdim = a.shape
    E = counts.shape[0]
    bm, fill = tiles.m_key(n_rows, E)
    shared = dict(a_ptr=a, c_ptr=out, order_ptr=order if order is not None else counts,
                  weight_ptr=weights if weights is not None else a, counts_ptr=counts, n_rows=n_rows, N=n_out,
                  K=Kdim, E=E, stride_am=a.stride(0), stride_cm=out.stride(0), m_class=bm, m_fill=fill,
                  SCATTER=scatter, WEIGHTED=weights is not None, PRECISION=tuning.precision(out.dtype),
                  BLOCK_E=block_e(E))
    if isinstance(b, Int4Weight):
        tuning.launch(tiles.ROWS4, tiles.ROWS4_PLAIN, tiles.DEFAULT_ROW[bm], row_grid(n_rows, E, n_out), a.device,
                      b_ptr=b.packed, stride_be=b.packed.stride(0), stride_bn=b.packed.stride(1), **b.kernel_args(),
                      SCALED_DOT=paths.sorted4_scaled(b), **shared)
        return
    tuning.launch(tiles.ROWS, tiles.ROWS_PLAIN, tiles.DEFAULT_ROW[bm], row_grid(n_rows, E, n_out), a.device,
                  b_ptr=weight_data(b), stride_be=b_strides[0], stride_bn=b_strides[1], stride_bk=b_strides[2],
                  as_ptr=a_scale if a_scale is not None else a, A_FP8=a_scale is not None,
                  **scale_args(b, "bs_ptr", ("stride_bse", "stride_bsn", "stride_bsk")), **shared)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows of a [R, C] tensor: on a GPU in one Triton pass (the same bits), elsewhere the
    torch reference (Triton's CPU interpreter does not round float32 to e4m3 as the GPU does)."""
    if x.device.type != "cuda":
        return fp8_rows(x)
    R, C = x.shape
    q = torch.empty(R, C, dtype=FP8, device=x.device)
    scale = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        passes.quantize_rows_kernel[(R,)](x, q, scale, R, C, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                          BLOCK_C=min(2048, max(16, next_power_of_2(C))))
    return q, scale


def act_bwd(dy, w_down, gu, order, weights, counts, top_k, act, interleaved):
    """dgu [N, 2I], the routing-weight partials dwp [N, column tiles] in the pairs' flat order (empty
    without weights) and, with weights, hw = w * h [N, I] for the down projection's weight gradient
    (else None)."""
    n_rows, I2 = gu.shape
    E, D, I = w_down.shape
    bm, fill = tiles.m_key(n_rows, E)
    dgu = dy.new_empty(n_rows, I2)
    n_tiles = cdiv(I, 16)  # at least the column tiles of any config; unused ones stay zero
    dwp = torch.zeros(n_rows if weights is not None else 0, n_tiles, dtype=torch.float32, device=dy.device)
    hw = dy.new_empty(n_rows, I) if weights is not None else None
    tuning.launch(tiles.ACT_BWD, tiles.ACT_BWD_PLAIN, tiles.DEFAULT_ROW[bm], row_grid(n_rows, E, I), dy.device,
                  dy_ptr=dy, w_ptr=w_down, gu_ptr=gu, dgu_ptr=dgu, dwp_ptr=dwp if weights is not None else dgu,
                  hw_ptr=hw if hw is not None else dgu, order_ptr=order if order is not None else counts,
                  weight_ptr=weights if weights is not None else dy,
                  counts_ptr=counts, n_rows=n_rows, I=I, D=D, E=E, top_k=top_k, stride_dym=dy.stride(0),
                  stride_we=w_down.stride(0), stride_wd=w_down.stride(1), stride_gm=I2, stride_dwp=n_tiles,
                  m_class=bm, m_fill=fill, ACT=act, INTERLEAVED=interleaved, GATHER=order is not None,
                  WEIGHTED=weights is not None, PRECISION=tuning.precision(dy.dtype), BLOCK_E=block_e(E))
    return dgu, dwp, hw


def wgrad(a, b, counts, out):
    """out[e] = a_e.T @ b_e over expert e's rows (a, b in expert order), the portable kernel."""
    E, M, N = out.shape
    bm, fill = tiles.wgrad_key(a.shape[0], E)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]), E)  # noqa: E731
    tuning.launch(tiles.WGRAD, tiles.WGRAD_PLAIN, tiles.DEFAULT_WGRAD, grid, a.device,
                  a_ptr=a, b_ptr=b, c_ptr=out, counts_ptr=counts, M=M, N=N, E=E, R=a.shape[0],
                  stride_am=a.stride(0), stride_bm=b.stride(0), stride_ce=out.stride(0), stride_cm=out.stride(1),
                  m_class=bm, m_fill=fill, PRECISION=tuning.precision(a.dtype), BLOCK_E=block_e(E))


def weight_grad(a, b, counts, weight, ends):
    """The gradient of `weight` ([E, M, N]): a_e.T @ b_e over expert e's rows, through torch's grouped
    GEMM where `ends` (its offsets, grouped_gemm.offsets; see grouped_gemm.wgrad_path) is given, else
    the portable kernel."""
    if ends is not None:
        return G.weight_grad(a, b, ends)
    out = torch.empty_like(weight)
    wgrad(a, b, counts, out)
    return out


def forward(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, order: Optional[torch.Tensor],
    counts: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, activation: str, interleaved: bool,
    save: bool, gemm: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert MLP's forward -> (y, h_NI, gu_N2I), h and gu empty unless `save` (ops.moe_mlp's
    arguments; `gemm`: "triton" or "torch")."""
    checks.check(x, w_gate_up, w_down, order, counts, weights, top_k, activation, gemm)
    E, I2, D = w_gate_up.shape
    n_rows = order.shape[0] if order is not None else x.shape[0]
    if n_rows == 0:
        return x.new_zeros(x.shape[0], D), x.new_empty(0, I2 // 2), x.new_empty(0, I2)
    act = ACTIVATIONS[activation]
    if gemm == "torch":
        y, h, gu = G.forward(x, w_gate_up, w_down, order, counts, weights, top_k, act, interleaved)
        if not save:
            h, gu = x.new_empty(0, I2 // 2), x.new_empty(0, I2)
        return y, h, gu
    h, gu, a, a_scale = _up_and_down_input(x, w_gate_up, order, counts, top_k, act, interleaved, save, n_rows)
    if order is None:
        y = x.new_empty(n_rows, D)
        rows(a, w_down, _strides(w_down), D, None, None, counts, y, scatter=False, a_scale=a_scale)
    else:
        y_flat = x.new_empty(n_rows, D)
        rows(a, w_down, _strides(w_down), D, order, weights, counts, y_flat, scatter=True, a_scale=a_scale)
        y = y_flat.view(-1, top_k, D).sum(dim=1)
    if not save:
        h = x.new_empty(0, I2 // 2)
    return y, h, gu


def _strides(w):
    """A weight's strides for `rows` (none for 4-bit weights, which carry their own)."""
    return None if isinstance(w, Int4Weight) else w.stride()


def _up_and_down_input(x, w_gate_up, order, counts, top_k, act, interleaved, save, n_rows):
    """The up pass -> (h, gu, the down pass's input a, its row scales or None): a = h, or with W8A8
    weights x and then h quantized per row (fp8.py)."""
    if getattr(w_gate_up, "w8a8", False):
        xq, x_scale = quantize_rows(x)
        h, gu = up(xq, w_gate_up, order, counts, top_k, act, interleaved, save, n_rows, x_scale)
        return (h, gu, *quantize_rows(h))
    h, gu = up(x, w_gate_up, order, counts, top_k, act, interleaved, save, n_rows)
    return h, gu, h, None


def forward_summed(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
    weights: torch.Tensor, top_k: int, activation: str, interleaved: bool, gemm: str,
    pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_TD [T, D] in x's dtype: y[t] = sum over the listed pairs (t, k) of weights[t * K + k] * the pair's
    expert(x[t]), each pair's output in x's dtype, summed in float32. pos: int32 [T * K], where each flat
    pair sits in `order` (-1: not listed), or None (then computed here: `presum.positions`).

    x: x_TD. order: [Q] int32, the flat pairs t * K + k to compute, grouped by expert by `counts` (any
    subset of the T * K pairs: a row whose pairs are all absent comes out 0). weights: [T * K] flat, or
    [T, K] of any strides (read in place).
    The triton path gathers each pair's row in the up kernel (no expanded copy of x), the torch path
    gathers the rows once for its grouped GEMMs; both write the pairs' outputs in `order` and sum each
    row's pairs in one pass (presum.py: in k order, no atomics). Inference: nothing is saved for backward."""
    checks.check(x, w_gate_up, w_down, order, counts, weights, top_k, activation, gemm, subset=True)
    E, I2, D = w_gate_up.shape
    n_rows = order.shape[0]
    if n_rows == 0:
        return x.new_zeros(x.shape[0], D)
    act = ACTIVATIONS[activation]
    if gemm == "torch":
        y_QD, _, _ = G.forward(G.gather_rows(x, order, top_k), w_gate_up, w_down, None, counts, None, top_k, act,
                               interleaved)
    else:
        _, _, a, a_scale = _up_and_down_input(x, w_gate_up, order, counts, top_k, act, interleaved, False, n_rows)
        y_QD = x.new_empty(n_rows, D)
        rows(a, w_down, _strides(w_down), D, None, None, counts, y_QD, scatter=False, a_scale=a_scale)
    pos = positions(order, x.shape[0] * top_k) if pos is None else pos
    return presum_at(y_QD, weights, pos, x.shape[0], top_k)


def backward(
    dy: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    order: Optional[torch.Tensor], counts: torch.Tensor, weights: Optional[torch.Tensor], h: torch.Tensor,
    gu: torch.Tensor, top_k: int, activation: str, interleaved: bool, gemm: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert MLP's backward from dy and the forward's h, gu -> (dx, dw_gate_up, dw_down, dweights
    [N] in flat (token, slot) order, empty without weights)."""
    E, I2, D = w_gate_up.shape
    I = I2 // 2
    n_rows = h.shape[0]
    gather = order is not None
    dy = dy.contiguous()
    dw_dtype = weights.dtype if weights is not None else x.dtype
    if n_rows == 0:
        return (torch.zeros_like(x), torch.zeros_like(w_gate_up), torch.zeros_like(w_down),
                dy.new_zeros(0, dtype=dw_dtype))
    act = ACTIVATIONS[activation]
    dy_rows = None
    if gemm == "torch":
        dx, dgu, dweights, dy_rows, hw = G.backward_dx(dy, w_gate_up, w_down, order, counts, weights, gu,
                                                        top_k, act, interleaved)
    else:
        dgu, dwp, hw = act_bwd(dy, w_down, gu, order, weights, counts, top_k, act, interleaved)
        # dx: dgu @ Wgu[e] (B[e, n=D, k=2I] = w_gate_up[e, k, n]), un-permuted to flat rows then summed per token.
        dx_rows = dy.new_empty(n_rows, D)
        wg = w_gate_up
        rows(dgu, wg, (wg.stride(0), wg.stride(2), wg.stride(1)), D, order, None, counts, dx_rows, scatter=gather)
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
    dw_down = weight_grad(dy_rows, hw if hw is not None else h, counts, w_down, ends)
    del dy_rows
    x_rows = G.gather_rows(x, order, top_k) if gather else x.contiguous()
    dw_gate_up = weight_grad(dgu, x_rows, counts, w_gate_up, ends)
    return dx.to(x.dtype), dw_gate_up, dw_down, dweights.to(dw_dtype)


def route(ids_TK: torch.Tensor, weights_TK: Optional[torch.Tensor], E: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_N [N] int32, counts_E [E] int32, weights_N [N]): a small batch's pairs sorted by expert and
    counted in one Triton program (passes.route_kernel; `ops.route` says what it takes)."""
    N = ids_TK.numel()
    device = ids_TK.device
    order_N = torch.empty(N, dtype=torch.int32, device=device)
    counts_E = torch.empty(E, dtype=torch.int32, device=device)
    weights_N = torch.empty(N, dtype=weights_TK.dtype if weights_TK is not None else dtype, device=device)
    passes.route_kernel[(1,)](ids_TK.reshape(-1), weights_TK.reshape(-1) if weights_TK is not None else weights_N,
                              order_N, counts_E, weights_N, N, E, WEIGHTED=weights_TK is not None,
                              BLOCK_N=max(16, next_power_of_2(N)), BLOCK_E=block_e(E),
                              RANKED=route_ranks(device))
    return order_N, counts_E, weights_N


def route_ranks(device: torch.device) -> bool:
    """Whether passes.route_kernel orders the pairs by counting ranks rather than with tl.sort: off a GPU,
    in Triton's CPU interpreter (its RANKED flag)."""
    return device.type != "cuda"
