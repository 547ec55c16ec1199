"""Decode kernels on 4-bit expert weights (int4.py): the pair kernels of pairs.py reading packed tiles.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K (token, slot) pairs in flat (token-major) order; a chunk is BLOCK_K columns: HW = BLOCK_K / 8
packed 32-bit words (8 values each), HK = BLOCK_K / 2 bytes.

    up_pairs4_kernel     h_NI[j] = act(x[j // K] @ Wg[ids[j]].T) * (x[j // K] @ Wu[ids[j]].T)
    down_pairs4_kernel   y_TD[t] = sum over k of w[t, k] * (h_NI[t*K + k] @ Wd[ids[t*K + k]].T)

Each chunk is loaded as a [BLOCK_N, HW] tile of 32-bit words (a quarter of bfloat16's bytes), the next chunk's words
(DEPTH 2: the next two chunks') in flight while this one is converted (`packed_dot`). The conversion in registers
(codes4.py) uses no integer-to-float instruction and handles two values per operation: the codes of both 16-bit
halves of a word are placed into float16 bits at once (int4: or'ed into 1024's mantissa, `int4_halves`; e2m1: sign,
exponent and mantissa bits moved into place, `e2m1_halves`), then each half widened to float32. Each of a word's 8
planes (the values 8 columns apart) times the vector's matching elements is summed in one chain of multiply-adds per
word, then per group, times the group scales (one scale load per group and row). HALF (on CUDA, paths.half_mode):
the codes stay in float16 pairs and the products run there, two a packed instruction, each word's sum widened once
(HALF 1: e2m1's by a byte lookup), or two words' 16 products a chain at 2 ** -6 times the values (HALF 3: e2m1's
through the FP8 conversion) (half4.py, `half_chunk`), for a vector whose largest magnitude `half_fits` (measured once a
program; any other runs the float32 loop); a 16-bit vector is read there as its float16 pairs, 16 bytes a word
position split in registers (`half4.vector_pairs`), or h as the float16 pairs the gate/up pass wrote (PAIRED). Words
are loaded 16 bytes wide where rows are a multiple of 32 columns (WORDS4, `load_words`). The down pass runs one
program per token and column tile over the K slots, or (SPLIT) one per slot, and may cut I into ranges (PARTS: wide
column tiles reading each chunk of h once for all their rows, the partials summed by the last program to arrive,
split_slots.py), and is launched as a programmatic dependent of the gate/up pass where the GPU has it (PDL), as
pairs.py's; with biases (BIAS) it is gpt-oss's down pass too. The word loads are words4.py's. No Hopper-only
instructions; no inline assembly but HALF's (sm_80 and later). Rows that are not 4-byte aligned, or groups of
other than a multiple of 8 columns, run the same conversions one byte at a time (`byte_chunk`). Partial chunks
(D or I not a multiple of BLOCK_K) and column tiles past the matrix are masked. Expert ids as in pairs.py: -1
reads no weights and adds nothing; any other id outside [0, E) makes its token's output NaN. Inference only. The
launches are in decode.py; gpt-oss's experts (biases, clamped SwiGLU) run pairs4_gptoss.py's kernels, built on
`packed_dot`, `packed_dot2` and words4.py's `words_ok`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act import act, gate_up_cols
from .codes4 import E2M1_UNIT, e2m1_halves, int4_halves, nibbles4, scales4
from .half4 import (UNIT3, half_fits, half_word_products, pair_products, vector_pairs,
                    word_pair_products)
from .pairs import gdc_wait, pair_expert, up_pair_start
from .split_slots import part_range, sum_split_slots
from .vector4 import largest, planes, vector, vector_words, word_sums
from .words4 import first_words, next_words, words_ok

__all__ = ["byte_chunk", "down_pairs4_kernel", "half_chunk", "packed_dot", "packed_dot2", "slot_weights", "store_h",
           "up_pairs4_kernel", "word_chunk"]


@triton.jit
def _word_products(w, v_ptr, k0, C, opaque, MXFP4: tl.constexpr, HW: tl.constexpr):
    """([BLOCK_N, HW] sums over each word's 8 values times the vector's elements, [HW] sums of the vector's
    elements per word) for the chunk at column k0 from its words w (`load_words`). Value j of a word (nibble
    j, column 8 q + j) sits in half j // 4 at bits 4 (j % 4): one plane per j, converted for all words at
    once (two planes per logic operation), the products summed in one chain of multiply-adds per word."""
    x0, x4, x1, x5, x2, x6, x3, x7 = planes(v_ptr, k0, C, HW)
    if MXFP4:
        lo, hi = e2m1_halves(w, 0, opaque)
        prod = lo * x0[None, :]
        prod += hi * x4[None, :]
        lo, hi = e2m1_halves(w, 4, opaque)
        prod += lo * x1[None, :]
        prod += hi * x5[None, :]
        lo, hi = e2m1_halves(w, 8, opaque)
        prod += lo * x2[None, :]
        prod += hi * x6[None, :]
        lo, hi = e2m1_halves(w, 12, opaque)
        prod += lo * x3[None, :]
        prod += hi * x7[None, :]
    else:
        w8 = w >> 8  # codes 2, 3 (and 6, 7) at bits 0..7 of each half
        lo, hi = int4_halves(w, 0, opaque)
        prod = lo * x0[None, :]
        prod += hi * x4[None, :]
        lo, hi = int4_halves(w, 4, opaque)
        prod += lo * x1[None, :]
        prod += hi * x5[None, :]
        lo, hi = int4_halves(w8, 0, opaque)
        prod += lo * x2[None, :]
        prod += hi * x6[None, :]
        lo, hi = int4_halves(w8, 4, opaque)
        prod += lo * x3[None, :]
        prod += hi * x7[None, :]
    return prod, word_sums(x0, x4, x1, x5, x2, x6, x3, x7)


@triton.jit
def _byte_products(w_ptrs_N, v_ptr, k0, C, ok_N, MXFP4: tl.constexpr, HK: tl.constexpr):
    """`_word_products` one byte at a time: ([BLOCK_N, HK] sums of each byte's two values times the vector's
    even and odd elements, [HK] sums of those elements), for rows that are not 4-byte aligned."""
    p_K = k0 // 2 + tl.arange(0, HK)
    ok = ok_N[:, None] & (p_K < C // 2)[None, :]
    b = tl.load(w_ptrs_N[:, None] + p_K[None, :], mask=ok, other=0).to(tl.int32)
    v_even, v_odd = vector(v_ptr, 2 * p_K, C), vector(v_ptr, 2 * p_K + 1, C)
    lo, hi = nibbles4(b, MXFP4)
    return lo * v_even[None, :] + hi * v_odd[None, :], v_even + v_odd


@triton.jit
def _grouped(prod, vsum_H, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP: tl.constexpr, PER: tl.constexpr,
             MXFP4: tl.constexpr, ZERO: tl.constexpr, UNIT: tl.constexpr):
    """A chunk's products prod [BLOCK_N, H] (each element PER columns: a word or a byte, inside one group) summed
    per group, times UNIT and the group's scale (zero points: minus z times the group's sum of the vector,
    vsum_H [H]), as the row's partials [BLOCK_N, `_partials`' columns] that the loops add up chunk after chunk
    and sum across once after the loop (no cross-thread reduction a chunk). A chunk of whole groups (GROUP /
    PER elements, a power of two, dividing H) loads one scale per group and row (a partial per group); a
    chunk inside one group one per row (one partial); anything else one per element (one per element)."""
    BLOCK_N: tl.constexpr = tl.constexpr(prod.shape[0])
    H: tl.constexpr = tl.constexpr(prod.shape[1])
    EG: tl.constexpr = tl.constexpr(GROUP // PER)
    if (H % EG == 0) and ((EG & (EG - 1)) == 0):  # whole groups: [BLOCK_N, NG, EG]
        NG: tl.constexpr = H // EG
        g_G = k0 // GROUP + tl.arange(0, NG)
        ok_G = ok_N[:, None] & (g_G * GROUP < C)[None, :]
        g_off = g_G.to(tl.int64)[None, :] * stride_sk
        sums = tl.sum(tl.reshape(prod, (BLOCK_N, NG, EG)), 2)
        if ZERO:
            vsum = tl.sum(tl.reshape(vsum_H, (NG, EG)), 1)
            sums -= tl.load(z_ptrs_N[:, None] + g_off, mask=ok_G, other=0).to(tl.float32) * vsum[None, :]
        if UNIT != 1.0:
            sums = sums * UNIT
        return sums * scales4(s_ptrs_N[:, None] + g_off, ok_G, MXFP4)
    elif EG % H == 0:  # the chunk lies inside one group (k0 is a multiple of BLOCK_K, which divides GROUP)
        g_off = (k0 // GROUP) * stride_sk  # a group index within one row: no overflow
        sums = tl.sum(prod, 1)
        if ZERO:
            sums -= tl.load(z_ptrs_N + g_off, mask=ok_N, other=0).to(tl.float32) * tl.sum(vsum_H, 0)
        if UNIT != 1.0:
            sums = sums * UNIT
        return (sums * scales4(s_ptrs_N + g_off, ok_N, MXFP4))[:, None]  # k0 < C: chunks start inside the row
    else:  # a scale per element
        p_H = k0 // PER + tl.arange(0, H)
        ok = ok_N[:, None] & (p_H * PER < C)[None, :]
        g_H = (PER * p_H // GROUP).to(tl.int64) * stride_sk
        if ZERO:
            prod -= tl.load(z_ptrs_N[:, None] + g_H[None, :], mask=ok, other=0).to(tl.float32) * vsum_H[None, :]
        if UNIT != 1.0:
            prod = prod * UNIT
        return prod * scales4(s_ptrs_N[:, None] + g_H[None, :], ok, MXFP4)


@triton.jit
def _partials(ok_N, H: tl.constexpr, GROUP: tl.constexpr, PER: tl.constexpr):
    """Zeros in the shape of `_grouped`'s partials for chunks of H elements of PER columns each: [BLOCK_N, H /
    (GROUP / PER)] for whole groups, [BLOCK_N, 1] inside one group, [BLOCK_N, H] otherwise."""
    EG: tl.constexpr = GROUP // PER
    NC: tl.constexpr = (H // EG) if ((H % EG == 0) and ((EG & (EG - 1)) == 0)) else (1 if EG % H == 0 else H)
    return tl.zeros((ok_N.shape[0], NC), dtype=tl.float32)


@triton.jit
def word_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr, MXFP4: tl.constexpr,
               ZERO: tl.constexpr):
    """The float32 partials (`_grouped`) of one chunk at column k0 from its words w (`load_words`; GROUP a
    multiple of 8): the values times the vector at v_ptr (C elements), summed per group and times the group's
    scale (zero points: minus z times the group's sum of the vector). opaque: a uint32 zero the compiler cannot
    see through (`packed_dot`)."""
    prod, vsum = _word_products(w, v_ptr, k0, C, opaque, MXFP4, w.shape[1])
    return _grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO,
                    E2M1_UNIT if MXFP4 else 1.0)


@triton.jit
def half_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr, MXFP4: tl.constexpr,
               ZERO: tl.constexpr, MODE: tl.constexpr, vp_ptr=0, PAIRED: tl.constexpr = False):
    """`word_chunk` with the products in float16 pairs (half4.py; MODE 1 inline PTX, 2 Triton operations),
    for a vector that `half_fits`. A 16-bit vector without zero points is read as its float16
    pairs (`vector_pairs`), or PAIRED from its copy at vp_ptr already in that layout (`up_pairs4_kernel`'s);
    others through their float32 planes (`half_chunk_planes`)."""
    if (not ZERO) and (PAIRED or v_ptr.dtype.element_ty != tl.float32):
        if PAIRED:  # the words are the pairs
            p04, p15, p26, p37 = vector_words(vp_ptr, k0, C, w.shape[1])
        else:
            p04, p15, p26, p37 = vector_pairs(v_ptr, k0, C, w.shape[1], MODE)
        if MODE == 3 and (w.shape[1] % 2 == 0) and (GROUP % 16 == 0):  # two words a sum
            prod = word_pair_products(w, p04, p15, p26, p37, MXFP4)
            return _grouped(prod, tl.zeros((w.shape[1] // 2,), dtype=tl.float32), s_ptrs_N, z_ptrs_N, k0, C, ok_N,
                            stride_sk, GROUP, 16, MXFP4, ZERO, UNIT3)
        prod = pair_products(w, p04, p15, p26, p37, opaque, MODE, MXFP4)
        return _grouped(prod, tl.zeros((w.shape[1],), dtype=tl.float32), s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk,
                        GROUP, 8, MXFP4, ZERO, UNIT3 if MXFP4 and MODE == 3 else 1.0)
    return half_chunk_planes(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO, MODE)


@triton.jit
def half_chunk_planes(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                      MXFP4: tl.constexpr, ZERO: tl.constexpr, MODE: tl.constexpr, vp_ptr=0,
                      PAIRED: tl.constexpr = False):
    """`half_chunk` through the vector's float32 planes (`vector4.planes`), each two made a float16 pair."""
    x0, x4, x1, x5, x2, x6, x3, x7 = planes(v_ptr, k0, C, w.shape[1])
    prod = half_word_products(w, x0, x4, x1, x5, x2, x6, x3, x7, opaque, MODE, MXFP4)
    return _grouped(prod, word_sums(x0, x4, x1, x5, x2, x6, x3, x7), s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk,
                    GROUP, 8, MXFP4, ZERO, UNIT3 if MXFP4 and MODE == 3 else 1.0)


@triton.jit
def byte_chunk(w_ptrs_N, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, stride_sk, GROUP: tl.constexpr, MXFP4: tl.constexpr,
               ZERO: tl.constexpr, BLOCK_K: tl.constexpr):
    """`word_chunk` on rows read as bytes (not 4-byte aligned, or groups of other than a multiple of 8)."""
    prod, vsum = _byte_products(w_ptrs_N, v_ptr, k0, C, ok_N, MXFP4, BLOCK_K // 2)
    return _grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 2, MXFP4, ZERO, 1.0)


@triton.jit
def _byte_dot(w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, stride_sk, GROUP: tl.constexpr, MXFP4: tl.constexpr,
              ZERO: tl.constexpr, BLOCK_K: tl.constexpr):
    """`packed_dot` on rows read as bytes, chunk after chunk."""
    acc = _partials(ok_N, BLOCK_K // 2, GROUP, 2)
    for k0 in range(0, C, BLOCK_K):
        acc += byte_chunk(w_ptrs_N, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K)
    return tl.sum(acc, 1)


@triton.jit
def _words_loop(w_next, w_after, w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, opaque, stride_sk,
                GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
                WORDS4: tl.constexpr, MODE: tl.constexpr, vp_ptr=0, PAIRED: tl.constexpr = False,
                DEPTH: tl.constexpr = 1):
    """`packed_dot`'s loop over the chunks of words from `first_words`' (w_next, w_after), DEPTH chunks in flight;
    each chunk in float16 pairs (MODE 1 or 2) or in float32; the partials summed across once, after the loop."""
    acc = _partials(ok_N, BLOCK_K // 8, GROUP, 8)
    for k0 in range(0, C, BLOCK_K):
        w, w_next, w_after = next_words(w_next, w_after, w_ptrs_N, k0, C, ok_N, BLOCK_K, WORDS4, DEPTH)
        if MODE != 0:
            acc += half_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO, MODE,
                              vp_ptr, PAIRED)
        else:
            acc += word_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO)
    return tl.sum(acc, 1)


@triton.jit
def packed_dot(w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, words, opaque, stride_sk, GROUP: tl.constexpr,
               MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr = False,
               WORDS4: tl.constexpr = False, HALF: tl.constexpr = 0, vp_ptr=0, PAIRED: tl.constexpr = False,
               DEPTH: tl.constexpr = 1):
    """[BLOCK_N] float32: each row (w_ptrs_N, its scales and zero points) times the vector at v_ptr over all C
    columns, chunk by chunk. words (`words_ok`) and GROUP a multiple of 8: read as 32-bit words, each chunk's
    loads issued one chunk ahead (Triton does not pipeline them itself), so that a warp's next bytes are in
    flight while it converts this chunk's; else as bytes. opaque: a uint32 that is 0 wherever rows are read
    but that the compiler cannot prove so (the launch's expert id >> 32): added to the conversions' masks, it
    keeps them in registers, where the compiler otherwise rebuilds each constant before each use. WAIT (a
    programmatic dependent launch, `down_pairs4_kernel`): the first chunk's words are loaded, then the
    program waits for the grid it depends on (which writes the vector) before it reads the vector. WORDS4:
    C is a multiple of 32 (`load_words`). HALF (words; 1 inline PTX, 2 its interpreter form): the vector
    measured once (`largest`); one that `half_fits` runs the loop of `half_chunk`, any other the float32 loop
    (two loops, not a branch a chunk: a branch inside the loop holds both chunks' registers at once). PAIRED:
    the float16 loop reads the vector's copy at vp_ptr in its float16-pair layout (`half_chunk`). DEPTH: the
    words of that many chunks ahead in flight (1 or 2, `_words_loop`; under WAIT both loaded before the wait)."""
    if (GROUP % 8 == 0) and words:
        w_first, w_second = first_words(w_ptrs_N, C, ok_N, BLOCK_K, WORDS4, DEPTH)
        if WAIT:
            gdc_wait()
        if HALF != 0:  # half4.py
            if half_fits(largest(v_ptr, C, BLOCK_K)):
                acc = _words_loop(w_first, w_second, w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, opaque, stride_sk,
                                  GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, HALF, vp_ptr, PAIRED, DEPTH)
            else:
                acc = _words_loop(w_first, w_second, w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, opaque, stride_sk,
                                  GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, 0, DEPTH=DEPTH)
        else:
            acc = _words_loop(w_first, w_second, w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, opaque, stride_sk,
                              GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, 0, DEPTH=DEPTH)
    else:
        if WAIT:
            gdc_wait()
        acc = _byte_dot(w_ptrs_N, s_ptrs_N, z_ptrs_N, C, ok_N, v_ptr, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K)
    return acc


@triton.jit
def _words_loop2(a_ptrs_N, sa_ptrs_N, za_ptrs_N, b_ptrs_N, sb_ptrs_N, zb_ptrs_N, C, ok_N, v_ptr, opaque, stride_sk,
                 GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
                 WORDS4: tl.constexpr, MODE: tl.constexpr, DEPTH: tl.constexpr = 1):
    """`_words_loop` of two matrices (`packed_dot2`): both matrices' next DEPTH chunks in flight together."""
    acc_a = _partials(ok_N, BLOCK_K // 8, GROUP, 8)
    acc_b = _partials(ok_N, BLOCK_K // 8, GROUP, 8)
    a_next, a_after = first_words(a_ptrs_N, C, ok_N, BLOCK_K, WORDS4, DEPTH)
    b_next, b_after = first_words(b_ptrs_N, C, ok_N, BLOCK_K, WORDS4, DEPTH)
    for k0 in range(0, C, BLOCK_K):
        a, a_next, a_after = next_words(a_next, a_after, a_ptrs_N, k0, C, ok_N, BLOCK_K, WORDS4, DEPTH)
        b, b_next, b_after = next_words(b_next, b_after, b_ptrs_N, k0, C, ok_N, BLOCK_K, WORDS4, DEPTH)
        if MODE != 0:
            acc_a += half_chunk(a, sa_ptrs_N, za_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO,
                                MODE)
            acc_b += half_chunk(b, sb_ptrs_N, zb_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO,
                                MODE)
        else:
            acc_a += word_chunk(a, sa_ptrs_N, za_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO)
            acc_b += word_chunk(b, sb_ptrs_N, zb_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO)
    return tl.sum(acc_a, 1), tl.sum(acc_b, 1)


@triton.jit
def packed_dot2(a_ptrs_N, sa_ptrs_N, za_ptrs_N, b_ptrs_N, sb_ptrs_N, zb_ptrs_N, C, ok_N, v_ptr, words, opaque,
                stride_sk, GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
                WORDS4: tl.constexpr = False, HALF: tl.constexpr = 0, DEPTH: tl.constexpr = 1):
    """`packed_dot` of two matrices' rows (a and b: gate and up) with one vector, in one loop
    (`_words_loop2`)."""
    if (GROUP % 8 == 0) and words:
        if HALF != 0:  # half4.py
            if half_fits(largest(v_ptr, C, BLOCK_K)):
                acc_a, acc_b = _words_loop2(a_ptrs_N, sa_ptrs_N, za_ptrs_N, b_ptrs_N, sb_ptrs_N, zb_ptrs_N, C, ok_N,
                                            v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, HALF, DEPTH)
            else:
                acc_a, acc_b = _words_loop2(a_ptrs_N, sa_ptrs_N, za_ptrs_N, b_ptrs_N, sb_ptrs_N, zb_ptrs_N, C, ok_N,
                                            v_ptr, opaque, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, 0, DEPTH)
        else:
            acc_a, acc_b = _words_loop2(a_ptrs_N, sa_ptrs_N, za_ptrs_N, b_ptrs_N, sb_ptrs_N, zb_ptrs_N, C, ok_N, v_ptr,
                                        opaque, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, 0, DEPTH)
    else:
        acc_a = _byte_dot(a_ptrs_N, sa_ptrs_N, za_ptrs_N, C, ok_N, v_ptr, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K)
        acc_b = _byte_dot(b_ptrs_N, sb_ptrs_N, zb_ptrs_N, C, ok_N, v_ptr, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K)
    return acc_a, acc_b


@triton.jit
def up_pairs4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, ids_ptr, count_ptr, I, D, E, top_k, n_counts, stride_xm,
                     stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hm, ACT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                     WORDS4: tl.constexpr = False, HALF: tl.constexpr = 0, hp_ptr=0, PAIRED: tl.constexpr = False,
                     DEPTH: tl.constexpr = 1):
    """h[j, c] = act(x[j // K] . Wg[ids[j], gate(c)]) * (x[j // K] . Wu[ids[j], up(c)]) for pair j =
    program_id(0), columns c of tile program_id(1). x: [T, D]; W: packed [E, 2I, D / 2] uint8 with scales
    (and zero points, ZERO) [E, 2I, ceil(D / GROUP)] by strides; h: [T*K, I]. Also zeroes the down pass's
    per-token counts (count: [T, n_counts], `down_pairs4_kernel`'s SPLIT). PDL: the down pass may launch
    as soon as this grid's programs have all started (pairs.py's programmatic dependent launch). WORDS4: D
    a multiple of 32 (16-byte loads, `load_words`). HALF: the products in float16 pairs (`packed_dot`). PAIRED:
    h also written to hp (float16, h's strides) in the layout of `half4.vector_pairs`' pairs, for the down
    pass's float16 loop to load as they lie: column 8 q + i (i < 4) at 8 q + 2 i, 8 q + 4 + i at 8 q + 2 i + 1,
    each the float16 of h as stored (the same bits as that pass's own conversion gives). DEPTH: chunks of
    words in flight ahead of the one converted (`packed_dot`)."""
    j, cols_N, expert, known, skipped, ok_N = up_pair_start(ids_ptr, count_ptr, E, I, top_k, n_counts, BLOCK_N, PDL)
    gate_N, up_N = gate_up_cols(cols_N, I, INTERLEAVED)
    gw_N = w_ptr + expert * stride_we + gate_N.to(tl.int64) * stride_wn
    uw_N = w_ptr + expert * stride_we + up_N.to(tl.int64) * stride_wn
    gs_N = expert * stride_se + gate_N.to(tl.int64) * stride_sn
    us_N = expert * stride_se + up_N.to(tl.int64) * stride_sn
    x_row = x_ptr + (j // top_k).to(tl.int64) * stride_xm
    words = words_ok(w_ptr, stride_we, stride_wn, D)
    opaque = (expert >> 32).to(tl.uint32)  # 0 (expert is in [0, E)); to the compiler, any value (packed_dot)
    acc_g, acc_u = packed_dot2(gw_N, s_ptr + gs_N, z_ptr + gs_N, uw_N, s_ptr + us_N, z_ptr + us_N, D, ok_N, x_row,
                               words, opaque, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K, WORDS4, HALF, DEPTH)
    h = tl.where(known, act(acc_g, ACT) * acc_u, tl.where(skipped, 0.0, float("nan")))
    store_h(h, h_ptr, hp_ptr, j, cols_N, I, stride_hm, PAIRED)


@triton.jit
def store_h(h, h_ptr, hp_ptr, j, cols_N, I, stride_hm, PAIRED: tl.constexpr):
    """Pair j's h (float32 [BLOCK_N], columns cols_N) stored in h's dtype at h_ptr and, PAIRED, that value's
    float16 at hp_ptr in the float16 pairs' layout (`up_pairs4_kernel`)."""
    h = h.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + j.to(tl.int64) * stride_hm + cols_N, h, mask=cols_N < I)
    if PAIRED:
        paired_N = (cols_N & ~7) | ((cols_N & 3) << 1) | ((cols_N >> 2) & 1)
        tl.store(hp_ptr + j.to(tl.int64) * stride_hm + paired_N, h.to(tl.float32).to(tl.float16), mask=cols_N < I)


@triton.jit
def slot_weights(ids_ptr, weight_ptr, j, cols_N, D, E, w_ptr, stride_we, stride_wd, stride_se, stride_sn,
                 WEIGHTED: tl.constexpr):
    """Pair j's down-pass operands over the columns cols_N: (expert (0 for an unknown id), ok_N (no weight
    reads for an unknown id: its h row is 0 for -1, NaN otherwise), its rows' pointers, its rows' scale
    offsets, its routing weight (1 unweighted))."""
    expert, _, _, ok_N = pair_expert(ids_ptr, j, E, cols_N, D)
    w_N = w_ptr + expert * stride_we + cols_N.to(tl.int64) * stride_wd
    s_N = expert * stride_se + cols_N.to(tl.int64) * stride_sn
    if WEIGHTED:
        rw = tl.load(weight_ptr + j).to(tl.float32)
    else:
        rw = 1.0
    return expert, ok_N, w_N, s_N, rw


@triton.jit
def _slot4(h_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, weight_ptr, j, cols_N, D, steps, C, E, stride_hm, stride_we,
           stride_wd, stride_se, stride_sn, stride_sk, words, WEIGHTED: tl.constexpr, GROUP: tl.constexpr,
           MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_K: tl.constexpr, STEP: tl.constexpr, WAIT: tl.constexpr,
           WORDS4: tl.constexpr, HALF: tl.constexpr, b_ptr, stride_be, BIAS: tl.constexpr, hp_ptr,
           PAIRED: tl.constexpr, DEPTH: tl.constexpr):
    """[BLOCK_N] float32: pair j's routing weight times h[j] . Wd[ids[j], n] over the columns n of cols_N and
    the C columns of I from steps * STEP (`part_range`)."""
    expert, ok_N, w_N, s_N, rw = slot_weights(ids_ptr, weight_ptr, j, cols_N, D, E, w_ptr, stride_we, stride_wd,
                                              stride_se, stride_sn, WEIGHTED)
    h_row = h_ptr + j.to(tl.int64) * stride_hm + steps * STEP
    hp_row = h_row
    if PAIRED:  # h in float16 pairs (up_pairs4_kernel's PAIRED), h's strides
        hp_row = hp_ptr + j.to(tl.int64) * stride_hm + steps * STEP
    w_N += steps * (STEP // 2)  # bytes
    s_N += (steps * (STEP // GROUP)).to(tl.int64) * stride_sk  # groups (STEP is a multiple of GROUP)
    opaque = (expert >> 32).to(tl.uint32)  # as in up_pairs4_kernel
    acc = packed_dot(w_N, s_ptr + s_N, z_ptr + s_N, C, ok_N, h_row, words, opaque, stride_sk, GROUP, MXFP4, ZERO,
                     BLOCK_K, WAIT, WORDS4, HALF, hp_row, PAIRED, DEPTH)
    if BIAS:  # the expert's bias b[expert] (not for -1), once: in the first part of I
        bias = tl.load(b_ptr + expert * stride_be + cols_N, mask=ok_N, other=0.0).to(tl.float32)
        acc += tl.where(steps == 0, bias, 0.0)
    return rw * acc


@triton.jit
def down_pairs4_kernel(h_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ids_ptr, weight_ptr, part_ptr, count_ptr, D, I, E, top_k,
                       stride_hm, stride_we, stride_wd, stride_se, stride_sn, stride_sk, stride_ym, stride_cm,
                       WEIGHTED: tl.constexpr, GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr = False,
                       PARTS: tl.constexpr = 1, PDL: tl.constexpr = False, WORDS4: tl.constexpr = False,
                       HALF: tl.constexpr = 0, b_ptr=0, stride_be=0, BIAS: tl.constexpr = False, hp_ptr=0,
                       PAIRED: tl.constexpr = False, DEPTH: tl.constexpr = 1):
    """y[t, n] = sum over k of w[t, k] * (h[t*K + k] . Wd[ids[t*K + k], n]) for token t = program_id(0),
    columns n of tile program_id(1); the slots summed in float32 in slot order. h: [T*K, I]; Wd: packed
    [E, D, I / 2] uint8 with scales (and zero points) [E, D, ceil(I / GROUP)] by strides; y: [T, D].
    One program loops over the token's K slots; SPLIT: one program per slot (program_id(2)), the slot that
    arrives last summing the K partials in slot order (`split_slots.sum_split_slots`: the loop's sum, bit for
    bit; K times the programs for shapes with few columns). PARTS: each program takes one of PARTS ranges
    of I (`part_range`; program_id(2) is slot * PARTS + part under SPLIT, else the part), the last to arrive
    summing the token's partials in that order, so wide column tiles (each h chunk read once for BLOCK_N
    rows) still give every SM programs; deterministic, not the one-range sum bit for bit. PDL: launched as a
    programmatic dependent of the gate/up pass: each program loads its first chunk of weights, then waits for
    h. WORDS4: I a multiple of 32 (`load_words`). HALF: the products in float16 pairs (`packed_dot`). BIAS:
    each slot's expert's bias row b[ids[t*K + k]] ([E, D], row stride stride_be) added to its product before
    the routing weight (gpt-oss's experts, pairs4_gptoss.py). PAIRED: HALF's loop reads h's float16-pair copy
    at hp (`up_pairs4_kernel`'s PAIRED). DEPTH: chunks of words in flight ahead (`packed_dot`)."""
    t = tl.program_id(0)
    tile = tl.program_id(1)
    cols_N = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok_N = cols_N < D
    y_ptrs = y_ptr + t.to(tl.int64) * stride_ym + cols_N
    words = words_ok(w_ptr, stride_we, stride_wd, I)
    # a part is a whole number of chunks and of groups
    STEP: tl.constexpr = BLOCK_K if BLOCK_K % GROUP == 0 else (GROUP if GROUP % BLOCK_K == 0 else BLOCK_K * GROUP)
    q = tl.program_id(2)
    steps, C = part_range(q % PARTS, I, PARTS, STEP)
    if SPLIT:
        part = _slot4(h_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, weight_ptr, t * top_k + q // PARTS, cols_N, D, steps, C,
                      E, stride_hm, stride_we, stride_wd, stride_se, stride_sn, stride_sk, words, WEIGHTED, GROUP,
                      MXFP4, ZERO, BLOCK_K, STEP, PDL, WORDS4, HALF, b_ptr, stride_be, BIAS, hp_ptr, PAIRED, DEPTH)
        sum_split_slots(part, t * top_k * PARTS + q, t, tile, cols_N, col_ok_N, D, top_k * PARTS, part_ptr,
                        count_ptr, stride_cm, y_ptrs)
    else:
        acc = _slot4(h_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, weight_ptr, t * top_k, cols_N, D, steps, C, E, stride_hm,
                     stride_we, stride_wd, stride_se, stride_sn, stride_sk, words, WEIGHTED, GROUP, MXFP4, ZERO,
                     BLOCK_K, STEP, PDL, WORDS4, HALF, b_ptr, stride_be, BIAS, hp_ptr,
                     PAIRED, DEPTH)  # the first slot waits for h (PDL); the others find it written
        for slot in range(1, top_k):
            acc += _slot4(h_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, weight_ptr, t * top_k + slot, cols_N, D, steps, C, E,
                          stride_hm, stride_we, stride_wd, stride_se, stride_sn, stride_sk, words, WEIGHTED, GROUP,
                          MXFP4, ZERO, BLOCK_K, STEP, False, WORDS4, HALF, b_ptr, stride_be, BIAS, hp_ptr, PAIRED,
                          DEPTH)
        if PARTS > 1:
            sum_split_slots(acc, t * PARTS + q, t, tile, cols_N, col_ok_N, D, PARTS, part_ptr, count_ptr, stride_cm,
                            y_ptrs)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=col_ok_N)
