"""The 4-bit pair kernels' weight loads (pairs4.py): a chunk of packed rows as 32-bit words, and the ring that
keeps the next DEPTH chunks' words in flight while a loop converts the current one."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["first_words", "load_words", "next_words", "words_ok"]


@triton.jit
def words_ok(w_ptr, stride_we, stride_wr, C):
    """Whether a matrix's rows can be read as 32-bit words: 4-byte aligned (base and strides) and C a
    multiple of 8 (whole words). Else `pairs4.packed_dot` reads bytes."""
    return ((w_ptr.to(tl.int64) | stride_we | stride_wr | (C // 2)) % 4 == 0) & (C % 8 == 0)


@triton.jit
def load_words(w_ptrs_N, k0, C, ok_N, HW: tl.constexpr, WORDS4: tl.constexpr = False):
    """[BLOCK_N, HW] uint32: the chunk at column k0 of each row from w_ptrs_N (its row's column 0) as 32-bit
    words, 0 past C and in rows not ok_N (no memory read there). WORDS4 (C a multiple of 32): the row's
    words counted as (C // 32) * 4, which the compiler sees is a multiple of 4, so the mask is constant over
    each run of 4 words and the loads are 16 bytes wide (as C // 8, 8 bytes: half of each 32-byte sector
    per load, the other half read again by the next)."""
    q_W = k0 // 8 + tl.arange(0, HW)
    ok = ok_N[:, None] & (q_W < ((C // 32) * 4 if WORDS4 else C // 8))[None, :]
    return tl.load(w_ptrs_N.to(tl.pointer_type(tl.uint32))[:, None] + q_W[None, :], mask=ok, other=0)


@triton.jit
def first_words(w_ptrs_N, C, ok_N, BLOCK_K: tl.constexpr, WORDS4: tl.constexpr, DEPTH: tl.constexpr):
    """(the first chunk's words, the second's: DEPTH 1 the first again) as a loop keeping DEPTH chunks in flight
    starts."""
    first = load_words(w_ptrs_N, 0, C, ok_N, BLOCK_K // 8, WORDS4)
    second = first
    if DEPTH == 2:
        second = load_words(w_ptrs_N, BLOCK_K, C, ok_N, BLOCK_K // 8, WORDS4)
    return first, second


@triton.jit
def next_words(w_next, w_after, w_ptrs_N, k0, C, ok_N, BLOCK_K: tl.constexpr, WORDS4: tl.constexpr,
               DEPTH: tl.constexpr):
    """(chunk k0's words, the next chunk's, the one after's) at a loop step's top, the load DEPTH chunks ahead
    issued (past C: not read)."""
    if DEPTH == 2:
        return w_next, w_after, load_words(w_ptrs_N, k0 + 2 * BLOCK_K, C, ok_N, BLOCK_K // 8, WORDS4)
    return w_next, load_words(w_ptrs_N, k0 + BLOCK_K, C, ok_N, BLOCK_K // 8, WORDS4), w_after

