"""The vector side of the 4-bit decode kernels (pairs4.py, pairs4_gptoss.py): a chunk of the vector split
into the 8 planes a packed word's values meet, their sums per word, and its largest magnitude. Shape legend
as in pairs4.py (HW: a chunk's 32-bit words, 8 columns each)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["largest", "planes", "vector", "vector_words", "word_sums"]


@triton.jit
def vector(v_ptr, c, C):
    """The vector's elements at columns c (zero past C) as float32."""
    return tl.load(v_ptr + c, mask=c < C, other=0.0).to(tl.float32)


@triton.jit
def planes(v_ptr, k0, C, HW: tl.constexpr):
    """The vector's chunk at column k0 (zero past C, float32) as its 8 planes [HW] (plane j:
    columns k0 + 8 q + j), in the order (0, 4, 1, 5, 2, 6, 3, 7): loaded whole (wide loads) and split in
    registers."""
    c_K = k0 + tl.arange(0, 8 * HW)
    v = tl.load(v_ptr + c_K, mask=c_K < C, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(v, (HW, 4, 2)))  # columns 8 q + (0, 2, 4, 6) and 8 q + (1, 3, 5, 7)
    e04, e26 = tl.split(tl.reshape(even, (HW, 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (HW, 2, 2)))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x4, x1, x5, x2, x6, x3, x7


@triton.jit
def vector_words(v_ptr, k0, C, HW: tl.constexpr):
    """A 16-bit vector's chunk at column k0 (C a multiple of 8; zero past C) as the 4 32-bit words of each
    word position q ([HW] each: columns (8q, 8q+1), (8q+2, 8q+3), (8q+4, 8q+5), (8q+6, 8q+7), the first in the
    low half): its 16 bytes in one load, split in registers (the load's own layout: no shared memory)."""
    q = k0 // 8 + tl.arange(0, HW)
    p = tl.load(v_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + 4 * q[:, None] + tl.arange(0, 4)[None, :],
                mask=(8 * q < C)[:, None], other=0)
    a, b = tl.split(tl.reshape(p, (HW, 2, 2)))  # a: the words of columns (8q, 8q+1), (8q+4, 8q+5); b: the others
    w01, w45 = tl.split(a)
    w23, w67 = tl.split(b)
    return w01, w23, w45, w67


@triton.jit
def word_sums(x0, x4, x1, x5, x2, x6, x3, x7):
    """[HW] the vector's sum over each word's 8 columns, from its planes (`planes`' order)."""
    return ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7))


@triton.jit
def largest(v_ptr, C, BLOCK_K: tl.constexpr):
    """The largest magnitude of the C elements at v_ptr (float32), chunk by chunk."""
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        c_K = k0 + tl.arange(0, BLOCK_K)
        top = tl.maximum(top, tl.abs(tl.load(v_ptr + c_K, mask=c_K < C, other=0.0).to(tl.float32)))
    return tl.max(top, 0)
