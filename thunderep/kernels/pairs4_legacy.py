"""The 4-bit pair kernels as they were before the conversion in registers was reworked (pairs4.py):
each value converted on its own (an integer-to-float conversion per value, and for e2m1 shifts, selects and
a power of two), one byte at a time. Kept only so that `thunderep bench kernels` can time the old and the
new conversion side by side in one run (its `thunderep:int4-legacy` and `thunderep:mxfp4-legacy`
implementations, through `tiles.legacy_pairs4`); to be removed with them once that comparison is recorded.

Same launch arguments and results as pairs4.py's kernels; see its docstring for the shapes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act import act, gate_up_cols

__all__ = ["legacy_down_pairs4_kernel", "legacy_up_pairs4_kernel"]


@triton.jit
def legacy_codes4(n, MXFP4: tl.constexpr):
    """4-bit codes n (int32, 0..15) as float32: e2m1 values (sign bit 8; exponent bits 2..1; mantissa
    bit 0; exponent 0 subnormal), or int4's n - 8."""
    if MXFP4:
        e = (n >> 1) & 3
        m = (n & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
        v = tl.where(n >= 8, -mag, mag)
    else:
        v = (n - 8).to(tl.float32)
    return v


@triton.jit
def legacy_scales4(s_ptrs, ok, MXFP4: tl.constexpr):
    """The group scales at s_ptrs as float32 (0 where not ok): e8m0 exponents as 2 ** (s - 127) (built from
    the bits; s = 0 is 2 ** -127, a float32 subnormal), or int4's float scales."""
    if MXFP4:
        s = tl.load(s_ptrs, mask=ok, other=0).to(tl.int32)
        value = tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))
        value = tl.where(ok, value, 0.0)
    else:
        value = tl.load(s_ptrs, mask=ok, other=0.0).to(tl.float32)
    return value


@triton.jit
def legacy_packed_chunk(w_ptrs_N, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_even, v_odd, stride_sk, GROUP: tl.constexpr,
                 MXFP4: tl.constexpr, ZERO: tl.constexpr, HK: tl.constexpr):
    """[BLOCK_N] float32 sums of one chunk at column k0: each row's packed bytes from w_ptrs_N (its row's
    column 0), the two codes of each byte times the vector's even and odd elements (v_even, v_odd [HK],
    float32, zero past C), summed per group and times the group's scale (zero points: minus z times the
    group's sum of the vector). Both columns of a byte share a group (GROUP is even). A chunk of whole
    groups (BLOCK_K a multiple of GROUP, GROUP a power of two) loads one scale per group and row; a chunk
    inside one group one per row; anything else one per byte."""
    p_K = k0 // 2 + tl.arange(0, HK)
    ok = ok_N[:, None] & (p_K < C // 2)[None, :]
    b = tl.load(w_ptrs_N[:, None] + p_K[None, :], mask=ok, other=0).to(tl.int32)
    prod = legacy_codes4(b & 15, MXFP4) * v_even[None, :] + legacy_codes4(b >> 4, MXFP4) * v_odd[None, :]
    HG: tl.constexpr = GROUP // 2
    if (HK % HG == 0) and ((HG & (HG - 1)) == 0):  # whole groups: [BLOCK_N, NG, HG]
        NG: tl.constexpr = HK // HG
        BLOCK_N: tl.constexpr = prod.shape[0]
        g_G = k0 // GROUP + tl.arange(0, NG)
        ok_G = ok_N[:, None] & (g_G * GROUP < C)[None, :]
        g_off = g_G.to(tl.int64)[None, :] * stride_sk
        sums = tl.sum(tl.reshape(prod, (BLOCK_N, NG, HG)), 2)
        if ZERO:
            vsum = tl.sum(tl.reshape(v_even + v_odd, (NG, HG)), 1)
            sums -= tl.load(z_ptrs_N[:, None] + g_off, mask=ok_G, other=0).to(tl.float32) * vsum[None, :]
        return tl.sum(sums * legacy_scales4(s_ptrs_N[:, None] + g_off, ok_G, MXFP4), 1)
    elif HG % HK == 0:  # the chunk lies inside one group (k0 is a multiple of BLOCK_K, which divides GROUP)
        g_off = (k0 // GROUP) * stride_sk  # a group index within one row: no overflow
        ok_1 = ok_N  # k0 < C: the loops start chunks inside the row
        sums = tl.sum(prod, 1)
        if ZERO:
            sums -= tl.load(z_ptrs_N + g_off, mask=ok_1, other=0).to(tl.float32) * tl.sum(v_even + v_odd, 0)
        return sums * legacy_scales4(s_ptrs_N + g_off, ok_1, MXFP4)
    else:  # a scale per byte
        g_K = (2 * p_K // GROUP).to(tl.int64) * stride_sk
        scale = legacy_scales4(s_ptrs_N[:, None] + g_K[None, :], ok, MXFP4)
        if ZERO:
            z = tl.load(z_ptrs_N[:, None] + g_K[None, :], mask=ok, other=0).to(tl.float32)
            prod -= z * (v_even + v_odd)[None, :]
        return tl.sum(prod * scale, 1)


@triton.jit
def legacy_even_odd(v_ptr, k0, C, HK: tl.constexpr):
    """(even, odd) elements [HK] of the vector's chunk at column k0, float32, zero past C."""
    c_K = k0 + 2 * tl.arange(0, HK)
    even = tl.load(v_ptr + c_K, mask=c_K < C, other=0.0).to(tl.float32)
    odd = tl.load(v_ptr + c_K + 1, mask=c_K + 1 < C, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def legacy_up_pairs4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, ids_ptr, I, D, E, top_k, stride_xm, stride_we,
                            stride_wn, stride_se, stride_sn, stride_sk, stride_hm, ACT: tl.constexpr,
                            INTERLEAVED: tl.constexpr, GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[j, c] = act(x[j // K] . Wg[ids[j], gate(c)]) * (x[j // K] . Wu[ids[j], up(c)]) for pair j =
    program_id(0), columns c of tile program_id(1). x: [T, D]; W: packed [E, 2I, D / 2] uint8 with scales
    (and zero points, ZERO) [E, 2I, ceil(D / GROUP)] by strides; h: [T*K, I]."""
    j = tl.program_id(0)
    cols_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + j).to(tl.int64)
    known = (expert >= 0) & (expert < E)
    skipped = expert == -1
    expert = tl.where(known, expert, 0)
    ok_N = cols_N < tl.where(known, I, 0)  # no weight reads for a pair without a (valid) expert
    gate_N, up_N = gate_up_cols(cols_N, I, INTERLEAVED)
    gw_N = w_ptr + expert * stride_we + gate_N.to(tl.int64) * stride_wn
    uw_N = w_ptr + expert * stride_we + up_N.to(tl.int64) * stride_wn
    gs_N = expert * stride_se + gate_N.to(tl.int64) * stride_sn
    us_N = expert * stride_se + up_N.to(tl.int64) * stride_sn
    x_row = x_ptr + (j // top_k).to(tl.int64) * stride_xm
    HK: tl.constexpr = BLOCK_K // 2
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        x_even, x_odd = legacy_even_odd(x_row, k0, D, HK)
        acc_g += legacy_packed_chunk(gw_N, s_ptr + gs_N, z_ptr + gs_N, k0, D, ok_N, x_even, x_odd, stride_sk, GROUP,
                              MXFP4, ZERO, HK)
        acc_u += legacy_packed_chunk(uw_N, s_ptr + us_N, z_ptr + us_N, k0, D, ok_N, x_even, x_odd, stride_sk, GROUP,
                              MXFP4, ZERO, HK)
    g_N, u_N = acc_g, acc_u
    h = tl.where(known, act(g_N, ACT) * u_N, tl.where(skipped, 0.0, float("nan")))
    tl.store(h_ptr + j.to(tl.int64) * stride_hm + cols_N, h.to(h_ptr.dtype.element_ty), mask=cols_N < I)


@triton.jit
def legacy_down_pairs4_kernel(h_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ids_ptr, weight_ptr, D, I, E, top_k, stride_hm,
                              stride_we, stride_wd, stride_se, stride_sn, stride_sk, stride_ym, WEIGHTED: tl.constexpr,
                              GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """y[t, n] = sum over k of w[t, k] * (h[t*K + k] . Wd[ids[t*K + k], n]) for token t = program_id(0),
    columns n of tile program_id(1); the slots summed in float32 in slot order. h: [T*K, I]; Wd: packed
    [E, D, I / 2] uint8 with scales (and zero points) [E, D, ceil(I / GROUP)] by strides; y: [T, D]."""
    t = tl.program_id(0)
    cols_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    HK: tl.constexpr = BLOCK_K // 2
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(top_k):
        j = t * top_k + slot
        expert = tl.load(ids_ptr + j).to(tl.int64)
        known = (expert >= 0) & (expert < E)
        expert = tl.where(known, expert, 0)
        ok_N = cols_N < tl.where(known, D, 0)  # an unknown id's h row is 0 (-1) or NaN, and reads no weights
        w_N = w_ptr + expert * stride_we + cols_N.to(tl.int64) * stride_wd
        s_N = expert * stride_se + cols_N.to(tl.int64) * stride_sn
        if WEIGHTED:
            rw = tl.load(weight_ptr + j).to(tl.float32)
        else:
            rw = 1.0
        h_row = h_ptr + j.to(tl.int64) * stride_hm
        for k0 in range(0, I, BLOCK_K):
            h_even, h_odd = legacy_even_odd(h_row, k0, I, HK)
            acc += legacy_packed_chunk(w_N, s_ptr + s_N, z_ptr + s_N, k0, I, ok_N, h_even * rw, h_odd * rw, stride_sk,
                                GROUP, MXFP4, ZERO, HK)
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + cols_N, acc.to(y_ptr.dtype.element_ty), mask=cols_N < D)
