"""The decode down pass split per slot (pairs.py, pairs4.py: SPLIT): one program per (token, slot, column
tile) instead of one per (token, column tile) looping over the K slots, for shapes whose few columns leave
SMs idle. Each program stores its float32 partial and counts itself; the token's slot that arrives last
sums the K partials in slot order, so the output is the loop's bit for bit, with no float atomics. The
counts start at 0 (the gate/up pass zeroes them, `zero_counts`) and each down launch leaves them at 0,
also when the autotuner reruns it. The 4-bit down pass also cuts I into parts (pairs4.py PARTS,
`part_range`): the same sum over slot-and-part partials, in that order.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["part_range", "sum_split_slots", "zero_counts"]


@triton.jit
def zero_counts(count_ptr, j, top_k, n_counts):
    """Pair j's gate/up program of column tile 0, if j is its token's first pair: the token's n_counts
    counts (count: [T, n_counts]) set to 0 for the split down pass (`sum_split_slots`)."""
    if (tl.program_id(1) == 0) & (j % top_k == 0):
        c_C = tl.arange(0, 128)
        for c0 in range(0, n_counts, 128):
            tl.store(count_ptr + (j // top_k).to(tl.int64) * n_counts + c0 + c_C, tl.zeros((128,), dtype=tl.int32),
                     mask=c_C < n_counts - c0)


@triton.jit
def sum_split_slots(part_N, j, t, tile, cols_N, col_ok_N, D, top_k, part_ptr, count_ptr, stride_cm, y_ptrs):
    """The split down pass's end for pair j (token t, column tile `tile`): its float32 partial part_N stored
    at part[j], itself counted in count[t, tile] (acquire/release); the token's slot that arrives last sums
    the K partials in slot order, from 0 (the slot loop's sum, bit for bit), stores y and sets the count
    back to 0."""
    tl.store(part_ptr + j.to(tl.int64) * D + cols_N, part_N, mask=col_ok_N)
    count = count_ptr + t.to(tl.int64) * stride_cm + tile
    if tl.atomic_add(count, 1, sem="acq_rel") == top_k - 1:  # the token's other slots are stored
        y = tl.zeros(part_N.shape, dtype=tl.float32)
        part_ptrs = part_ptr + (t * top_k).to(tl.int64) * D + cols_N
        for _ in range(0, top_k):
            y += tl.load(part_ptrs, mask=col_ok_N, other=0.0, cache_modifier=".cg")
            part_ptrs += D
        tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=col_ok_N)
        tl.store(count, 0)


@triton.jit
def part_range(part, C, PARTS: tl.constexpr, STEP: tl.constexpr):
    """(steps, length) of part `part` of C columns cut in PARTS: each part a whole number of STEP columns
    (the last shorter, any past C empty: length 0), starting at column steps * STEP. Offsets are built as
    steps times a constant, so the compiler still sees the words' alignment (16-byte loads, `load_words`)."""
    size = tl.cdiv(tl.cdiv(C, PARTS), STEP)
    steps = part * size
    return steps, tl.maximum(tl.minimum(size * STEP, C - steps * STEP), 0)
