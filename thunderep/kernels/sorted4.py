"""Prompt kernels on 4-bit expert weights (int4.py): moe_triton.py's sorted-row kernels reading packed tiles.

Shape legend as in moe_triton.py: rows sorted by expert, BLOCK_M rows x BLOCK_N columns per program, chunks
of BLOCK_K along k. A weight chunk is BLOCK_K / 2 packed bytes per column (two values a byte, low nibble
first), so each byte holds the weights of columns k0 + 2i (low) and k0 + 2i + 1 (high):

    up4_kernel     h[r, c] = act(x[src(r)] . Wg[e, gate(c)]) * (x[src(r)] . Wu[e, up(c)])
    rows4_kernel   c[dst(r), n] = w(r) * sum_k a[r, k] * W[e(r), n, k]

Each chunk's bytes are converted in registers (codes4.py: exact, no integer-to-float instruction), scaled
by their group's scale (minus the zero point: compressed-tensors' asymmetric int4) in float32 and rounded
to the products' dtype, as `Int4Weight.dequantize` writes them: the low nibbles as the tile of the even
columns, the high as the odd. The activation chunk is split in registers into its even and odd columns,
and the chunk's product is two tensor-core products of half the depth into one float32 sum. No 16-bit copy
of the weights exists. Inference only (no saved gate/up rows, no backward); no tail rows (configs with
TAIL are pruned, tiles.prune_packed). The launches are in sorted_mlp.py (`up`, `rows`); ops.py chooses
them over dequantizing the layer's experts for the 16-bit kernels by rows per expert (`paths.sorted4_packed`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act import gate_up_cols
from .codes4 import nibbles4, scales4
from .moe_triton import rows_store, token_row_ptrs, up_store
from .row_tiles import row_tile_of_program, rows_in

__all__ = ["rows4_kernel", "up4_kernel"]


@triton.jit
def _packed_tile(w_ptrs, s_ptrs_N, z_ptrs_N, k0, K, col_ok_N, stride_sk, DT: tl.constexpr, GROUP: tl.constexpr,
                 MXFP4: tl.constexpr, ZERO: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights of columns k0 + 2i (low nibbles) and k0 + 2i + 1 (high) as two [BLOCK_K / 2, BLOCK_N] tiles
    in DT, 0 in columns not col_ok_N (past K: finite, where the activation chunk is 0). w_ptrs: the chunk's
    bytes [BLOCK_K / 2, BLOCK_N]; s_ptrs_N, z_ptrs_N: each column's scales and zero points at group 0 (GROUP
    even: a byte's two values share one), loaded once per group where groups tile the chunk."""
    i_H = tl.arange(0, BLOCK_K // 2)
    if EVEN_K:
        ok = col_ok_N[None, :] & (i_H >= 0)[:, None]
    else:
        ok = col_ok_N[None, :] & (i_H < (K - k0) // 2)[:, None]
    lo, hi = nibbles4(tl.load(w_ptrs, mask=ok, other=0).to(tl.int32), MXFP4)
    if (BLOCK_K % GROUP == 0) and (GROUP & (GROUP - 1) == 0):  # whole groups: one load per group and column
        g_G = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        ok_G = col_ok_N[None, :] & (g_G * GROUP < K)[:, None]
        off_G = g_G.to(tl.int64)[:, None] * stride_sk
        scale = _over_group(scales4(s_ptrs_N[None, :] + off_G, ok_G, MXFP4), GROUP // 2)
        if ZERO:
            zero = _over_group(tl.load(z_ptrs_N[None, :] + off_G, mask=ok_G, other=0).to(tl.float32), GROUP // 2)
    elif GROUP % BLOCK_K == 0:  # the chunk lies inside one group: one load per column
        off = (k0 // GROUP) * stride_sk
        scale = scales4(s_ptrs_N + off, col_ok_N, MXFP4)[None, :]
        if ZERO:
            zero = tl.load(z_ptrs_N + off, mask=col_ok_N, other=0).to(tl.float32)[None, :]
    else:  # groups that do not tile the chunk: a load per byte
        g_H = ((k0 + 2 * i_H) // GROUP).to(tl.int64)[:, None] * stride_sk
        scale = scales4(s_ptrs_N[None, :] + g_H, ok, MXFP4)
        if ZERO:
            zero = tl.load(z_ptrs_N[None, :] + g_H, mask=ok, other=0).to(tl.float32)
    if ZERO:
        lo, hi = lo - zero, hi - zero
    return (lo * scale).to(DT), (hi * scale).to(DT)


@triton.jit
def _over_group(t_GN, REP: tl.constexpr):
    """[G, N] per-group values as [G * REP, N]: each group's row repeated over its REP bytes."""
    G: tl.constexpr = t_GN.shape[0]
    N: tl.constexpr = t_GN.shape[1]
    return tl.reshape(tl.broadcast_to(t_GN[:, None, :], (G, REP, N)), (G * REP, N))


@triton.jit
def _halves(a, BLOCK_K: tl.constexpr):
    """A [rows, BLOCK_K] chunk as its even and odd columns, two [rows, BLOCK_K / 2] tiles."""
    return tl.split(tl.reshape(a, (a.shape[0], BLOCK_K // 2, 2)))


@triton.jit
def _load_chunk(a_ptrs, row_ok_M, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activation chunk at k0: [rows, BLOCK_K], zeros past K and in rows not row_ok_M."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=row_ok_M[:, None], other=0.0)
    return tl.load(a_ptrs, mask=row_ok_M[:, None] & (tl.arange(0, BLOCK_K) < K - k0)[None, :], other=0.0)


@triton.jit
def _chunk(a_ptrs, row_ok_M, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activation chunk at k0 (`_load_chunk`) as `_halves`."""
    return _halves(_load_chunk(a_ptrs, row_ok_M, k0, K, EVEN_K, BLOCK_K), BLOCK_K)


@triton.jit
def _dot_e2m1(acc_NM, a_ptrs, row_ok_M, w_ptrs_NH, s_ptrs_N, k0, K, col_ok_N, stride_sk, EVEN_K: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """acc_NM + W @ a.T over the chunk at k0 through tl.dot_scaled: W's e2m1 codes [BLOCK_N, BLOCK_K / 2] (two a
    byte, low nibble first, as stored) with their e8m0 scales [BLOCK_N, BLOCK_K / 32] on the left, the activation
    chunk [rows, BLOCK_K] on the right; [BLOCK_N, rows] float32 sums. Codes past K or in columns not col_ok_N
    are 0, their scales 1."""
    i_H = tl.arange(0, BLOCK_K // 2)
    g_G = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if EVEN_K:
        ok_NH = col_ok_N[:, None] & (i_H >= 0)[None, :]
    else:
        ok_NH = col_ok_N[:, None] & (i_H < (K - k0) // 2)[None, :]
    a = _load_chunk(a_ptrs, row_ok_M, k0, K, EVEN_K, BLOCK_K)
    w = tl.load(w_ptrs_NH, mask=ok_NH, other=0)
    ok_NG = col_ok_N[:, None] & (g_G * 32 < K)[None, :]
    s = tl.load(s_ptrs_N[:, None] + g_G.to(tl.int64)[None, :] * stride_sk, mask=ok_NG, other=127)
    FMT: tl.constexpr = "bf16" if a_ptrs.dtype.element_ty == tl.bfloat16 else "fp16"
    return tl.dot_scaled(w, s, "e2m1", tl.trans(a), None, FMT, acc_NM)


@triton.jit(do_not_specialize=["n_rows", "m_fill"])
def up4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, gu_ptr, order_ptr, counts_ptr,
    n_rows, I, D, E, top_k,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hm,
    m_class, m_fill,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, GATHER: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, TAIL: tl.constexpr,
    GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr, SCALED_DOT: tl.constexpr = False,
):
    """h[r, c] = act(x[src(r)] . Wg[e, gate(c)]) * (x[src(r)] . Wu[e, up(c)]) for c < I (moe_triton.up_kernel
    on packed weights). x: [*, D] (unit column stride); W: packed [E, 2I, D / 2] uint8 with scales (and
    zero points, ZERO) [E, 2I, ceil(D / GROUP)] by strides; h: [N, I]. gu_ptr: unused (no saved rows)."""
    expert, row0, tile_end, cols_N, col_ok_N, pid_n = row_tile_of_program(
        n_rows, I, counts_ptr, E, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M, TAIL)
    if expert >= E:
        return
    rows_M, row_ok_M = rows_in(row0, tile_end, BLOCK_M)
    gate_N, up_N = gate_up_cols(cols_N, I, INTERLEAVED)
    a_ptrs = token_row_ptrs(x_ptr, rows_M, row_ok_M, order_ptr, top_k, stride_xm, tl.arange(0, BLOCK_K), GATHER)
    e64 = expert.to(tl.int64)
    i_H = tl.arange(0, BLOCK_K // 2)
    g_ptrs = w_ptr + e64 * stride_we + gate_N.to(tl.int64)[None, :] * stride_wn + i_H[:, None]
    u_ptrs = w_ptr + e64 * stride_we + up_N.to(tl.int64)[None, :] * stride_wn + i_H[:, None]
    gs_N = e64 * stride_se + gate_N.to(tl.int64) * stride_sn
    us_N = e64 * stride_se + up_N.to(tl.int64) * stride_sn
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if SCALED_DOT:  # MXFP4 through tl.dot_scaled, the weights on the left: [BLOCK_N, BLOCK_M] sums
        g_NH = w_ptr + e64 * stride_we + gate_N.to(tl.int64)[:, None] * stride_wn + i_H[None, :]
        u_NH = w_ptr + e64 * stride_we + up_N.to(tl.int64)[:, None] * stride_wn + i_H[None, :]
        acc_gt = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_ut = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            acc_gt = _dot_e2m1(acc_gt, a_ptrs, row_ok_M, g_NH, s_ptr + gs_N, k0, D, col_ok_N, stride_sk, EVEN_K,
                               BLOCK_K)
            acc_ut = _dot_e2m1(acc_ut, a_ptrs, row_ok_M, u_NH, s_ptr + us_N, k0, D, col_ok_N, stride_sk, EVEN_K,
                               BLOCK_K)
            a_ptrs += BLOCK_K
            g_NH += BLOCK_K // 2
            u_NH += BLOCK_K // 2
        up_store(tl.trans(acc_gt), tl.trans(acc_ut), rows_M, row_ok_M, cols_N, col_ok_N, gate_N, up_N, h_ptr, gu_ptr,
                 stride_hm, 0, ACT, False)
        return
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a_even, a_odd = _chunk(a_ptrs, row_ok_M, k0, D, EVEN_K, BLOCK_K)
        g_even, g_odd = _packed_tile(g_ptrs, s_ptr + gs_N, z_ptr + gs_N, k0, D, col_ok_N, stride_sk, DT, GROUP,
                                     MXFP4, ZERO, EVEN_K, BLOCK_K)
        acc_g = tl.dot(a_even, g_even, acc_g, input_precision=PRECISION)
        acc_g = tl.dot(a_odd, g_odd, acc_g, input_precision=PRECISION)
        u_even, u_odd = _packed_tile(u_ptrs, s_ptr + us_N, z_ptr + us_N, k0, D, col_ok_N, stride_sk, DT, GROUP,
                                     MXFP4, ZERO, EVEN_K, BLOCK_K)
        acc_u = tl.dot(a_even, u_even, acc_u, input_precision=PRECISION)
        acc_u = tl.dot(a_odd, u_odd, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 2
        u_ptrs += BLOCK_K // 2
    up_store(acc_g, acc_u, rows_M, row_ok_M, cols_N, col_ok_N, gate_N, up_N, h_ptr, gu_ptr, stride_hm, 0, ACT, False)


@triton.jit(do_not_specialize=["n_rows", "m_fill"])
def rows4_kernel(
    a_ptr, b_ptr, s_ptr, z_ptr, c_ptr, order_ptr, weight_ptr, counts_ptr,
    n_rows, N, K, E,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_sk, stride_cm,
    m_class, m_fill,
    SCATTER: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, TAIL: tl.constexpr,
    GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr, SCALED_DOT: tl.constexpr = False,
):
    """c[dst(r), n] = w(r) * sum_k a[r, k] * W[e(r), n, k] (moe_triton.rows_kernel on packed weights). a:
    [N_rows, K] sorted by expert (unit column stride); W: packed [E, N, K / 2] uint8 with scales (and zero
    points) [E, N, ceil(K / GROUP)] by strides. dst and w as rows_kernel's (SCATTER, WEIGHTED)."""
    expert, row0, tile_end, cols_N, col_ok_N, pid_n = row_tile_of_program(
        n_rows, N, counts_ptr, E, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M, TAIL)
    if expert >= E:
        return
    rows_M, row_ok_M = rows_in(row0, tile_end, BLOCK_M)
    a_ptrs = token_row_ptrs(a_ptr, rows_M, row_ok_M, order_ptr, 1, stride_am, tl.arange(0, BLOCK_K), False)
    e64 = expert.to(tl.int64)
    b_ptrs = b_ptr + e64 * stride_be + cols_N.to(tl.int64)[None, :] * stride_bn + tl.arange(0, BLOCK_K // 2)[:, None]
    s_N = e64 * stride_se + cols_N.to(tl.int64) * stride_sn
    DT: tl.constexpr = a_ptr.dtype.element_ty
    if SCALED_DOT:  # MXFP4 through tl.dot_scaled, the weights on the left
        b_NH = b_ptr + e64 * stride_be + cols_N.to(tl.int64)[:, None] * stride_bn + tl.arange(0, BLOCK_K // 2)[None, :]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_t = _dot_e2m1(acc_t, a_ptrs, row_ok_M, b_NH, s_ptr + s_N, k0, K, col_ok_N, stride_sk, EVEN_K, BLOCK_K)
            a_ptrs += BLOCK_K
            b_NH += BLOCK_K // 2
        rows_store(tl.trans(acc_t), rows_M, row_ok_M, cols_N, col_ok_N, c_ptr, order_ptr, weight_ptr, stride_cm,
                   SCATTER, WEIGHTED)
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_even, a_odd = _chunk(a_ptrs, row_ok_M, k0, K, EVEN_K, BLOCK_K)
        b_even, b_odd = _packed_tile(b_ptrs, s_ptr + s_N, z_ptr + s_N, k0, K, col_ok_N, stride_sk, DT, GROUP, MXFP4,
                                     ZERO, EVEN_K, BLOCK_K)
        acc = tl.dot(a_even, b_even, acc, input_precision=PRECISION)
        acc = tl.dot(a_odd, b_odd, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
    rows_store(acc, rows_M, row_ok_M, cols_N, col_ok_N, c_ptr, order_ptr, weight_ptr, stride_cm, SCATTER, WEIGHTED)
