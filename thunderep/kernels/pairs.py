"""Decode kernels: the expert MLP for one token or so, one (token, slot) pair at a time, with no sort.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K (token, slot) pairs in flat (token-major) order.

    up_pairs_kernel      h_NI[j] = act(x[j // K] @ Wg[ids[j]].T) * (x[j // K] @ Wu[ids[j]].T)
    down_pairs_kernel    y_TD[t] = sum over k of w[t, k] * (h_NI[t*K + k] @ Wd[ids[t*K + k]].T)
                         (_slot_partial: one slot's product; _all_slots_sum: all K slots in one tile)

Two launches (decode.py), where the sorted kernels (moe_triton.py) need a sort, counts and a sum over K
around their two GEMMs. Each pair reads its expert's weights itself, so tokens that share an expert read
it twice: `ops.routed_moe_mlp` uses these kernels for inference on few tokens (paths.py chooses).
Inference only (no saved intermediates, no backward). Portable Triton: elementwise multiply-adds,
or tl.dot on a 16-row tile (mma.sync on sm_89 / sm_120).

Where the GPU has programmatic dependent launch (sm_90 and later: H100 / H200, RTX 5090;
`paths.pdl_applies`), the down pass is launched as a dependent of the gate/up pass: its programs start in
the SM room the gate/up pass leaves, load their first Wd chunk, and wait (griddepcontrol.wait) for h;
the gap between the two launches, and part of the down pass's weight reads, overlap the gate/up pass.
Same arithmetic, same result bit for bit. RTX 4090 (sm_89) runs the plain launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # pragma: no cover - a Triton without it: the kernels run with PDL off
    HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

from .act import act, dequant, gate_up_cols, weight_scales
from .split_slots import sum_split_slots, zero_counts

__all__ = ["HAS_GDC", "down_pairs_kernel", "gdc_launch_dependents", "gdc_wait", "pair_expert", "up_pair_start",
           "up_pairs_kernel"]


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
    the chunk, so chunks of 1024 to 2048 columns fit, more weight bytes in flight per program
    (docs/BENCHMARKS.md, "FP8 expert weights")."""
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
def _entry_offset(expert, stride_we, split_e, w_shift, TWO: tl.constexpr):
    """Elements from w_ptr to entry `expert`'s weights (int64). TWO: the entries from split_e on are rows
    expert - split_e of a second tensor of the same strides, w_shift = (its address - w_ptr's) / element
    size - split_e * stride_we elements further (the expert tiers' hot copies and the cold experts they
    read in mapped host memory, in one launch)."""
    off = expert * stride_we
    if TWO:
        off += tl.where(expert >= split_e, w_shift, 0)
    return off


@triton.jit
def pair_expert(ids_ptr, j, E, cols_N, n):
    """Pair j's expert, read once: (its id, 0 for one outside [0, E); known: the id is in [0, E); skipped: the
    id is -1, another rank's expert; ok_N: cols_N < n for a known id, no column otherwise, so that no weight
    is read for a pair without a valid expert)."""
    expert = tl.load(ids_ptr + j).to(tl.int64)
    known = (expert >= 0) & (expert < E)
    skipped = expert == -1
    expert = tl.where(known, expert, 0)
    return expert, known, skipped, cols_N < tl.where(known, n, 0)


@triton.jit
def up_pair_start(ids_ptr, count_ptr, E, I, top_k, n_counts, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """What every gate/up pair program does first: PDL, let the down pass launch now (its programs take the
    SM room this grid leaves); zero the down pass's counts (split_slots.zero_counts); read pair j's expert
    (`pair_expert`). Returns (j = program_id(0), the tile's columns cols_N, expert, known, skipped, ok_N)."""
    if PDL:
        gdc_launch_dependents()
    j = tl.program_id(0)
    zero_counts(count_ptr, j, top_k, n_counts)
    cols_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert, known, skipped, ok_N = pair_expert(ids_ptr, j, E, cols_N, I)
    return j, cols_N, expert, known, skipped, ok_N


@triton.jit
def up_pairs_kernel(x_ptr, w_ptr, h_ptr, ids_ptr, count_ptr, ws_ptr, I, D, E, top_k, stride_xm, stride_we,
                     stride_wn, stride_hm, n_counts, stride_wse, stride_wsn, stride_wsk, ACT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
                     X_ROWS: tl.constexpr, SCALED: tl.constexpr = False, SCALE_N: tl.constexpr = 1,
                     SCALE_K: tl.constexpr = 1, REDUCE: tl.constexpr = False, split_e=0, w_shift=0,
                     TWO: tl.constexpr = False):
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
    SCALE_K, or SCALE_K >= D), each chunk dequantized to x's dtype (fp8.py). TWO (unscaled weights): ids
    from split_e on name rows of a second tensor (`_entry_offset`); E counts both tensors' rows."""
    j, cols_N, expert, known, skipped, col_ok_N = up_pair_start(ids_ptr, count_ptr, E, I, top_k, n_counts, BLOCK_N, PDL)
    gate_N, up_N = gate_up_cols(cols_N, I, INTERLEAVED)
    k_K = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (j // top_k).to(tl.int64) * stride_xm + k_K
    w_base = w_ptr + _entry_offset(expert, stride_we, split_e, w_shift, TWO)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BLOCKS: tl.constexpr = SCALED and SCALE_K > 0  # FP8 scales per chunk, else (SCALED) one per row
    gs_ptrs = weight_scales(ws_ptr, expert, gate_N, stride_wse, stride_wsn, SCALE_N)
    us_ptrs = weight_scales(ws_ptr, expert, up_N, stride_wse, stride_wsn, SCALE_N)
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
                    bg = dequant(bg, sg[None, :], DT)
                    bu = dequant(bu, su[None, :], DT)
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
    h = tl.where(known, act(g_N, ACT) * u_N, tl.where(skipped, 0.0, float("nan")))
    tl.store(h_ptr + j.to(tl.int64) * stride_hm + cols_N, h.to(h_ptr.dtype.element_ty), mask=cols_N < I)


@triton.jit
def _slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, j, cols_N, D, I, E, stride_hm, stride_we, stride_wd, ws_ptr,
                  stride_wse, stride_wsn, stride_wsk, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr, AHEAD: tl.constexpr,
                  X_ROWS: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                  REDUCE: tl.constexpr, split_e, w_shift, TWO: tl.constexpr):
    """w[j] * (h[j] . Wd[ids[j], n]) for columns n, as a [BLOCK_N, BLOCK_K] float32 tile to be summed
    over its second axis ([BLOCK_N, 1] with REDUCE, `_tile_acc`). An id outside [0, E) reads no
    weights (its h row is 0 or NaN).
    WAIT (launched as a programmatic dependent of the gate/up pass): load the first weight chunk while
    that pass still runs, then wait for it (gdc_wait) before reading h; each later chunk is loaded one
    step ahead. AHEAD: weight and h chunks both loaded one step ahead, with or without WAIT (the h
    chunk's conversion to the tile's layout then waits on a load issued a step earlier); with X_ROWS
    h's chunk is loaded per row of the tile instead (no conversion). Same arithmetic in the same order
    every way. SCALED: Wd is FP8 with scales at ws (as in up_pairs_kernel)."""
    expert, _, _, w_ok_N = pair_expert(ids_ptr, j, E, cols_N, D)
    k_K = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + j.to(tl.int64) * stride_hm + k_K
    w_ptrs = (w_ptr + _entry_offset(expert, stride_we, split_e, w_shift, TWO) + cols_N.to(tl.int64)[:, None] * stride_wd
              + k_K[None, :])
    BLOCKS: tl.constexpr = SCALED and SCALE_K > 0  # FP8 scales per chunk, else (SCALED) one per row
    ws_ptrs = weight_scales(ws_ptr, expert, cols_N, stride_wse, stride_wsn, SCALE_N)
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
                   X_ROWS: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                   split_e, w_shift, TWO: tl.constexpr):
    """sum over slots k of w[t, k] * (h[t*K + k] . Wd[ids[t*K + k], n]) for columns n: all of token t's
    slots in one [SLOTS, BLOCK_N, BLOCK_K] tile (SLOTS: top_k rounded up to a power of two; the rows of
    slots past top_k are masked), weights loaded two chunks ahead and h one, so the K experts' rows stream
    together and the sum over slots needs no second program. Ids as in _slot_partial; WAIT as there (the
    first two weight chunks loaded before gdc_wait); X_ROWS: h loaded per row of the tile (no layout
    conversion). The sum: float32 over k then over slots, each a fixed tree (same order every run).
    SCALED: Wd is FP8 with scales at ws (as in up_pairs_kernel)."""
    s_S = tl.arange(0, SLOTS)
    slot_ok_S = s_S < top_k
    j_S = t * top_k + s_S
    expert_S = tl.load(ids_ptr + j_S, mask=slot_ok_S, other=-1).to(tl.int64)
    known_S = (expert_S >= 0) & (expert_S < E)
    expert_S = tl.where(known_S, expert_S, 0)
    w_ok_SN = known_S[:, None] & (cols_N < D)[None, :]
    k_K = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + _entry_offset(expert_S, stride_we, split_e, w_shift, TWO)[:, None, None]
              + cols_N.to(tl.int64)[None, :, None] * stride_wd + k_K[None, None, :])
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
def down_pairs_kernel(h_ptr, w_ptr, y_ptr, ids_ptr, weight_ptr, part_ptr, count_ptr, ws_ptr, D, I, E, top_k,
                       stride_hm, stride_we, stride_wd, stride_ym, stride_cm, stride_wse, stride_wsn, stride_wsk,
                       WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, X_ROWS: tl.constexpr,
                       ALL_SLOTS: tl.constexpr = False, SLOTS: tl.constexpr = 1, SCALED: tl.constexpr = False,
                       SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1, REDUCE: tl.constexpr = False,
                       split_e=0, w_shift=0, TWO: tl.constexpr = False):
    """y[t, n] = sum over k of w[t, k] * (h[t*K + k] . Wd[ids[t*K + k], n]) for token t = program_id(0),
    columns n of tile program_id(1): the down projection, routing weight and sum over K in one pass.
    h: [T*K, I]; Wd: [E, D, I] (unit stride along I). Elementwise multiply-adds as in up_pairs_kernel
    (no 16-row tensor-core variant: docs/BENCHMARKS.md, "The GPU side at T = 1").

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
      at 0: up_pairs_kernel zeroes them, and each launch leaves them at 0 (the autotuner reruns).
    Expert id -1 (not computed here) adds nothing and reads no weights; for any other id outside
    [0, E) the h row is NaN (up_pairs_kernel), so y[t] is NaN. SCALED: Wd is FP8 with float32 scales ws
    [E, D / SCALE_N, I / SCALE_K] (by strides), as the gate/up pass's. TWO: ids from split_e on in a second
    tensor, as the gate/up pass's (`_entry_offset`)."""
    t = tl.program_id(0)
    tile = tl.program_id(1)
    cols_N = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok_N = cols_N < D
    y_ptrs = y_ptr + t.to(tl.int64) * stride_ym + cols_N
    if ALL_SLOTS:
        y_N = _all_slots_sum(h_ptr, w_ptr, ids_ptr, weight_ptr, t, cols_N, D, I, E, top_k, stride_hm, stride_we,
                             stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K, SLOTS, BLOCK_N,
                             BLOCK_K, PDL, X_ROWS, SCALED, SCALE_N, SCALE_K, split_e, w_shift, TWO)
        tl.store(y_ptrs, y_N.to(y_ptr.dtype.element_ty), mask=col_ok_N)
    elif SPLIT:
        j = t * top_k + tl.program_id(2)
        part_N = tl.sum(_slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, j, cols_N, D, I, E, stride_hm, stride_we,
                                      stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K,
                                      BLOCK_N, BLOCK_K, PDL, AHEAD, X_ROWS, SCALED, SCALE_N, SCALE_K, REDUCE,
                                      split_e, w_shift, TWO), 1)
        sum_split_slots(part_N, j, t, tile, cols_N, col_ok_N, D, top_k, part_ptr, count_ptr, stride_cm, y_ptrs)
    else:
        acc = _slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, t * top_k, cols_N, D, I, E, stride_hm, stride_we,
                            stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K, BLOCK_N, BLOCK_K,
                            PDL, AHEAD, X_ROWS, SCALED, SCALE_N, SCALE_K, REDUCE, split_e, w_shift, TWO)
        for slot in range(1, top_k):
            acc += _slot_partial(h_ptr, w_ptr, ids_ptr, weight_ptr, t * top_k + slot, cols_N, D, I, E, stride_hm,
                                 stride_we, stride_wd, ws_ptr, stride_wse, stride_wsn, stride_wsk, WEIGHTED, EVEN_K,
                                 BLOCK_N, BLOCK_K, False, AHEAD, X_ROWS, SCALED, SCALE_N, SCALE_K, REDUCE, split_e,
                                 w_shift, TWO)
        tl.store(y_ptrs, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=col_ok_N)
