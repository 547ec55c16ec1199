"""Triton kernels for the routed-expert MLP: grouped GEMMs over rows sorted by expert.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K routed rows (or the received rows under expert parallelism), in expert order.
Row r of the sorted order is the flat (token-major) pair `order_N[r]`; its token is `order_N[r] // K`.
In the row kernels M is a tile's BLOCK_M rows and S the up to BLOCK_M / 2 tail rows it may carry.

Four kernels cover forward and backward (`rows.py` chains them):

    up_kernel        h_NI = act(x[tok] @ Wg[e].T) * (x[tok] @ Wu[e].T)   gather fused into the A load,
                      gate/up activation fused into the epilogue; optionally keeps gu_N2I for backward.
    rows_kernel      c[dst] = w * (a_NK @ B[e].T)                         a plain grouped GEMM whose
                      epilogue multiplies by the routing weight and un-permutes (scatter to the flat row).
                      Forward down projection and the backward dX = dgu @ Wgu[e].
    act_bwd_kernel   dhu = dy[tok] @ Wd[e]; epilogue: d routing weight partials <dhu, h>, and
                      dgu = d(act(g) * u) for dh = w * dhu, written in the weight's gate/up layout.
    wgrad_kernel     dW[e] = A_e.T @ B_e over expert e's rows                weight gradients, over rows
                      the backward gathered into expert order once (dy, x) and w * h from act_bwd_kernel.

The memory-bound passes around torch's grouped GEMM (the Hopper path) and the one-program sort of
small batches are in passes.py, the decode kernels (one token, no sort) in pairs.py.

Row tiles are scheduled without a host sync (row_tiles.py): every program reads counts_E (E <= a few
hundred) and finds its expert from the running sum of tiles per expert. With TAIL (a config flag) an
expert's last tile also takes up to BLOCK_M / 2 rows past BLOCK_M (the S rows below), multiplied against
the same loaded weight tiles, instead of leaving them a nearly empty tile of their own.

The kernels use only portable Triton (tl.dot, masked loads and stores): no tensor-memory
descriptors, no warp specialization. On Hopper Triton lowers tl.dot to wgmma by itself; on Ada and
Blackwell consumer parts (sm_89, sm_120) to mma.sync.

The row counts (n_rows, M, T, N) are not specialized (`do_not_specialize`): Triton would otherwise
compile a kernel again for a count that is 1 or a multiple of 16, seconds of compilation that a
server meets as requests of new lengths arrive. They only bound masks and tile loops. `m_class` and
`m_fill` are not read at all: they are the autotuner's key of rows per expert (tiles.py), and `m_fill`
(0 to 2) is not specialized either, so that each key's value compiles the same kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act import act, act_grad, dequant, gate_up_cols, weight_scales
from .row_tiles import row_tile_of_program, rows_in

__all__ = ["act_bwd_kernel", "rows_kernel", "rows_store", "token_row_ptrs", "up_kernel", "up_store", "wgrad_kernel"]


@triton.jit
def _fp8_dot(a, b, acc, BLOCK_K: tl.constexpr):
    """acc + a @ b for FP8 a and b, the chunk's products summed apart and added to acc in float32: on
    Hopper, FP8 tensor cores keep fewer accumulator bits, and Triton's default there adds every chunk
    into acc at that precision (docs/BENCHMARKS.md, "W8A8 FP8 experts"). Elsewhere the same precise sum."""
    return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def _dot_k(a_ptrs, s_ptrs, b_ptrs, row_ok_M, row_ok_S, col_ok_N, K, stride_bk, bs_ptrs, stride_bsk,
           PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, WITH_TAIL: tl.constexpr, SCALED: tl.constexpr, SCALE_K: tl.constexpr,
           A_FP8: tl.constexpr = False):
    """sum over k < K of A[m, k] * B[k, n]: a_ptrs [BLOCK_M, BLOCK_K] (unit stride along k), b_ptrs
    [BLOCK_K, BLOCK_N] (stride_bk along k), both at k = 0. Masked rows and columns read zeros.
    WITH_TAIL: also the tail's [S = BLOCK_M / 2] rows at s_ptrs, against the same loaded B tiles.
    SCALED: B is FP8, each column's scale for k in [k0, k0 + BLOCK_K) at bs_ptrs [BLOCK_N] + (k0 //
    SCALE_K) * stride_bsk (BLOCK_K divides SCALE_K), tiles dequantized to A's dtype; SCALE_K 0: one scale
    per column across all of k, the FP8 values (exact in A's dtype) multiplied and the sums scaled.
    A_FP8 (with SCALED): A is FP8 too, and FP8 tiles enter the products as they are (FP8 tensor cores);
    with scale blocks along k each chunk's sum is scaled. A's row scales are the caller's.
    Returns (acc_MN, acc_SN); acc_SN is zeros without the tail."""
    k_K = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_s = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok_M[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok_N[None, :], other=0.0)
            if WITH_TAIL:
                s = tl.load(s_ptrs, mask=row_ok_S[:, None], other=0.0)
        else:
            k_ok_K = k_K < K - k0
            a = tl.load(a_ptrs, mask=row_ok_M[:, None] & k_ok_K[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok_K[:, None] & col_ok_N[None, :], other=0.0)
            if WITH_TAIL:
                s = tl.load(s_ptrs, mask=row_ok_S[:, None] & k_ok_K[None, :], other=0.0)
        if A_FP8 and SCALE_K > 0:  # FP8 products, each chunk's sum times its columns' scales
            chunk_N = tl.load(bs_ptrs + (k0 // SCALE_K) * stride_bsk, mask=col_ok_N, other=0.0)[None, :]
            acc += tl.dot(a, b) * chunk_N
            if WITH_TAIL:
                acc_s += tl.dot(s, b) * chunk_N
        elif A_FP8:  # FP8 products, the scales at the end
            acc = _fp8_dot(a, b, acc, BLOCK_K)
            if WITH_TAIL:
                acc_s = _fp8_dot(s, b, acc_s, BLOCK_K)
        else:
            if SCALED and SCALE_K > 0:  # scale blocks along k: each tile scaled and rounded to A's dtype
                b = dequant(b, tl.load(bs_ptrs + (k0 // SCALE_K) * stride_bsk, mask=col_ok_N, other=0.0)[None, :],
                             a.dtype)
            elif SCALED:  # one scale across each row: exact FP8 values in the product, the scale at the end
                b = b.to(a.dtype)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if WITH_TAIL:
                acc_s = tl.dot(s, b, acc_s, input_precision=PRECISION)
        if WITH_TAIL:
            s_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if SCALED and SCALE_K == 0:
        scale_N = tl.load(bs_ptrs, mask=col_ok_N, other=0.0)[None, :]
        acc, acc_s = acc * scale_N, acc_s * scale_N
    return acc, acc_s


@triton.jit
def _dot_gate_up(a_ptrs, s_ptrs, g_ptrs, u_ptrs, row_ok_M, row_ok_S, col_ok_N, D, gs_ptrs, us_ptrs, stride_bsk,
                 PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, WITH_TAIL: tl.constexpr, SCALED: tl.constexpr, SCALE_K: tl.constexpr,
                 A_FP8: tl.constexpr = False):
    """_dot_k for the gate and the up halves at once (g_ptrs, u_ptrs: [BLOCK_K, BLOCK_N], unit stride
    along k; SCALED, A_FP8: their columns' scales at gs_ptrs, us_ptrs, as in _dot_k): (acc_g_MN,
    acc_u_MN, acc_g_SN, acc_u_SN)."""
    k_K = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tail_g = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
    tail_u = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok_M[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=col_ok_N[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=col_ok_N[None, :], other=0.0)
            if WITH_TAIL:
                s = tl.load(s_ptrs, mask=row_ok_S[:, None], other=0.0)
        else:
            k_ok_K = k_K < D - k0
            a = tl.load(a_ptrs, mask=row_ok_M[:, None] & k_ok_K[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok_K[:, None] & col_ok_N[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok_K[:, None] & col_ok_N[None, :], other=0.0)
            if WITH_TAIL:
                s = tl.load(s_ptrs, mask=row_ok_S[:, None] & k_ok_K[None, :], other=0.0)
        if A_FP8 and SCALE_K > 0:  # FP8 products, each chunk's sums times their columns' scales
            scale_at = (k0 // SCALE_K) * stride_bsk
            chunk_g = tl.load(gs_ptrs + scale_at, mask=col_ok_N, other=0.0)[None, :]
            chunk_u = tl.load(us_ptrs + scale_at, mask=col_ok_N, other=0.0)[None, :]
            acc_g += tl.dot(a, bg) * chunk_g
            acc_u += tl.dot(a, bu) * chunk_u
            if WITH_TAIL:
                tail_g += tl.dot(s, bg) * chunk_g
                tail_u += tl.dot(s, bu) * chunk_u
        elif A_FP8:  # FP8 products, the scales at the end
            acc_g = _fp8_dot(a, bg, acc_g, BLOCK_K)
            acc_u = _fp8_dot(a, bu, acc_u, BLOCK_K)
            if WITH_TAIL:
                tail_g = _fp8_dot(s, bg, tail_g, BLOCK_K)
                tail_u = _fp8_dot(s, bu, tail_u, BLOCK_K)
        else:
            if SCALED and SCALE_K > 0:
                scale_at = (k0 // SCALE_K) * stride_bsk
                bg = dequant(bg, tl.load(gs_ptrs + scale_at, mask=col_ok_N, other=0.0)[None, :], a.dtype)
                bu = dequant(bu, tl.load(us_ptrs + scale_at, mask=col_ok_N, other=0.0)[None, :], a.dtype)
            elif SCALED:
                bg, bu = bg.to(a.dtype), bu.to(a.dtype)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
            if WITH_TAIL:
                tail_g = tl.dot(s, bg, tail_g, input_precision=PRECISION)
                tail_u = tl.dot(s, bu, tail_u, input_precision=PRECISION)
        if WITH_TAIL:
            s_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALED and SCALE_K == 0:
        scale_g = tl.load(gs_ptrs, mask=col_ok_N, other=0.0)[None, :]
        scale_u = tl.load(us_ptrs, mask=col_ok_N, other=0.0)[None, :]
        acc_g, acc_u, tail_g, tail_u = acc_g * scale_g, acc_u * scale_u, tail_g * scale_g, tail_u * scale_u
    return acc_g, acc_u, tail_g, tail_u


@triton.jit
def _source_rows(rows, row_ok, order_ptr, top_k, GATHER: tl.constexpr):
    """The source row of each sorted row: its token order[r] // top_k (GATHER), else the row itself
    (masked rows: row 0)."""
    if GATHER:
        return tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k
    else:
        return tl.where(row_ok, rows, 0)


@triton.jit
def token_row_ptrs(base_ptr, rows, row_ok, order_ptr, top_k, stride, k_K, GATHER: tl.constexpr):
    """[rows, BLOCK_K] pointers at k = 0 into the source row of each sorted row (_source_rows)."""
    src = _source_rows(rows, row_ok, order_ptr, top_k, GATHER)
    return base_ptr + src.to(tl.int64)[:, None] * stride + k_K[None, :]


@triton.jit
def _row_scales(as_ptr, rows, row_ok, order_ptr, top_k, GATHER: tl.constexpr, A_FP8: tl.constexpr):
    """[rows, 1] float32: the FP8 input's scale of each sorted row's source row (A_FP8), else 1."""
    if A_FP8:
        src = _source_rows(rows, row_ok, order_ptr, top_k, GATHER)
        return tl.load(as_ptr + src, mask=row_ok, other=0.0)[:, None]
    else:
        return 1.0


@triton.jit
def up_store(acc_g, acc_u, rows, row_ok, cols_N, col_ok_N, gate_N, up_N, h_ptr, gu_ptr, stride_hm, stride_gm,
              ACT: tl.constexpr, SAVE_GU: tl.constexpr):
    """up_kernel's epilogue for one block of rows: gu (SAVE_GU) and h = act(g) * u."""
    out_ok = row_ok[:, None] & col_ok_N[None, :]
    rows64 = rows.to(tl.int64)
    if SAVE_GU:
        gu_dtype = gu_ptr.dtype.element_ty
        g_lo = acc_g.to(gu_dtype)
        u_lo = acc_u.to(gu_dtype)
        tl.store(gu_ptr + rows64[:, None] * stride_gm + gate_N[None, :], g_lo, mask=out_ok)
        tl.store(gu_ptr + rows64[:, None] * stride_gm + up_N[None, :], u_lo, mask=out_ok)
        # Backward recomputes h from the rounded g and u: use the same values here.
        acc_g = g_lo.to(tl.float32)
        acc_u = u_lo.to(tl.float32)
    h = act(acc_g, ACT) * acc_u
    tl.store(h_ptr + rows64[:, None] * stride_hm + cols_N[None, :], h.to(h_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["n_rows", "m_fill"])
def up_kernel(
    x_ptr, w_ptr, h_ptr, gu_ptr, order_ptr, counts_ptr, ws_ptr, xs_ptr,
    n_rows, I, D, E, top_k,
    stride_xm, stride_we, stride_wn, stride_hm, stride_gm, stride_wse, stride_wsn, stride_wsk,
    m_class, m_fill,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, GATHER: tl.constexpr, SAVE_GU: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, TAIL: tl.constexpr,
    SCALED: tl.constexpr = False, SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1,
    A_FP8: tl.constexpr = False,
):
    """h[r, c] = act(x[src(r)] . Wgu[e, gate(c)]) * (x[src(r)] . Wgu[e, up(c)]) for c < I.

    x: [*, D] (row stride stride_xm, unit column stride). Wgu: [E, 2I, D] (unit stride along D).
    h: [N, I]; gu (SAVE_GU): [N, 2I] in the weight's gate/up layout.
    SCALED: Wgu is FP8 with float32 scales ws [E, 2I / SCALE_N, D / SCALE_K] (by strides; fp8.py).
    A_FP8 (with SCALED): x is FP8 too, row i standing for x[i] * xs[i] (fp8.quantize_rows).
    """
    expert, row0, tile_end, cols_N, col_ok_N, pid_n = row_tile_of_program(
        n_rows, I, counts_ptr, E, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M, TAIL)
    if expert >= E:
        return
    rows_M, row_ok_M = rows_in(row0, tile_end, BLOCK_M)
    gate_N, up_N = gate_up_cols(cols_N, I, INTERLEAVED)
    k_K = tl.arange(0, BLOCK_K)
    a_ptrs = token_row_ptrs(x_ptr, rows_M, row_ok_M, order_ptr, top_k, stride_xm, k_K, GATHER)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + gate_N.to(tl.int64)[None, :] * stride_wn + k_K[:, None]
    u_ptrs = w_base + up_N.to(tl.int64)[None, :] * stride_wn + k_K[:, None]
    gs_ptrs = weight_scales(ws_ptr, expert, gate_N, stride_wse, stride_wsn, SCALE_N)
    us_ptrs = weight_scales(ws_ptr, expert, up_N, stride_wse, stride_wsn, SCALE_N)
    if TAIL:
        has_tail = tile_end > row0 + BLOCK_M
    else:
        has_tail: tl.constexpr = False  # a constant: the tail path below is not compiled
    if has_tail:
        rows_S, row_ok_S = rows_in(row0 + BLOCK_M, tile_end, BLOCK_M // 2)
        s_ptrs = token_row_ptrs(x_ptr, rows_S, row_ok_S, order_ptr, top_k, stride_xm, k_K, GATHER)
        acc_g, acc_u, tail_g, tail_u = _dot_gate_up(a_ptrs, s_ptrs, g_ptrs, u_ptrs, row_ok_M, row_ok_S, col_ok_N, D,
                                                    gs_ptrs, us_ptrs, stride_wsk, PRECISION, EVEN_K, BLOCK_M,
                                                    BLOCK_N, BLOCK_K, True, SCALED, SCALE_K, A_FP8)
        tail_s = _row_scales(xs_ptr, rows_S, row_ok_S, order_ptr, top_k, GATHER, A_FP8)
        tail_g, tail_u = tail_g * tail_s, tail_u * tail_s
        up_store(tail_g, tail_u, rows_S, row_ok_S, cols_N, col_ok_N, gate_N, up_N, h_ptr, gu_ptr, stride_hm,
                  stride_gm, ACT, SAVE_GU)
    else:
        acc_g, acc_u, _, _ = _dot_gate_up(a_ptrs, a_ptrs, g_ptrs, u_ptrs, row_ok_M, row_ok_M, col_ok_N, D,
                                          gs_ptrs, us_ptrs, stride_wsk, PRECISION, EVEN_K, BLOCK_M, BLOCK_N,
                                          BLOCK_K, False, SCALED, SCALE_K, A_FP8)
    row_s = _row_scales(xs_ptr, rows_M, row_ok_M, order_ptr, top_k, GATHER, A_FP8)
    acc_g, acc_u = acc_g * row_s, acc_u * row_s
    up_store(acc_g, acc_u, rows_M, row_ok_M, cols_N, col_ok_N, gate_N, up_N, h_ptr, gu_ptr, stride_hm, stride_gm,
              ACT, SAVE_GU)


@triton.jit
def rows_store(acc, rows, row_ok, cols_N, col_ok_N, c_ptr, order_ptr, weight_ptr, stride_cm,
                SCATTER: tl.constexpr, WEIGHTED: tl.constexpr):
    """rows_kernel's epilogue for one block of rows: weight, un-permute, store."""
    if SCATTER or WEIGHTED:
        flat = tl.load(order_ptr + rows, mask=row_ok, other=0)
    if WEIGHTED:
        acc = acc * tl.load(weight_ptr + flat, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ok = row_ok[:, None] & col_ok_N[None, :]
    if SCATTER:
        dst = flat.to(tl.int64)
    else:
        dst = rows.to(tl.int64)
    tl.store(c_ptr + dst[:, None] * stride_cm + cols_N[None, :], acc.to(c_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["n_rows", "m_fill"])
def rows_kernel(
    a_ptr, b_ptr, c_ptr, order_ptr, weight_ptr, counts_ptr, bs_ptr, as_ptr,
    n_rows, N, K, E,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_bse, stride_bsn, stride_bsk,
    m_class, m_fill,
    SCATTER: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, TAIL: tl.constexpr,
    SCALED: tl.constexpr = False, SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1,
    A_FP8: tl.constexpr = False,
):
    """c[dst(r), n] = w(r) * sum_k a[r, k] * B[e(r), n, k].

    a: [N_rows, K] sorted by expert (unit column stride). B: [E, N, K] by strides.
    dst(r) = order[r] (SCATTER, un-permute to the flat pair) else r. w(r) = weight[order[r]] (WEIGHTED).
    SCALED: B is FP8 with float32 scales bs [E, N / SCALE_N, K / SCALE_K] (by strides; fp8.py).
    A_FP8 (with SCALED): a is FP8 too, row r standing for a[r] * as[r] (fp8.quantize_rows).
    """
    expert, row0, tile_end, cols_N, col_ok_N, pid_n = row_tile_of_program(
        n_rows, N, counts_ptr, E, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M, TAIL)
    if expert >= E:
        return
    rows_M, row_ok_M = rows_in(row0, tile_end, BLOCK_M)
    k_K = tl.arange(0, BLOCK_K)
    a_ptrs = token_row_ptrs(a_ptr, rows_M, row_ok_M, order_ptr, 1, stride_am, k_K, False)
    b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be + cols_N.to(tl.int64)[None, :] * stride_bn
              + k_K[:, None] * stride_bk)
    bs_ptrs = weight_scales(bs_ptr, expert, cols_N, stride_bse, stride_bsn, SCALE_N)
    if TAIL:
        has_tail = tile_end > row0 + BLOCK_M
    else:
        has_tail: tl.constexpr = False  # a constant: the tail path below is not compiled
    if has_tail:
        rows_S, row_ok_S = rows_in(row0 + BLOCK_M, tile_end, BLOCK_M // 2)
        s_ptrs = token_row_ptrs(a_ptr, rows_S, row_ok_S, order_ptr, 1, stride_am, k_K, False)
        acc, acc_s = _dot_k(a_ptrs, s_ptrs, b_ptrs, row_ok_M, row_ok_S, col_ok_N, K, stride_bk, bs_ptrs, stride_bsk,
                            PRECISION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, True, SCALED, SCALE_K, A_FP8)
        acc_s = acc_s * _row_scales(as_ptr, rows_S, row_ok_S, order_ptr, 1, False, A_FP8)
        rows_store(acc_s, rows_S, row_ok_S, cols_N, col_ok_N, c_ptr, order_ptr, weight_ptr, stride_cm, SCATTER,
                    WEIGHTED)
    else:
        acc, _ = _dot_k(a_ptrs, a_ptrs, b_ptrs, row_ok_M, row_ok_M, col_ok_N, K, stride_bk, bs_ptrs, stride_bsk,
                        PRECISION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, False, SCALED, SCALE_K, A_FP8)
    acc = acc * _row_scales(as_ptr, rows_M, row_ok_M, order_ptr, 1, False, A_FP8)
    rows_store(acc, rows_M, row_ok_M, cols_N, col_ok_N, c_ptr, order_ptr, weight_ptr, stride_cm, SCATTER, WEIGHTED)


@triton.jit
def _act_bwd_store(acc, rows, row_ok, cols_N, col_ok_N, pid_n, I, gu_ptr, dgu_ptr, dwp_ptr, hw_ptr, order_ptr,
                   weight_ptr, stride_gm, stride_dwp, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                   WEIGHTED: tl.constexpr):
    """act_bwd_kernel's epilogue for one block of rows, from its dhu."""
    gate_N, up_N = gate_up_cols(cols_N, I, INTERLEAVED)
    ok = row_ok[:, None] & col_ok_N[None, :]
    rows64 = rows.to(tl.int64)
    g = tl.load(gu_ptr + rows64[:, None] * stride_gm + gate_N[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows64[:, None] * stride_gm + up_N[None, :], mask=ok, other=0.0).to(tl.float32)
    act_g = act(g, ACT)
    if WEIGHTED:
        h = (act_g * u).to(gu_ptr.dtype.element_ty).to(tl.float32)  # h as the forward rounded it
        flat = tl.load(order_ptr + rows, mask=row_ok, other=0)  # the row's (token, slot) pair
        tl.store(dwp_ptr + flat.to(tl.int64) * stride_dwp + pid_n, tl.sum(acc * h, 1), mask=row_ok)
        w = tl.load(weight_ptr + flat, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
        tl.store(hw_ptr + rows64[:, None] * I + cols_N[None, :], (h * w[:, None]).to(hw_ptr.dtype.element_ty),
                 mask=ok)
    dgu_dtype = dgu_ptr.dtype.element_ty
    tl.store(dgu_ptr + rows64[:, None] * stride_gm + gate_N[None, :],
             (acc * u * act_grad(g, ACT)).to(dgu_dtype), mask=ok)
    tl.store(dgu_ptr + rows64[:, None] * stride_gm + up_N[None, :], (acc * act_g).to(dgu_dtype), mask=ok)


@triton.jit(do_not_specialize=["n_rows", "m_fill"])
def act_bwd_kernel(
    dy_ptr, w_ptr, gu_ptr, dgu_ptr, dwp_ptr, hw_ptr, order_ptr, weight_ptr, counts_ptr,
    n_rows, I, D, E, top_k,
    stride_dym, stride_we, stride_wd, stride_gm, stride_dwp,
    m_class, m_fill,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, TAIL: tl.constexpr,
):
    """dhu[r, c] = dy[src(r)] . Wd[e, :, c]; then with g, u = gu[r] and w = weight[order[r]]:
    dgu[r, gate(c)] = w * dhu * u * act'(g), dgu[r, up(c)] = w * dhu * act(g),
    dwp[order[r], pid_n] = sum over this tile's c of dhu * act(g) * u  (partial d routing weight, in the
    pairs' flat order),
    hw[r, c] = w * h (WEIGHTED: the down projection's weight gradient is then dy[tok].T @ hw, with no
    weighted copy of dy).

    dy: [*, D] (gathered by token when GATHER). Wd: [E, D, I] (unit stride along I). gu, dgu: [N, 2I].
    hw: [N, I].
    """
    expert, row0, tile_end, cols_N, col_ok_N, pid_n = row_tile_of_program(
        n_rows, I, counts_ptr, E, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M, TAIL)
    if expert >= E:
        return
    rows_M, row_ok_M = rows_in(row0, tile_end, BLOCK_M)
    k_K = tl.arange(0, BLOCK_K)
    a_ptrs = token_row_ptrs(dy_ptr, rows_M, row_ok_M, order_ptr, top_k, stride_dym, k_K, GATHER)
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols_N[None, :] + k_K.to(tl.int64)[:, None] * stride_wd
    if TAIL:
        has_tail = tile_end > row0 + BLOCK_M
    else:
        has_tail: tl.constexpr = False  # a constant: the tail path below is not compiled
    if has_tail:
        rows_S, row_ok_S = rows_in(row0 + BLOCK_M, tile_end, BLOCK_M // 2)
        s_ptrs = token_row_ptrs(dy_ptr, rows_S, row_ok_S, order_ptr, top_k, stride_dym, k_K, GATHER)
        acc, acc_s = _dot_k(a_ptrs, s_ptrs, b_ptrs, row_ok_M, row_ok_S, col_ok_N, D, stride_wd, b_ptrs, 0, PRECISION,
                            EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, True, False, 1)
        _act_bwd_store(acc_s, rows_S, row_ok_S, cols_N, col_ok_N, pid_n, I, gu_ptr, dgu_ptr, dwp_ptr, hw_ptr,
                       order_ptr, weight_ptr, stride_gm, stride_dwp, ACT, INTERLEAVED, WEIGHTED)
    else:
        acc, _ = _dot_k(a_ptrs, a_ptrs, b_ptrs, row_ok_M, row_ok_M, col_ok_N, D, stride_wd, b_ptrs, 0, PRECISION,
                        EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, False, False, 1)
    _act_bwd_store(acc, rows_M, row_ok_M, cols_N, col_ok_N, pid_n, I, gu_ptr, dgu_ptr, dwp_ptr, hw_ptr, order_ptr,
                   weight_ptr, stride_gm, stride_dwp, ACT, INTERLEAVED, WEIGHTED)


@triton.jit(do_not_specialize=["M", "R", "m_fill"])
def wgrad_kernel(
    a_ptr, b_ptr, c_ptr, counts_ptr,
    M, N, E, R,
    stride_am, stride_bm, stride_ce, stride_cm,
    m_class, m_fill,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c[e, m, n] = sum over expert e's rows r of A[r, m] * B[r, n].

    A: [R, M], B: [R, N] (unit column strides), rows in expert order. c: [E, M, N] (unit stride along
    N). Experts with no rows get zeros; counts are taken as at least 0, and rows past R are not read. The
    backward gathers token rows into expert order once before it (rows.py): an index load in front of
    every row load would slow the kernel (docs/BENCHMARKS.md, "Weight gradients over pre-gathered
    rows").

    One program owns (expert, BLOCK_M rows of c) and walks every column tile in one flattened loop
    over (column tile, chunk of BLOCK_K rows): experts often have few rows, and a loop per tile
    would be all prologue; flattened, the loads of the next tile overlap the current one.
    """
    expert = tl.program_id(1)
    pid_m = tl.program_id(0)
    e_E = tl.arange(0, BLOCK_E)
    counts_E = tl.maximum(tl.load(counts_ptr + e_E, mask=e_E < E, other=0).to(tl.int32), 0)
    row0 = tl.sum(tl.where(e_E < expert, counts_E, 0), 0)
    row_end = tl.minimum(row0 + tl.sum(tl.where(e_E == expert, counts_E, 0), 0), R)
    chunks = tl.maximum(tl.cdiv(row_end - row0, BLOCK_K), 1)  # >= 1: an expert without rows stores zeros
    n_tiles = tl.cdiv(N, BLOCK_N)
    ms_M = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok_M = ms_M < M
    k_K = tl.arange(0, BLOCK_K)
    c_base = c_ptr + expert.to(tl.int64) * stride_ce + ms_M.to(tl.int64)[:, None] * stride_cm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, n_tiles * chunks):
        tile = it // chunks
        chunk = it - tile * chunks
        rows_K = row0 + chunk * BLOCK_K + k_K
        ok_K = rows_K < row_end
        ns_N = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok_N = ns_N < N
        rows64_K = tl.where(ok_K, rows_K, 0).to(tl.int64)
        a = tl.load(a_ptr + rows64_K[None, :] * stride_am + ms_M[:, None], mask=m_ok_M[:, None] & ok_K[None, :],
                    other=0.0)
        b = tl.load(b_ptr + rows64_K[:, None] * stride_bm + ns_N[None, :], mask=ok_K[:, None] & n_ok_N[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if chunk == chunks - 1:
            tl.store(c_base + ns_N[None, :], acc.to(c_ptr.dtype.element_ty), mask=m_ok_M[:, None] & n_ok_N[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
