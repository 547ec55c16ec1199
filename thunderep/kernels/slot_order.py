"""The receiving rank's pairs in local-slot order, and where each sits, without a sort.

Shape legend: M received rows (one per (token, source rank)), K experts per token, N = M K flat pairs
(row m, k), S this rank's slots, Q the pairs this rank computes, C chunks of BLOCK pairs.

ep mode's receiver knows each flat pair's local slot (S where another rank computes it) and, from the
split sizes on the host, how many pairs each slot gets. It needs them in slot order, stable (row order
within a slot: the sums stay deterministic), and, for the pre-sum, where each flat pair landed. Written
with torch ops that is a stable sort of the N slot keys and a scatter (`presum.positions`): several
launches and a radix sort's passes. Here, a counting sort:

  1. (more than one chunk) each chunk's pairs per slot, one histogram a chunk;
  2. one program per (slot, chunk) numbers the chunk's pairs of its slot in order (a block prefix sum)
     and writes their flat indices there: after the pairs of the slots below (all chunks) and the pairs
     of its slot in the chunks before, both summed by the program itself from the [C, S + 1] histogram
     table where it is small (at most PREFIX_MAX entries), else from two cumsums over it launched
     between the steps (one chunk: the chunk's pairs of the slots below); one more program per chunk
     marks the pairs of no slot here -1.

Nothing comes from the host but the count of pairs (to size the output), so at most two launches for up
to about PREFIX_MAX / S chunks: a few launches more cost ep mode's receiver more host time than the
device spends here, at every size below a few thousand tokens (docs/benchmarks). Beyond SORT_FROM pairs
the (S + 1) programs a chunk cost more than a radix sort: there it is the stable sort and
`presum.positions`.

    slot_order(slot_MK, counts_S)  -> (pairs_Q int32 [Q], positions_N int32 [N]), no host sync

pairs_Q is int32, the expert kernels' index type (`ops.moe_mlp_summed` takes it without a conversion);
N is below 2 ** 31. A decode step's few pairs are one chunk: one launch. Every program of step 2 reads
its chunk's keys, so (S + 1) N reads in all, mostly from L2, spread over (S + 1) C programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .presum import positions

__all__ = ["MAX_BLOCK", "PREFIX_MAX", "SORT_FROM", "slot_order"]

MAX_BLOCK = 1024  # pairs a chunk (more pairs: more chunks, each numbered by its own programs)
SORT_FROM = 1 << 17  # pairs from which a stable sort and a scatter run instead (measured slower from 261k on)
PREFIX_MAX = 4096  # histogram entries (chunks x bins, powers of two) a program sums itself: 32 a thread


@triton.jit
def _key(slot_ptr, n, N, stride_m, stride_k, K: tl.constexpr):
    """int32 slot of flat pairs n (-1 past N): whole numbers, also where held as floats (the side rows)."""
    at = slot_ptr + (n // K).to(tl.int64) * stride_m + (n % K) * stride_k
    return tl.load(at, mask=n < N, other=-1).to(tl.int32)


@triton.jit(do_not_specialize=["N"])
def _chunk_counts_kernel(slot_ptr, N, stride_m, stride_k, counts_ptr, S, K: tl.constexpr, BLOCK: tl.constexpr,
                         BINS: tl.constexpr):
    c = tl.program_id(0)
    n = c * BLOCK + tl.arange(0, BLOCK)
    key = _key(slot_ptr, n, N, stride_m, stride_k, K)
    counts = tl.histogram(tl.where(n < N, tl.minimum(key, S), S + 1), BINS)  # bin S: another rank's pairs
    b = tl.arange(0, BINS)
    tl.store(counts_ptr + c * (S + 1) + b, counts, mask=b <= S)


@triton.jit
def _summed_start(counts_ptr, s, c, chunks, S, CHUNKS: tl.constexpr, BINS: tl.constexpr):
    """The pairs of the slots below s (all chunks) and of slot s in the chunks before c, from the [chunks,
    S + 1] histogram table (CHUNKS x BINS: powers of two at least its size)."""
    rows = tl.arange(0, CHUNKS)[:, None]
    bins = tl.arange(0, BINS)[None, :]
    table = tl.load(counts_ptr + rows * (S + 1) + bins, mask=(rows < chunks) & (bins <= S), other=0)
    wanted = (bins < s) | ((bins == s) & (rows < c))
    return tl.sum(tl.sum(tl.where(wanted, table, 0), axis=1), axis=0)


@triton.jit(do_not_specialize=["N", "Q", "chunks"])
def _slot_order_kernel(slot_ptr, N, Q, stride_m, stride_k, base_ptr, ahead_ptr, counts_ptr, order_ptr, pos_ptr, S,
                       chunks, K: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr, SUMMED: tl.constexpr,
                       CHUNKS: tl.constexpr, BINS: tl.constexpr):
    s, c = tl.program_id(0), tl.program_id(1)
    n = c * BLOCK + tl.arange(0, BLOCK)
    key = _key(slot_ptr, n, N, stride_m, stride_k, K)
    if s < S:  # slot s: this chunk's pairs of it, in order, after the slots below and the chunks before
        if SUMMED:  # from the histogram table, summed here
            start = _summed_start(counts_ptr, s, c, chunks, S, CHUNKS, BINS)
        elif CHUNKED:  # the slots below (all chunks), and slot s's running sum over chunks less this chunk's
            start = tl.load(base_ptr + s) + tl.load(ahead_ptr + c * (S + 1) + s) - tl.load(counts_ptr + c * (S + 1) + s)
        else:  # one chunk: the pairs of the slots below are in it
            start = tl.sum(((n < N) & (key < s)).to(tl.int32), axis=0)
        hit = (n < N) & (key == s)
        pos = start + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        hit = hit & (pos < Q)  # never past the pairs the host counts allow for, whatever the keys say
        tl.store(order_ptr + pos, n, mask=hit)
        tl.store(pos_ptr + n, pos, mask=hit)
    else:  # the pairs another rank computes: -1
        tl.store(pos_ptr + n, tl.full([BLOCK], -1, tl.int32), mask=(n < N) & (key >= S))


def slot_order(slot_MK: torch.Tensor, counts_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_MK: [M, K] (or [N]) local slot of each flat pair m * K + k on the device, whole numbers >= 0 of
    any dtype and strides (the side rows' float32 columns as they arrived; S or more: another rank's);
    counts_S: int64 [S] on the host, the pairs of each slot. Returns (pairs_Q int32 [Q]: the flat pairs of
    each slot in order, slot after slot; positions_N int32 [N]: q where pairs_Q[q] = n, else -1)."""
    slot_MK = slot_MK if slot_MK.dim() == 2 else slot_MK.reshape(-1, 1)
    K, S, N = slot_MK.shape[1], counts_S.shape[0], slot_MK.numel()
    Q, device = int(counts_S.sum()), slot_MK.device
    if N > SORT_FROM:  # (S + 1) programs a chunk cost more than a radix sort's passes (docs/benchmarks)
        key = torch.int16 if S < 2**15 else torch.int32
        pairs_Q = torch.argsort(slot_MK.to(key).reshape(-1), stable=True)[:Q]
        return pairs_Q.to(torch.int32), positions(pairs_Q, N)
    pairs_Q = torch.empty(Q, dtype=torch.int32, device=device)
    positions_N = torch.empty(N, dtype=torch.int32, device=device)
    if not N:
        return pairs_Q, positions_N
    block = max(128, min(MAX_BLOCK, triton.next_power_of_2(N)))
    chunks = triton.cdiv(N, block)
    strides = (slot_MK.stride(0), slot_MK.stride(1))
    base = ahead = chunk_counts = positions_N  # not read with one chunk
    bins, rows = triton.next_power_of_2(S + 2), triton.next_power_of_2(chunks)
    summed = chunks > 1 and rows * bins <= PREFIX_MAX
    if chunks > 1:
        chunk_counts = torch.empty(chunks, S + 1, dtype=torch.int32, device=device)
        _chunk_counts_kernel[(chunks,)](slot_MK, N, *strides, chunk_counts, S, K=K, BLOCK=block, BINS=bins,
                                        num_warps=4)
        if not summed:
            ahead = chunk_counts.cumsum(0, dtype=torch.int32)
            base = ahead[-1].cumsum(0, dtype=torch.int32) - ahead[-1]  # the pairs of the slots below, all chunks
    _slot_order_kernel[(S + 1, chunks)](slot_MK, N, Q, *strides, base, ahead, chunk_counts, pairs_Q, positions_N, S,
                                        chunks, K=K, BLOCK=block, CHUNKED=chunks > 1, SUMMED=summed,
                                        CHUNKS=rows if summed else 1, BINS=bins if summed else 1, num_warps=4)
    return pairs_Q, positions_N
