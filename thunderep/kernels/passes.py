"""Memory-bound Triton passes: the work around torch's grouped GEMM, and the sort of small batches.

Shape legend as in moe_triton.py: T tokens, D hidden size, K experts per token, E experts, I
intermediate size, N = T * K routed rows in expert order; row r is the flat pair `order[r]`.

Four passes serve the Hopper path (grouped_gemm.py), where torch's grouped GEMM (CUTLASS) runs the
GEMMs and cannot fuse gathers or epilogues; the gather also feeds both weight-gradient paths (rows.py):

    gather_kernel        x_rows[r] = x[order[r] // K]
    act_kernel           h = act(g) * u from the [N, 2I] gate/up GEMM output
    act_bwd_rows_kernel  dgu, d routing weight and w * h from dhu (the elementwise half of
                         moe_triton.act_bwd_kernel)
    combine_kernel       y[t] = sum over k of w[t, k] * rows[inv[t, k]]   (un-permute + sum over K)

And `route_kernel`, which sorts a small batch's pairs by expert and counts them in one launch
(rows.route), and `quantize_rows_kernel`, the FP8 inputs of the W8A8 kernels (fp8.py). Portable Triton
only; row counts are not specialized, as in moe_triton.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act import act, act_grad, gate_up_cols

__all__ = ["act_bwd_rows_kernel", "act_kernel", "combine_kernel", "gather_kernel", "quantize_rows_kernel",
           "route_kernel"]


@triton.jit(do_not_specialize=["n_rows"])
def gather_kernel(src_ptr, order_ptr, out_ptr, n_rows, D, top_k, stride_sm, stride_om,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = src[order[r] // top_k]: token rows in expert order, for GEMMs that cannot gather."""
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok_R = rows_R < n_rows
    src_R = (tl.load(order_ptr + rows_R, mask=row_ok_R, other=0) // top_k).to(tl.int64)
    ok = row_ok_R[:, None] & (d_D < D)[None, :]
    v = tl.load(src_ptr + src_R[:, None] * stride_sm + d_D[None, :], mask=ok)
    tl.store(out_ptr + rows_R.to(tl.int64)[:, None] * stride_om + d_D[None, :], v, mask=ok)


@triton.jit(do_not_specialize=["n_rows"])
def act_kernel(gu_ptr, h_ptr, n_rows, I, stride_gm, stride_hm,
                ACT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """h[r, c] = act(gu[r, gate(c)]) * gu[r, up(c)]: the gated activation of a [N, 2I] GEMM output."""
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols_C = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows_R < n_rows)[:, None] & (cols_C < I)[None, :]
    gate_C, up_C = gate_up_cols(cols_C, I, INTERLEAVED)
    base = gu_ptr + rows_R.to(tl.int64)[:, None] * stride_gm
    g = tl.load(base + gate_C[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(base + up_C[None, :], mask=ok, other=0.0).to(tl.float32)
    h = act(g, ACT) * u
    tl.store(h_ptr + rows_R.to(tl.int64)[:, None] * stride_hm + cols_C[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok)


@triton.jit(do_not_specialize=["n_rows"])
def act_bwd_rows_kernel(dhu_ptr, gu_ptr, dgu_ptr, dw_ptr, hw_ptr, order_ptr, weight_ptr, n_rows, I,
                         stride_dm, stride_gm,
                         ACT: tl.constexpr, INTERLEAVED: tl.constexpr, WEIGHTED: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The elementwise half of act_bwd_kernel, for an unweighted dhu = dy[tok] @ Wd[e] computed elsewhere:
    dgu[r, gate(c)] = w * dhu * u * act'(g), dgu[r, up(c)] = w * dhu * act(g), and (WEIGHTED) the routing
    weight's gradient dw[order[r]] = sum over c of dhu * h, h = act(g) * u as the forward rounded it, and
    hw[r, c] = w * h [N, I] for the down projection's weight gradient.
    One program walks all I columns of BLOCK_R rows, so the sum over c needs no second pass."""
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok_R = rows_R < n_rows
    rows64_R = rows_R.to(tl.int64)
    if WEIGHTED:
        flat_R = tl.load(order_ptr + rows_R, mask=row_ok_R, other=0)
        w_R = tl.load(weight_ptr + flat_R, mask=row_ok_R, other=0.0).to(tl.float32)
    dw_R = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_C):
        cols_C = c0 + tl.arange(0, BLOCK_C)
        ok = row_ok_R[:, None] & (cols_C < I)[None, :]
        gate_C, up_C = gate_up_cols(cols_C, I, INTERLEAVED)
        gu_base = gu_ptr + rows64_R[:, None] * stride_gm
        g = tl.load(gu_base + gate_C[None, :], mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_base + up_C[None, :], mask=ok, other=0.0).to(tl.float32)
        dhu = tl.load(dhu_ptr + rows64_R[:, None] * stride_dm + cols_C[None, :], mask=ok, other=0.0).to(tl.float32)
        act_g = act(g, ACT)
        if WEIGHTED:
            h = (act_g * u).to(gu_ptr.dtype.element_ty).to(tl.float32)
            dw_R += tl.sum(dhu * h, 1)
            dhu = dhu * w_R[:, None]
            tl.store(hw_ptr + rows64_R[:, None] * I + cols_C[None, :], (h * w_R[:, None]).to(hw_ptr.dtype.element_ty),
                     mask=ok)
        dgu_base = dgu_ptr + rows64_R[:, None] * stride_gm
        dgu_dtype = dgu_ptr.dtype.element_ty
        tl.store(dgu_base + gate_C[None, :], (dhu * u * act_grad(g, ACT)).to(dgu_dtype), mask=ok)
        tl.store(dgu_base + up_C[None, :], (dhu * act_g).to(dgu_dtype), mask=ok)
    if WEIGHTED:
        tl.store(dw_ptr + flat_R, dw_R, mask=row_ok_R)


@triton.jit(do_not_specialize=["T"])
def combine_kernel(rows_ptr, inv_ptr, weight_ptr, out_ptr, T, D, top_k, stride_rm, stride_om,
                    WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum over k of w[t, k] * rows[inv[t * top_k + k]] (w = 1 unless WEIGHTED), summed in fp32:
    the un-permute and the sum over each token's K expert rows in one pass."""
    t_T = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok_T = t_T < T
    ok = t_ok_T[:, None] & (d_D < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in range(0, top_k):
        flat_T = t_T * top_k + k
        src_T = tl.load(inv_ptr + flat_T, mask=t_ok_T, other=0).to(tl.int64)
        v = tl.load(rows_ptr + src_T[:, None] * stride_rm + d_D[None, :], mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(weight_ptr + flat_T, mask=t_ok_T, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + t_T.to(tl.int64)[:, None] * stride_om + d_D[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit(do_not_specialize=["N"])
def route_kernel(ids_ptr, weight_ptr, order_ptr, counts_ptr, w_out_ptr, N, E, WEIGHTED: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, RANKED: tl.constexpr = False):
    """One program sorts a small batch's N pairs by expert: order[r] = the flat pair of sorted row r
    (stable: pairs of one expert in flat order), counts[e] = pairs of expert e, and w_out[j] = the
    pair's routing weight (1 unless WEIGHTED). A pair whose id is outside [0, E) is computed as expert
    0 with weight 0 for id -1 (computed elsewhere: adds nothing, as in the pair kernels) and NaN for
    any other id (its token's output shows it). Replaces a radix sort, a scatter for the counts and
    their fills and copies (one launch against about six) where N fits one block.
    RANKED: each pair's sorted row is the number of smaller keys (a [BLOCK_N, BLOCK_N] comparison),
    for Triton's CPU interpreter, which runs tl.sort's bitonic network (a reduction per stage) in about
    a second a call; compiled, tl.sort takes microseconds, where the comparison would not fit."""
    i_N = tl.arange(0, BLOCK_N)
    ok_N = i_N < N
    raw_N = tl.load(ids_ptr + i_N, mask=ok_N, other=0)
    known_N = (raw_N >= 0) & (raw_N < E)
    e_N = tl.where(known_N, raw_N, 0).to(tl.int32)
    key_N = tl.where(ok_N, e_N, BLOCK_E) * BLOCK_N + i_N  # unique keys: a stable order; padding last
    if RANKED:
        rank_N = tl.sum((key_N[None, :] < key_N[:, None]).to(tl.int32), axis=1)
        tl.store(order_ptr + rank_N, i_N, mask=ok_N)
    else:
        tl.store(order_ptr + i_N, tl.sort(key_N) % BLOCK_N, mask=ok_N)
    e_E = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + e_E, tl.histogram(e_N, BLOCK_E, mask=ok_N), mask=e_E < E)
    if WEIGHTED:
        w_N = tl.load(weight_ptr + i_N, mask=ok_N, other=0.0).to(tl.float32)
    else:
        w_N = tl.full((BLOCK_N,), 1.0, tl.float32)
    w_N = tl.where(known_N, w_N, tl.where(raw_N == -1, 0.0, float("nan")))
    tl.store(w_out_ptr + i_N, w_N.to(w_out_ptr.dtype.element_ty), mask=ok_N)


@triton.jit(do_not_specialize=["n_rows"])
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_rows, C, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """One row per program: scale = amax / FP8_MAX (1 for a zero row), q = x / scale rounded to the
    nearest e4m3, both divisions rounded as IEEE's: the bits of fp8.quantize_rows. A first pass over
    the row finds amax, a second writes q (the row is read twice; the second read mostly hits L2)."""
    row = tl.program_id(0).to(tl.int64)
    c_C = tl.arange(0, BLOCK_C)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        v = tl.load(x_ptr + row * stride_xm + c0 + c_C, mask=c0 + c_C < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    top = tl.max(amax, 0)
    scale = tl.where(top > 0, tl.math.div_rn(top, FP8_MAX), 1.0)
    tl.store(s_ptr + row, scale)
    for c0 in range(0, C, BLOCK_C):
        ok = c0 + c_C < C
        v = tl.load(x_ptr + row * stride_xm + c0 + c_C, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + c0 + c_C, q.to(q_ptr.dtype.element_ty), mask=ok)
