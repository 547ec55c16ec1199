"""Decode: the expert MLP for one token or so, one (token, slot) pair at a time, with no sort.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K (token, slot) pairs in flat (token-major) order.

    _up_pairs_kernel     h_NI[j] = act(x[j // K] @ Wg[ids[j]].T) * (x[j // K] @ Wu[ids[j]].T)
    _down_pairs_kernel   y_TD[t] = sum over k of w[t, k] * (h_NI[t*K + k] @ Wd[ids[t*K + k]].T)
                         (_slot_partial: one slot's product; _all_slots_sum: all K slots in one tile)

    thunderep::moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, ...) -> y_TD

Two launches, where the sorted kernels (ops.py) need a sort, counts and a sum over K around their two
GEMMs. Each pair reads its expert's weights itself, so tokens that share an expert read it twice:
`routed_moe_mlp` (ops.py) uses these kernels for inference on at most PAIRS_MAX_TOKENS tokens.
Inference only (no saved intermediates, no backward). Portable Triton: elementwise multiply-adds,
or tl.dot on a 16-row tile (mma.sync on sm_89 / sm_120).

Where the GPU has programmatic dependent launch (sm_90 and later: H100 / H200, RTX 5090;
`pdl_applies`), the down pass is launched as a dependent of the gate/up pass: its programs start in
the SM room the gate/up pass leaves, load their first Wd chunk, and wait (griddepcontrol.wait) for h;
the gap between the two launches, and part of the down pass's weight reads, overlap the gate/up pass.
Same arithmetic, same result bit for bit. RTX 4090 (sm_89) runs the plain launch.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - a Triton without it: the kernels run with PDL off
    _HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

from .graphs import in_graph_steps
from ..errors import ConfigError
from . import tuning
from .fp8 import Fp8Weight, scale_args
from .fp8 import weight_data as _data
from .moe_triton import ACTIVATIONS, _act, _dequant, _gate_up_cols, _weight_scales

__all__ = ["PAIRS_MAX_TOKENS", "PAIRS_TUNE_MAX_TOKENS", "decode_applies", "moe_mlp_pairs", "needs_grad",
           "pairs_if_decode", "pairs_max_tokens", "pairs_win", "path_tuning_applies"]

_LOG = logging.getLogger("thunderep.kernels")


@triton.jit
def _one_row(v_K, ROWS: tl.constexpr):
    """[ROWS, len(v)] with v in row 0 and zeros below: one vector as the A tile of a tensor-core product."""
    r_R = tl.arange(0, ROWS)
    return tl.where(r_R[:, None] == 0, v_K[None, :], tl.zeros((ROWS, v_K.shape[0]), dtype=v_K.dtype))


@triton.jit
def _row0(acc_RN):
    """Row 0 of a [ROWS, N] accumulator."""
    r_R = tl.arange(0, acc_RN.shape[0])
    return tl.sum(tl.where(r_R[:, None] == 0, acc_RN, 0.0), 0)


@triton.jit
def _w32(w, scale, BLOCKS: tl.constexpr):
    """A weight tile in float32; FP8 tiles with scale blocks along k (BLOCKS) times their scales
    (broadcast to the tile). With one scale per row the sum is scaled instead (`_row_scales`)."""
    if BLOCKS:
        w32 = w.to(tl.float32) * scale
    else:
        w32 = w.to(tl.float32)
    return w32


@triton.jit
def _tile_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE: tl.constexpr):
    """An elementwise loop's float32 accumulator: [BLOCK_N, BLOCK_K], summed over k at the end, or
    (REDUCE) [BLOCK_N, 1], each chunk summed over k as it comes: its registers then do not grow with
    the chunk, so chunks of 1024 to 2048 columns fit, more weight bytes in flight per program. Measured
    on the H200 (docs/BENCHMARKS.md, "FP8 expert weights"): a plain FP8 matrix-vector product read 87%
    of the copy bandwidth with [16, 256] tile sums and 94% with [4, 2048] chunks summed each step (bf16
    read 100% either way)."""
    if REDUCE:
        return tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def _chunk_mac(acc, w, scale, v, BLOCKS: tl.constexpr, REDUCE: tl.constexpr):
    """acc + one chunk's products w * v in `_tile_acc`'s layout: w a [BLOCK_N, BLOCK_K] weight tile, v
    the vector's chunk in float32 broadcast to it, scale its rows' scales [BLOCK_N, 1] for FP8 tiles
    with scale blocks along k (BLOCKS; a chunk lies in one block). Summed as it comes (REDUCE), the
    chunk's sum is multiplied by the scales, not each value (one multiply less per weight)."""
    if REDUCE:
        if BLOCKS:
            acc += tl.sum(w.to(tl.float32) * v, 1, keep_dims=True) * scale
        else:
            acc += tl.sum(w.to(tl.float32) * v, 1, keep_dims=True)
    else:
        acc += _w32(w, scale, BLOCKS) * v
    return acc


@triton.jit
def _row_scales(s_ptrs, ok, ROWS: tl.constexpr):
    """The one scale of each row at s_ptrs for FP8 weights with one scale across each row (ROWS), which
    the row's float32 sum is multiplied by; 1.0 otherwise."""
    if ROWS:
        scales = tl.load(s_ptrs, mask=ok, other=0.0)
    else:
        scales = 1.0
    return scales


@triton.jit
def _chunk_scales(s_ptrs, k0, stride_sk, ok, SCALED: tl.constexpr, SCALE_K: tl.constexpr):
    """The scales at s_ptrs (any shape) of the weight chunk at column k0, 1.0 without SCALED. The
    look-ahead loops load them a chunk ahead with their weights (a scale loaded where it is used would
    stall every chunk on its latency)."""
    if SCALED and SCALE_K > 0:
        scales = tl.load(s_ptrs + (k0 // SCALE_K) * stride_sk, mask=ok, other=0.0)
    else:
        scales = 1.0
    return scales


@triton.jit
def _next_k(k0, BLOCK_K: tl.constexpr, K):
    """The column of the chunk after k0, or k0 itself for the last chunk (whose scales are then loaded
    again, unused, never past the row's)."""
    return tl.where(k0 + BLOCK_K >= K, k0, k0 + BLOCK_K)


@triton.jit
def _up_pairs_kernel(x_ptr, w_ptr, h_ptr, ids_ptr, count_ptr, ws_ptr, I, D, E, top_k, stride_xm, stride_we,
                     stride_wn, stride_hm, n_counts, stride_wse, stride_wsn, stride_wsk, ACT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
                     X_ROWS: tl.constexpr, SCALED: tl.constexpr = False, SCALE_N: tl.constexpr = 1,
                     SCALE_K: tl.constexpr = 1, REDUCE: tl.constexpr = False):
    """h[j, c] = act(x[j // K] . Wg[ids[j], gate(c)]) * (x[j // K] . Wu[ids[j], up(c)]) for pair j =
    program_id(0), columns c of tile program_id(1).

    A matrix-vector product per pair (no sort, no counts): decode reads each hit expert's weights once
    and does little arithmetic, so what matters is how many weight bytes are in flight. Two ways, tuned
    per shape (DOT): elementwise multiply-adds into a [BLOCK_N, BLOCK_K] float32 tile summed over k at
    the end; or the vector as row 0 of a 16-row tensor-core tile, whose weight loads Triton pipelines
    through shared memory over `num_stages` (the 15 zero rows cost only arithmetic).
    AHEAD (elementwise only): each chunk's weight and x loads are issued one step ahead, before the
    multiply-adds of the chunk before. Triton does not pipeline the elementwise loads itself: without
    AHEAD a program has one chunk in flight, and x's conversion to the tile's layout (through shared
    memory, with barriers) sits between the gate and the up loads. Same arithmetic in the same order.
    X_ROWS (with AHEAD): x's chunk loaded as a [BLOCK_N, BLOCK_K] tile, each row's threads loading the
    elements they multiply (repeats served by L1), so no layout conversion and no barrier per chunk.
    REDUCE (elementwise, tuned for FP8 weights): each chunk summed over k as it comes (`_tile_acc`).
    x: [T, D]; Wgu: [E, 2I, D] (unit stride along D); h: [T*K, I] in flat (token, slot) order.
    Expert id -1 marks a pair that is not computed here (another rank's expert): h = 0 and no weight
    is read. Any other id outside [0, E) writes NaN (no sync to check ids on the host; the token's
    output then shows it). Also zeroes the down pass's per-token counts (count: [T, n_counts]).
    SCALED: Wgu is FP8 with float32 scales ws [E, 2I / SCALE_N, D / SCALE_K] (by strides; BLOCK_K divides
    SCALE_K, or SCALE_K >= D), each chunk dequantized to x's dtype (fp8.py)."""
    if PDL:  # the down pass may launch now: its programs take the SM room this grid leaves
        gdc_launch_dependents()
    j = tl.program_id(0)
    if (tl.program_id(1) == 0) & (j % top_k == 0):
        c_C = tl.arange(0, 128)
        for c0 in range(0, n_counts, 128):
            tl.store(count_ptr + (j // top_k).to(tl.int64) * n_counts + c0 + c_C, tl.zeros((128,), dtype=tl.int32),
                     mask=c_C < n_counts - c0)
    cols_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + j).to(tl.int64)
    known = (expert >= 0) & (expert < E)
    skipped = expert == -1
    expert = tl.where(known, expert, 0)
    col_ok_N = cols_N < tl.where(known, I, 0)  # no weight reads for a pair without a (valid) expert
    gate_N, up_N = _gate_up_cols(cols_N, I, INTERLEAVED)
    k_K = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (j // top_k).to(tl.int64) * stride_xm + k_K
    w_base = w_ptr + expert * stride_we
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BLOCKS: tl.constexpr = SCALED and SCALE_K > 0  # FP8 scales per chunk, else (SCALED) one per row
    gs_ptrs = _weight_scales(ws_ptr, expert, gate_N, stride_wse, stride_wsn, SCALE_N)
    us_ptrs = _weight_scales(ws_ptr, expert, up_N, stride_wse, stride_wsn, SCALE_N)
    if DOT:  # weight tiles [BLOCK_K, BLOCK_N], the B operand of a 16-row product
        g_ptrs = w_base + gate_N.to(tl.int64)[None, :] * stride_wn + k_K[:, None]
        u_ptrs = w_base + up_N.to(tl.int64)[None, :] * stride_wn + k_K[:, None]
        acc_g = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    else:  # weight tiles [BLOCK_N, BLOCK_K]
        g_ptrs = w_base + gate_N.to(tl.int64)[:, None] * stride_wn + k_K[None, :]
        u_ptrs = w_base + up_N.to(tl.int64)[:, None] * stride_wn + k_K[None, :]
        acc_g = _tile_acc(BLOCK_N, BLOCK_K, REDUCE)
        acc_u = _tile_acc(BLOCK_N, BLOCK_K, REDUCE)
    if AHEAD and not DOT:
        first_K = (k_K < D) | EVEN_K
        g_next = tl.load(g_ptrs, mask=col_ok_N[:, None] & first_K[None, :], other=0.0)
        u_next = tl.load(u_ptrs, mask=col_ok_N[:, None] & first_K[None, :], other=0.0)
        if X_ROWS:  # x's chunk as a tile in the weight tiles' layout: each row's threads load their part
            x_ptrs = x_ptrs[None, :] + 0 * cols_N[:, None]
            x_next = tl.load(x_ptrs, mask=(cols_N >= 0)[:, None] & first_K[None, :], other=0.0)
        else:
            x_next = tl.load(x_ptrs, mask=first_K, other=0.0)
        sg_next = _chunk_scales(gs_ptrs, 0, stride_wsk, col_ok_N, SCALED, SCALE_K)
        su_next = _chunk_scales(us_ptrs, 0, stride_wsk, col_ok_N, SCALED, SCALE_K)
        for k0 in range(0, D, BLOCK_K):
            g, u, xv, sg, su = g_next, u_next, x_next, sg_next, su_next
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
            next_K = k_K < D - k0 - BLOCK_K  # the last step loads nothing
            g_next = tl.load(g_ptrs, mask=col_ok_N[:, None] & next_K[None, :], other=0.0)
            u_next = tl.load(u_ptrs, mask=col_ok_N[:, None] & next_K[None, :], other=0.0)
            k_next = _next_k(k0, BLOCK_K, D)
            sg_next = _chunk_scales(gs_ptrs, k_next, stride_wsk, col_ok_N, SCALED, SCALE_K)
            su_next = _chunk_scales(us_ptrs, k_next, stride_wsk, col_ok_N, SCALED, SCALE_K)
            if BLOCKS:
                sg, su = sg[:, None], su[:, None]
            if X_ROWS:
                x_next = tl.load(x_ptrs, mask=(cols_N >= 0)[:, None] & next_K[None, :], other=0.0)
                acc_g = _chunk_mac(acc_g, g, sg, xv.to(tl.float32), BLOCKS, REDUCE)
                acc_u = _chunk_mac(acc_u, u, su, xv.to(tl.float32), BLOCKS, REDUCE)
            else:
                x_next = tl.load(x_ptrs, mask=next_K, other=0.0)
                acc_g = _chunk_mac(acc_g, g, sg, xv.to(tl.float32)[None, :], BLOCKS, REDUCE)
                acc_u = _chunk_mac(acc_u, u, su, xv.to(tl.float32)[None, :], BLOCKS, REDUCE)
    else:
        for k0 in range(0, D, BLOCK_K):
            k_ok_K = (k_K < D - k0) | EVEN_K
            xv = tl.load(x_ptrs, mask=k_ok_K, other=0.0)
            sg = _chunk_scales(gs_ptrs, k0, stride_wsk, col_ok_N, SCALED, SCALE_K)
            su = _chunk_scales(us_ptrs, k0, stride_wsk, col_ok_N, SCALED, SCALE_K)
            if DOT:
                ok = k_ok_K[:, None] & col_ok_N[None, :]
                a = _one_row(xv, 16)
                bg = tl.load(g_ptrs, mask=ok, other=0.0)
                bu = tl.load(u_ptrs, mask=ok, other=0.0)
                if BLOCKS:
                    bg = _dequant(bg, sg[None, :], DT)
                    bu = _dequant(bu, su[None, :], DT)
                elif SCALED:
                    bg, bu = bg.to(DT), bu.to(DT)
                acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
            else:
                ok = col_ok_N[:, None] & k_ok_K[None, :]
                if BLOCKS:
                    sg, su = sg[:, None], su[:, None]
                acc_g = _chunk_mac(acc_g, tl.load(g_ptrs, mask=ok, other=0.0), sg, xv.to(tl.float32)[None, :], BLOCKS,
                                   REDUCE)
                acc_u = _chunk_mac(acc_u, tl.load(u_ptrs, mask=ok, other=0.0), su, xv.to(tl.float32)[None, :], BLOCKS,
                                   REDUCE)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    if DOT:
        g_N, u_N = _row0(acc_g), _row0(acc_u)
    else:
        g_N, u_N = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
    ROWS: tl.constexpr = SCALED and SCALE_K == 0
    g_N = g_N * _row_scales(gs_ptrs, col_ok_N, ROWS)
    u_N = u_N * _row_scales(us_ptrs, col_ok_N, ROWS)
    h = tl.where(known, _act(g_N, ACT) * u_N, tl.where(skipped, 0.0, float("nan")))
    tl.store(h_ptr + j.to(tl.int64) * stride_hm + cols_N, h.to(h_ptr.dtype.element_ty), mask=cols_N < I)


@triton.jit
def _slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, j, cols_N, D, I, E, stride_hm, stride_we, stride_wd, ws_ptr,
                  stride_wse, stride_wsn, stride_wsk, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr, AHEAD: tl.constexpr,
                  X_ROWS: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                  REDUCE: tl.constexpr):
    """w[j] * (h[j] . Wd[ids[j], n]) for columns n, as a [BLOCK_N, BLOCK_K] float32 tile to be summed
    over its second axis ([BLOCK_N, 1] with REDUCE, `_tile_acc`). An id outside [0, E) reads no
    weights (its h row is 0 or NaN).
    WAIT (launched as a programmatic dependent of the gate/up pass): load the first weight chunk while
    that pass still runs, then wait for it (gdc_wait) before reading h; each later chunk is loaded one
    step ahead. AHEAD: weight and h chunks both loaded one step ahead, with or without WAIT (the h
    chunk's conversion to the tile's layout then waits on a load issued a step earlier); with X_ROWS
    h's chunk is loaded per row of the tile instead (no conversion). Same arithmetic in the same order
    every way. SCALED: Wd is FP8 with scales at ws (as in _up_pairs_kernel)."""
    expert = tl.load(ids_ptr + j).to(tl.int64)
    known = (expert >= 0) & (expert < E)
    expert = tl.where(known, expert, 0)
    w_ok_N = cols_N < tl.where(known, D, 0)
    k_K = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + j.to(tl.int64) * stride_hm + k_K
    w_ptrs = w_ptr + expert * stride_we + cols_N.to(tl.int64)[:, None] * stride_wd + k_K[None, :]
    BLOCKS: tl.constexpr = SCALED and SCALE_K > 0  # FP8 scales per chunk, else (SCALED) one per row
    ws_ptrs = _weight_scales(ws_ptr, expert, cols_N, stride_wse, stride_wsn, SCALE_N)
    if WEIGHTED:
        scale = tl.load(weight_ptr + j).to(tl.float32)
    else:
        scale = 1.0
    acc = _tile_acc(BLOCK_N, BLOCK_K, REDUCE)
    if WAIT or AHEAD:
        first_K = (k_K < I) | EVEN_K
        w_next = tl.load(w_ptrs, mask=w_ok_N[:, None] & first_K[None, :], other=0.0)
        if WAIT:
            gdc_wait()
        if AHEAD and X_ROWS:  # h's chunk as a tile in the weight tile's layout: each row loads its part
            h_ptrs = h_ptrs[None, :] + 0 * cols_N[:, None]
            h_next = tl.load(h_ptrs, mask=(cols_N >= 0)[:, None] & first_K[None, :], other=0.0)
        elif AHEAD:
            h_next = tl.load(h_ptrs, mask=first_K, other=0.0)
        sw_next = _chunk_scales(ws_ptrs, 0, stride_wsk, w_ok_N, SCALED, SCALE_K)
        for k0 in range(0, I, BLOCK_K):
            k_ok_K = (k_K < I - k0) | EVEN_K
            next_K = k_K < I - k0 - BLOCK_K  # the last step loads nothing
            w, sw = w_next, sw_next
            w_ptrs += BLOCK_K
            w_next = tl.load(w_ptrs, mask=w_ok_N[:, None] & next_K[None, :], other=0.0)
            sw_next = _chunk_scales(ws_ptrs, _next_k(k0, BLOCK_K, I), stride_wsk, w_ok_N, SCALED, SCALE_K)
            if AHEAD:
                hv = h_next.to(tl.float32)
                h_ptrs += BLOCK_K
                if X_ROWS:
                    h_next = tl.load(h_ptrs, mask=(cols_N >= 0)[:, None] & next_K[None, :], other=0.0)
                else:
                    h_next = tl.load(h_ptrs, mask=next_K, other=0.0)
            else:
                hv = tl.load(h_ptrs, mask=k_ok_K, other=0.0).to(tl.float32)
                h_ptrs += BLOCK_K
            if BLOCKS:
                sw = sw[:, None]
            if AHEAD and X_ROWS:  # hv is already a [BLOCK_N, BLOCK_K] tile
                acc = _chunk_mac(acc, w, sw, hv * scale, BLOCKS, REDUCE)
            else:
                acc = _chunk_mac(acc, w, sw, (hv * scale)[None, :], BLOCKS, REDUCE)
    else:
        for k0 in range(0, I, BLOCK_K):
            k_ok_K = (k_K < I - k0) | EVEN_K
            hv = tl.load(h_ptrs, mask=k_ok_K, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=w_ok_N[:, None] & k_ok_K[None, :], other=0.0)
            sw = _chunk_scales(ws_ptrs, k0, stride_wsk, w_ok_N, SCALED, SCALE_K)
            if BLOCKS:
                sw = sw[:, None]
            acc = _chunk_mac(acc, w, sw, (hv * scale)[None, :], BLOCKS, REDUCE)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if SCALED and SCALE_K == 0:
        acc = acc * _row_scales(ws_ptrs, w_ok_N, True)[:, None]
    return acc


@triton.jit
def _all_slots_sum(h_ptr, w_ptr, ids_ptr, weight_ptr, t, cols_N, D, I, E, top_k, stride_hm, stride_we, stride_wd,
                   ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr,
                   SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr,
                   X_ROWS: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """sum over slots k of w[t, k] * (h[t*K + k] . Wd[ids[t*K + k], n]) for columns n: all of token t's
    slots in one [SLOTS, BLOCK_N, BLOCK_K] tile (SLOTS: top_k rounded up to a power of two; the rows of
    slots past top_k are masked), weights loaded two chunks ahead and h one, so the K experts' rows stream
    together and the sum over slots needs no second program. Ids as in _slot_partial; WAIT as there (the
    first two weight chunks loaded before gdc_wait); X_ROWS: h loaded per row of the tile (no layout
    conversion). The sum: float32 over k then over slots, each a fixed tree (same order every run).
    SCALED: Wd is FP8 with scales at ws (as in _up_pairs_kernel)."""
    s_S = tl.arange(0, SLOTS)
    slot_ok_S = s_S < top_k
    j_S = t * top_k + s_S
    expert_S = tl.load(ids_ptr + j_S, mask=slot_ok_S, other=-1).to(tl.int64)
    known_S = (expert_S >= 0) & (expert_S < E)
    expert_S = tl.where(known_S, expert_S, 0)
    w_ok_SN = known_S[:, None] & (cols_N < D)[None, :]
    k_K = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + expert_S[:, None, None] * stride_we + cols_N.to(tl.int64)[None, :, None] * stride_wd
              + k_K[None, None, :])
    BLOCKS: tl.constexpr = SCALED and SCALE_K > 0  # FP8 scales per chunk, else (SCALED) one per row
    ws_ptrs = (ws_ptr + expert_S[:, None] * stride_wse
               + (cols_N // SCALE_N).to(tl.int64)[None, :] * stride_wsn)  # [SLOTS, BLOCK_N]
    h_ptrs = h_ptr + j_S.to(tl.int64)[:, None] * stride_hm + k_K[None, :]
    if X_ROWS:  # h's chunk as a tile in the weight tile's layout: each row loads its part
        h_ptrs = h_ptrs[:, None, :] + 0 * cols_N[None, :, None]
        h_ok = slot_ok_S[:, None, None] & (cols_N >= 0)[None, :, None]
    else:
        h_ok = slot_ok_S[:, None]
    if WEIGHTED:
        scale_S = tl.load(weight_ptr + j_S, mask=slot_ok_S, other=0.0).to(tl.float32)
    else:
        scale_S = tl.where(slot_ok_S, 1.0, 0.0)
    acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    first_K = (k_K < I) | EVEN_K
    w_next = tl.load(w_ptrs, mask=w_ok_SN[:, :, None] & first_K[None, None, :], other=0.0)
    w_ptrs += BLOCK_K
    w_after = tl.load(w_ptrs, mask=w_ok_SN[:, :, None] & (k_K < I - BLOCK_K)[None, None, :], other=0.0)
    if WAIT:
        gdc_wait()
    if X_ROWS:
        h_next = tl.load(h_ptrs, mask=h_ok & first_K[None, None, :], other=0.0)
    else:
        h_next = tl.load(h_ptrs, mask=h_ok & first_K[None, :], other=0.0)
    sw_next = _chunk_scales(ws_ptrs, 0, stride_wsk, w_ok_SN, SCALED, SCALE_K)
    for k0 in range(0, I, BLOCK_K):
        next_K = k_K < I - k0 - BLOCK_K  # the last step loads nothing
        w, hv, sw = w_next, h_next.to(tl.float32), sw_next
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
        w_next = w_after  # w_ptrs is two chunks ahead
        after_K = k_K < I - k0 - 2 * BLOCK_K
        w_after = tl.load(w_ptrs, mask=w_ok_SN[:, :, None] & after_K[None, None, :], other=0.0)
        sw_next = _chunk_scales(ws_ptrs, _next_k(k0, BLOCK_K, I), stride_wsk, w_ok_SN, SCALED, SCALE_K)
        if BLOCKS:
            sw = sw[:, :, None]
        if X_ROWS:
            h_next = tl.load(h_ptrs, mask=h_ok & next_K[None, None, :], other=0.0)
            acc += _w32(w, sw, BLOCKS) * (hv * scale_S[:, None, None])
        else:
            h_next = tl.load(h_ptrs, mask=h_ok & next_K[None, :], other=0.0)
            acc += _w32(w, sw, BLOCKS) * (hv * scale_S[:, None])[:, None, :]
    if SCALED and SCALE_K == 0:
        return tl.sum(tl.sum(acc, 2) * _row_scales(ws_ptrs, w_ok_SN, True), 0)
    return tl.sum(tl.sum(acc, 2), 0)


@triton.jit
def _down_pairs_kernel(h_ptr, w_ptr, y_ptr, ids_ptr, weight_ptr, part_ptr, count_ptr, ws_ptr, D, I, E, top_k,
                       stride_hm, stride_we, stride_wd, stride_ym, stride_cm, stride_wse, stride_wsn, stride_wsk,
                       WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, X_ROWS: tl.constexpr,
                       ALL_SLOTS: tl.constexpr = False, SLOTS: tl.constexpr = 1, SCALED: tl.constexpr = False,
                       SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1, REDUCE: tl.constexpr = False):
    """y[t, n] = sum over k of w[t, k] * (h[t*K + k] . Wd[ids[t*K + k], n]) for token t = program_id(0),
    columns n of tile program_id(1): the down projection, routing weight and sum over K in one pass.
    h: [T*K, I]; Wd: [E, D, I] (unit stride along I). Elementwise multiply-adds as in _up_pairs_kernel
    (measured on the H200: 16-row tensor-core tiles were slower here).

    The sum over K is float32 in a fixed order (no float atomics), three ways, tuned per shape:
    - one program loops over the token's K slots;
    - ALL_SLOTS: one program holds the token's K slots in one [SLOTS, BLOCK_N, BLOCK_K] tile
      (_all_slots_sum; SLOTS = K rounded up to a power of two) and sums over them in registers, a
      fixed tree. Narrow column tiles give it the programs that SPLIT gets from the slots, without
      the partials and the last slot's sum;
    - SPLIT: one program per slot (program_id(2)) writes its float32 partial to part[t*K + k] and
      counts itself in count[t, tile] (acquire/release); the slot that arrives last sums the K
      partials in slot order, writes y and sets the count back to 0. K times the programs, for
      shapes with few columns (Qwen3's D = 2048) where the loop leaves SMs idle. The counts start
      at 0: _up_pairs_kernel zeroes them, and each launch leaves them at 0 (the autotuner reruns).
    Expert id -1 (not computed here) adds nothing and reads no weights; for any other id outside
    [0, E) the h row is NaN (_up_pairs_kernel), so y[t] is NaN. SCALED: Wd is FP8 with float32 scales ws
    [E, D / SCALE_N, I / SCALE_K] (by strides), as the gate/up pass's."""
    t = tl.program_id(0)
    tile = tl.program_id(1)
    cols_N = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok_N = cols_N < D
    y_ptrs = y_ptr + t.to(tl.int64) * stride_ym + cols_N
    if ALL_SLOTS:
        y_N = _all_slots_sum(h_ptr, w_ptr, ids_ptr, weight_ptr, t, cols_N, D, I, E, top_k, stride_hm, stride_we,
                             stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K, SLOTS, BLOCK_N,
                             BLOCK_K, PDL, X_ROWS, SCALED, SCALE_N, SCALE_K)
        tl.store(y_ptrs, y_N.to(y_ptr.dtype.element_ty), mask=col_ok_N)
    elif SPLIT:
        j = t * top_k + tl.program_id(2)
        part_N = tl.sum(_slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, j, cols_N, D, I, E, stride_hm, stride_we,
                                      stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K,
                                      BLOCK_N, BLOCK_K, PDL, AHEAD, X_ROWS, SCALED, SCALE_N, SCALE_K, REDUCE), 1)
        tl.store(part_ptr + j.to(tl.int64) * D + cols_N, part_N, mask=col_ok_N)
        count = count_ptr + t.to(tl.int64) * stride_cm + tile
        if tl.atomic_add(count, 1, sem="acq_rel") == top_k - 1:  # the token's other slots are stored
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            part_ptrs = part_ptr + (t * top_k).to(tl.int64) * D + cols_N
            for _ in range(0, top_k):
                y += tl.load(part_ptrs, mask=col_ok_N, other=0.0, cache_modifier=".cg")
                part_ptrs += D
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=col_ok_N)
            tl.store(count, 0)
    else:
        acc = _slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, t * top_k, cols_N, D, I, E, stride_hm, stride_we,
                            stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K, BLOCK_N, BLOCK_K,
                            PDL, AHEAD, X_ROWS, SCALED, SCALE_N, SCALE_K, REDUCE)
        for slot in range(1, top_k):
            acc += _slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, t * top_k + slot, cols_N, D, I, E, stride_hm,
                                 stride_we, stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K,
                                 BLOCK_N, BLOCK_K, False, AHEAD, X_ROWS, SCALED, SCALE_N, SCALE_K, REDUCE)
        tl.store(y_ptrs, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=col_ok_N)


# ---- host side ----------------------------------------------------------------------------------------


def _pair_cfg(bn, bk, warps, stages, dot=None, split=None, ahead=False, x_rows=False, all_slots=False,
              reduce=False):
    """A pair-kernel config. `dot` (gate/up pass only): 16-row tensor-core tiles instead of elementwise;
    `split` (down pass only): one program per (token, column tile, slot) instead of a loop over slots;
    `all_slots` (down pass only, with split False): all of a token's slots in one program's tile, its
    weights loaded two chunks ahead and h one; `ahead` (elementwise loops): the next chunk's loads
    issued before this chunk's multiply-adds; `x_rows` (with ahead or all_slots): the vector (x, or h)
    loaded per row of the tile, no layout conversion; `reduce` (elementwise loops, not all_slots):
    each chunk summed over k as it comes (`_tile_acc`), tuned for FP8 weights only."""
    kwargs = {"BLOCK_N": bn, "BLOCK_K": bk, **({} if dot is None else {"DOT": dot}),
              **({} if split is None else {"SPLIT": split}), "AHEAD": ahead, "X_ROWS": x_rows,
              **({"ALL_SLOTS": True} if all_slots else {}), **({"REDUCE": True} if reduce else {})}
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


# Pair kernels (decode): enough programs to keep every SM streaming weights. The gate/up pass tunes
# elementwise tiles against (dot=True) 16-row tensor-core tiles, whose weight loads Triton pipelines
# through shared memory; the down pass is elementwise only (the tensor-core variant lost on the H200),
# a loop over the K slots per program or (split=True) one program per slot.
_PAIR_TILES = [(8, 256, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 2), (32, 128, 4, 3),
               (32, 256, 8, 3), (64, 128, 8, 3), (64, 256, 8, 2)]
# The look-ahead loops (ahead=True) on tiles that made the fastest pairs on the H200 (docs/BENCHMARKS.md,
# "Where ThunderEP's 5.5 us go" and "Decode: all slots in one tile"); stages do not apply to them
# (Triton does not pipeline elementwise loads). Gate/up not at 64 rows: compiled for sm_90, its two
# chunks in registers spill.
_UP_AHEAD_TILES = [(8, 256, 4, 1), (16, 256, 4, 1), (32, 256, 8, 1), (4, 512, 4, 1), (8, 256, 2, 1)]
_DOWN_AHEAD_TILES = [(16, 128, 4, 1), (32, 128, 4, 1), (64, 128, 8, 1)]
# All slots in one tile: [SLOTS, BLOCK_N, BLOCK_K], so BLOCK_N is small (SLOTS is 8 on Qwen3 and DeepSeek-V3).
# On the H200 the autotuner chose 4 x 128 for Qwen3 (docs/BENCHMARKS.md, "Decode: all slots in one tile").
_DOWN_ALL_SLOTS_TILES = [(4, 128, 4, 1), (8, 64, 4, 1), (8, 128, 8, 1), (16, 128, 8, 1), (2, 256, 4, 1),
                         (4, 256, 8, 1)]
# Chunks summed as they come (reduce=True), wide: the tiles of the H200's fastest FP8 matrix-vector
# products in examples/fp8_convert_rate.py (docs/BENCHMARKS.md, "FP8 expert weights"). Tuned only for
# FP8 weights (tuning.fit_scale_blocks drops them for others: bf16 read the memory as fast without).
_REDUCE_TILES = [(4, 2048, 4, 1), (8, 1024, 4, 1), (16, 1024, 4, 1), (16, 512, 4, 1), (64, 256, 8, 1)]
_DOWN_PAIR_CONFIGS = [_pair_cfg(*tile, split=split) for tile in _PAIR_TILES for split in (False, True)] + [
    _pair_cfg(*tile, split=split, reduce=True) for tile in _REDUCE_TILES for split in (False, True)
    if tile[0] >= 8 or not split] + [
    _pair_cfg(*tile, split=True, ahead=True) for tile in _DOWN_AHEAD_TILES] + [
    _pair_cfg(*tile, split=True, ahead=True, x_rows=True) for tile in _DOWN_AHEAD_TILES[::2]] + [
    _pair_cfg(*tile, split=False, x_rows=x_rows, all_slots=True) for tile in _DOWN_ALL_SLOTS_TILES
    for x_rows in (False, True)]
_UP_PAIR_CONFIGS = [_pair_cfg(*tile, dot=False) for tile in _PAIR_TILES] + [
    _pair_cfg(*tile, dot=False, ahead=ahead, reduce=True) for tile in _REDUCE_TILES for ahead in (False, True)] + [
    _pair_cfg(*tile, dot=False, ahead=True) for tile in _UP_AHEAD_TILES] + [
    _pair_cfg(*tile, dot=False, ahead=True, x_rows=True) for tile in _UP_AHEAD_TILES[:2] + _UP_AHEAD_TILES[3:]] + [
    _pair_cfg(16, 256, 4, 4, True), _pair_cfg(32, 128, 4, 4, True), _pair_cfg(32, 256, 4, 3, True),
    _pair_cfg(64, 128, 4, 4, True), _pair_cfg(64, 256, 8, 3, True)]
_DEFAULT_UP_PAIR = _pair_cfg(16, 256, 4, 3, dot=False)
_DEFAULT_DOWN_PAIR = _pair_cfg(16, 256, 4, 3, split=False)
# The split down pass counts its slots per (token, column tile); room for the narrowest tile.
_MIN_DOWN_BLOCK_N = min(cfg.kwargs["BLOCK_N"] for cfg in _DOWN_PAIR_CONFIGS if cfg.kwargs["SPLIT"])


# PDL is left out of the keys: with it on or off (THUNDEREP_PDL) a shape runs the config tuned first.
# SCALE_K (FP8 weights' scale block along k; 1 for others) bounds BLOCK_K (tuning.fit_scale_blocks).
_UP_PAIRS, _UP_PAIRS_PLAIN = tuning.tuned("up_pairs", _up_pairs_kernel, _UP_PAIR_CONFIGS,
                                          ["I", "D", "top_k", "INTERLEAVED", "SCALE_K"], even_k="D")
_DOWN_PAIRS, _DOWN_PAIRS_PLAIN = tuning.tuned("down_pairs", _down_pairs_kernel, _DOWN_PAIR_CONFIGS,
                                              ["I", "D", "top_k", "WEIGHTED", "SCALE_K"], even_k="I")


# Up to this many tokens, inference always runs the pair kernels (no sort, no counts, two launches);
# above it up to PAIRS_TUNE_MAX_TOKENS the faster path is measured (`pairs_win`), and above that the
# sorted grouped GEMMs run, which read each hit expert once however many tokens share it. Measured on
# the H200 (docs/BENCHMARKS.md, "Decode"): the pair kernels win at T = 1 on all three model shapes.
PAIRS_MAX_TOKENS = 1


# From 2 tokens up to this many, inference on CUDA times both paths on the first call at each (shape, T)
# and keeps the faster (`pairs_win`): whether tokens share experts enough for the sorted path's single
# read of each expert to beat the pair kernels' lighter launch depends on E, K, the experts' size and
# the GPU. Measured on the H200 (docs/BENCHMARKS.md, "Decode: the graph's own cost, and 2 to 16
# tokens"): on Qwen3-30B-A3B's shape the pairs win up to T = 6, on Mixtral's the sorted path from
# T = 2; on DeepSeek-V3's they tie.
PAIRS_TUNE_MAX_TOKENS = 16
PATH_ROUTINGS = 4
# (D, I, E, K, T, dtype, weighted, activation, interleaved, device, experts, kind, graphed) -> pairs won
_PATHS: dict[tuple, bool] = {}


def _path_timer(fn, graphed: bool = False) -> float:
    """Milliseconds of one `fn()`, L2 flushed clean before each (the autotuner's timer, a short budget);
    `graphed`: of one replay of `fn` captured in a CUDA graph, as a captured decode step runs it (no
    host launch time: eager timings of a route of many small kernels count the host's, which misled
    the choice by 1.1 to 1.8x for a route that then ran in graphs, docs/BENCHMARKS.md). Only for routes
    made to be captured; a failed capture is raised, not worked around (a route that cannot be captured
    is a caller's bug: it would fail in the captured step as well)."""
    if not graphed:
        return tuning.timed_ms(fn, ms_budget=20.0, warmup_ms=5.0)
    graph = tuning.captured(fn)
    try:
        return tuning.timed_ms(graph.replay, ms_budget=20.0, warmup_ms=5.0)
    finally:
        del graph  # the capture's memory goes back to the allocator


def path_tuning_applies(device: torch.device) -> bool:
    """Whether `pairs_win` times the two paths on this device (CUDA with autotuning on)."""
    return tuning.autotune_enabled(device)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing a CUDA graph (nothing can be timed then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pairs_win(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, ids_TK: torch.Tensor,
              weights_TK: torch.Tensor | None, activation: str, interleaved: bool, sorted_path,
              experts: int | None = None, kind: str = "sorted") -> bool:
    """Whether inference on these T tokens runs the pair kernels (else `sorted_path(ids_TK)`, the
    caller's sorted route over the same arguments and the ids given). THUNDEREP_PAIRS_MAX_TOKENS, when
    set, decides alone (T up to it); so does T <= PAIRS_MAX_TOKENS. Up to PAIRS_TUNE_MAX_TOKENS, on
    CUDA with autotuning on, the first call at a shape and T runs both paths (each tunes its kernels),
    times both on this call's routing and on PATH_ROUTINGS - 1 uniform random ones, logs the mean
    times and keeps the faster for later calls. Inside a CUDA-graph capture or torch.compile nothing
    is timed: a choice made earlier holds, else the sorted path.

    `experts`: the model's expert count, where these weights are one rank's share of them (expert
    parallelism: ids_TK marks the other ranks' pairs -1, which the pair kernels skip); the random
    routings then pick among that many experts, those past this rank's marked -1. `kind` names the
    caller's sorted route where a caller has more than one (a choice is kept per kind). Calls within
    `thunderep.kernels.graphs.graph_steps` run in captured CUDA graphs: both paths are timed as graph
    replays (`_path_timer`) and the choice is kept apart from the eager one."""
    T = x_TD.shape[0]
    if T < 1 or needs_grad(x_TD, weights_TK, w_gate_up_E2ID, w_down_EDI):
        return False
    if os.environ.get("THUNDEREP_PAIRS_MAX_TOKENS", "") or T <= PAIRS_MAX_TOKENS:
        return T <= pairs_max_tokens()
    if T > PAIRS_TUNE_MAX_TOKENS or not path_tuning_applies(x_TD.device):
        return False
    E, D, I = w_down_EDI.shape
    graphed = in_graph_steps()
    key = (D, I, E, ids_TK.shape[1], T, x_TD.dtype, weights_TK is not None, activation, interleaved, str(x_TD.device),
           experts or E, kind, graphed)
    won = _PATHS.get(key)
    if won is not None or torch.compiler.is_compiling() or _capturing(x_TD.device):
        return bool(won)

    # How many tokens share an expert, which decides, varies from routing to routing (most with few
    # experts: Mixtral's 8): this call's routing and PATH_ROUTINGS - 1 uniform random ones are timed.
    gen = torch.Generator(device=x_TD.device).manual_seed(T)
    picks = [torch.rand(T, experts or E, device=x_TD.device, generator=gen).topk(ids_TK.shape[1], dim=-1).indices
             for _ in range(PATH_ROUTINGS - 1)]
    samples = [ids_TK] + [torch.where(ids < E, ids, -1).to(ids_TK.dtype) for ids in picks]
    start = time.perf_counter()
    pairs_ms = sorted_ms = 0.0
    with torch.no_grad():
        try:
            for ids in samples:
                pairs_on = functools.partial(moe_mlp_pairs, x_TD, w_gate_up_E2ID, w_down_EDI, ids, weights_TK,
                                             activation, interleaved)
                sorted_on = functools.partial(sorted_path, ids)
                pairs_on()  # each path tunes its kernels on its first call
                sorted_on()
                pairs_ms += _path_timer(pairs_on, graphed) / len(samples)
                sorted_ms += _path_timer(sorted_on, graphed) / len(samples)
        finally:
            tuning.free_timer_buffers()
    _PATHS[key] = won = pairs_ms < sorted_ms
    share = f" of {experts}" if experts and experts != E else ""
    _LOG.info("chose the %s path for D=%d, I=%d, E=%d%s, K=%d at T=%d in %.1f s: pairs %.1f us, %s %.1f us "
              "(mean of %d routings%s)", "pair" if won else kind, D, I, E, share, ids_TK.shape[1], T,
              time.perf_counter() - start, pairs_ms * 1e3, kind, sorted_ms * 1e3, len(samples),
              ", graph replays" if graphed else "")
    return won


def pairs_max_tokens() -> int:
    """PAIRS_MAX_TOKENS, or THUNDEREP_PAIRS_MAX_TOKENS when set (0 turns the pair kernels off)."""
    raw = os.environ.get("THUNDEREP_PAIRS_MAX_TOKENS", "")
    if not raw:
        return PAIRS_MAX_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"THUNDEREP_PAIRS_MAX_TOKENS={raw!r}: use a token count >= 0, or leave it unset")
    return value


def pdl_applies(device: torch.device) -> bool:
    """Whether the down pass launches as a programmatic dependent of the gate/up pass (PDL): on sm_90
    and later (H100 / H200, RTX 5090), outside Triton's interpreter; THUNDEREP_PDL=0 turns it off.
    Its programs then start while the gate/up pass still runs, load their first weight chunk and wait
    for h there (docs/ARCHITECTURE.md, "Decode")."""
    raw = os.environ.get("THUNDEREP_PDL", "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"THUNDEREP_PDL={raw!r}: use 0 (off) or 1, or leave it unset")
    if raw == "0" or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _has_pdl(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_pdl(index: int) -> bool:
    """Whether CUDA device `index` (and this Triton) can launch programmatic dependents: asked once per
    device, as decode asks pdl_applies on every step."""
    return _HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9


def _pairs(x: torch.Tensor, w_gate_up, w_down, ids: torch.Tensor, weights: Optional[torch.Tensor], activation: str,
           interleaved: bool) -> torch.Tensor:
    """The two pair launches; the weights are tensors or (both) fp8.Fp8Weight."""
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, N = I2 // 2, ids.numel()
    top_k = N // T
    n_counts = tuning.cdiv(D, _MIN_DOWN_BLOCK_N)
    pdl = pdl_applies(x.device)
    h = x.new_empty(N, I)
    part = torch.empty(N * D + T * n_counts, dtype=torch.float32, device=x.device)  # split down pass: partials, counts
    count = part[N * D:].view(torch.int32)
    w_gu, w_d = _data(w_gate_up), _data(w_down)
    tuning.launch(_UP_PAIRS, _UP_PAIRS_PLAIN, _DEFAULT_UP_PAIR, lambda meta: (N, tuning.cdiv(I, meta["BLOCK_N"])),
            x.device, x_ptr=x, w_ptr=w_gu, h_ptr=h, ids_ptr=ids, count_ptr=count, I=I, D=D, E=E, top_k=top_k,
            stride_xm=x.stride(0), stride_we=w_gu.stride(0), stride_wn=w_gu.stride(1),
            stride_hm=h.stride(0), n_counts=n_counts, ACT=ACTIVATIONS[activation], INTERLEAVED=interleaved,
            PRECISION=tuning.precision(x.dtype), PDL=pdl,
            **scale_args(w_gate_up, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")))
    y = x.new_empty(T, D)
    tuning.launch(_DOWN_PAIRS, _DOWN_PAIRS_PLAIN, _DEFAULT_DOWN_PAIR,
            lambda meta: (T, tuning.cdiv(D, meta["BLOCK_N"]), top_k if meta["SPLIT"] else 1),
            x.device, h_ptr=h, w_ptr=w_d, y_ptr=y, ids_ptr=ids, weight_ptr=weights if weights is not None else h,
            part_ptr=part, count_ptr=count, D=D, I=I, E=E, top_k=top_k, stride_hm=h.stride(0),
            stride_we=w_d.stride(0), stride_wd=w_d.stride(1), stride_ym=y.stride(0), stride_cm=n_counts,
            WEIGHTED=weights is not None, PDL=pdl, SLOTS=tuning.next_power_of_2(top_k),
            **scale_args(w_down, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")),
            **({"launch_pdl": True} if pdl else {}))
    return y


def _moe_mlp_pairs_impl(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
    weights: Optional[torch.Tensor], activation: str, interleaved: bool,
) -> torch.Tensor:
    return _pairs(x, w_gate_up, w_down, ids, weights, activation, interleaved)


_moe_mlp_pairs_op = torch.library.custom_op("thunderep::moe_mlp_pairs", mutates_args=())(_moe_mlp_pairs_impl)


@_moe_mlp_pairs_op.register_fake
def _(x, w_gate_up, w_down, ids, weights, activation, interleaved):
    return x.new_empty(x.shape[0], w_down.shape[1])


def _moe_mlp_pairs_fp8_impl(
    x: torch.Tensor, q_gate_up: torch.Tensor, s_gate_up: torch.Tensor, block_gate_up: list[int],
    q_down: torch.Tensor, s_down: torch.Tensor, block_down: list[int], ids: torch.Tensor,
    weights: Optional[torch.Tensor], activation: str, interleaved: bool,
) -> torch.Tensor:
    return _pairs(x, Fp8Weight(q_gate_up, s_gate_up, tuple(block_gate_up), x.dtype),
                  Fp8Weight(q_down, s_down, tuple(block_down), x.dtype), ids, weights, activation, interleaved)


_moe_mlp_pairs_fp8_op = torch.library.custom_op("thunderep::moe_mlp_pairs_fp8", mutates_args=())(
    _moe_mlp_pairs_fp8_impl)


@_moe_mlp_pairs_fp8_op.register_fake
def _(x, q_gate_up, s_gate_up, block_gate_up, q_down, s_down, block_down, ids, weights, activation, interleaved):
    return x.new_empty(x.shape[0], q_down.shape[1])


def moe_mlp_pairs(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, ids_TK: torch.Tensor,
                  weights_TK: torch.Tensor | None, activation: str, interleaved: bool) -> torch.Tensor:
    """y_TD through the pair kernels (inference). x_TD: [T, D]; w_gate_up_E2ID: [E, 2I, D] and
    w_down_EDI: [E, D, I] in x's dtype, or both fp8.Fp8Weight computing in it; ids_TK: [T, K] integer;
    weights_TK: [T, K] or None (unweighted). Inputs are checked by the caller (ops.routed_moe_mlp)."""
    if isinstance(w_gate_up_E2ID, Fp8Weight):
        op = _moe_mlp_pairs_fp8_op if torch.compiler.is_compiling() else _moe_mlp_pairs_fp8_impl
        w_gu, w_d = w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous()
        return op(x_TD.contiguous(), w_gu.q, w_gu.scale, list(w_gu.block), w_d.q, w_d.scale, list(w_d.block),
                  ids_TK.contiguous(), weights_TK.contiguous() if weights_TK is not None else None, activation,
                  interleaved)
    op = _moe_mlp_pairs_op if torch.compiler.is_compiling() else _moe_mlp_pairs_impl
    return op(x_TD.contiguous(), w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous(), ids_TK.contiguous(),
              weights_TK.contiguous() if weights_TK is not None else None, activation, interleaved)


def needs_grad(*tensors) -> bool:
    """Whether autograd will differentiate through these tensors (None entries are ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decode_applies(T: int, *tensors) -> bool:
    """The pair kernels' domain: inference (no gradient through `tensors`) on 1 to `pairs_max_tokens()`
    tokens."""
    return 0 < T <= pairs_max_tokens() and not needs_grad(*tensors)


def pairs_if_decode(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, ids_TK: torch.Tensor,
                    weights_TK: torch.Tensor | None, activation: str, interleaved: bool, fallback=None,
                    experts: int | None = None, kind: str = "sorted") -> torch.Tensor | None:
    """`moe_mlp_pairs` (x cast to the weights' dtype) where `decode_applies`, or, given the caller's
    `fallback(ids_TK)` (what the caller runs on None), where `pairs_win` chooses the pair kernels
    (`experts`, `kind` as there); else None. The caller has checked that the Triton kernels can run
    these experts."""
    if x_TD.shape[0] > max(PAIRS_TUNE_MAX_TOKENS, pairs_max_tokens()):  # neither applies: x is not cast
        return None
    x_TD = x_TD.to(w_gate_up_E2ID.dtype)
    if fallback is not None:
        if not pairs_win(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved, fallback,
                         experts, kind):
            return None
    elif not decode_applies(x_TD.shape[0], x_TD, weights_TK, w_gate_up_E2ID, w_down_EDI):
        return None
    return moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved)
