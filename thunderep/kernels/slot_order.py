"""The receiving rank's pairs in local-slot order, and where each sits, in one launch.

Shape legend: M received rows (one per (token, source rank)), K experts per token, N = M K flat pairs
(row m, k), S this rank's slots, Q the pairs this rank computes.

ep mode's receiver knows each flat pair's local slot (S where another rank computes it) and, from the
split sizes on the host, how many pairs each slot gets. It needs them in slot order, stable (row order
within a slot: the sums stay deterministic), and, for the pre-sum, where each flat pair landed. Written
with torch ops that is a stable sort of the N slot keys and a scatter (`presum.positions`): several
launches and a radix sort's passes. Here one program per slot walks the N keys in blocks and writes its
pairs' flat indices at the slot's offset (an exclusive sum of the host counts) in order, a block prefix
sum numbering them; one more program marks the pairs of no slot here -1:

    slot_order(slot_MK, counts_S)  -> (pairs_Q int64 [Q], positions_N int32 [N]), no host sync

Every program reads all N keys: (S + 1) N reads, mostly from L2, where a sort moves the keys and indices
several times; at S = 32 slots and 118k pairs (a 4-rank Qwen3-30B-A3B layer at 4096 tokens a rank) that is
about 16 MB of float32 keys. A program walks the keys MAX_BLOCK at a time, so few slots and many pairs (a
2-rank Mixtral layer: 5 programs) take N / 4096 steps each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_BLOCK", "slot_order"]

MAX_BLOCK = 4096  # keys a program takes per step at most (fewer steps where one slot's program walks many keys)


@triton.jit(do_not_specialize=["N"])
def _slot_order_kernel(slot_ptr, N, stride_m, stride_k, base_ptr, order_ptr, pos_ptr, S, K: tl.constexpr,
                       BLOCK: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(base_ptr + s)  # program S: where the others' pairs would begin (not used)
    running = start * 0
    for off in range(0, N, BLOCK):
        n = off + tl.arange(0, BLOCK)
        at = slot_ptr + (n // K).to(tl.int64) * stride_m + (n % K) * stride_k
        key = tl.load(at, mask=n < N, other=-1).to(tl.int32)  # whole numbers, also where held as floats
        if s < S:  # slot s: its pairs' flat indices at its offset, in order, and where each landed
            hit = (n < N) & (key == s)
            pos = start + running + tl.cumsum(hit.to(tl.int32), axis=0) - 1  # in order among the block's hits
            tl.store(order_ptr + pos, n.to(tl.int64), mask=hit)
            tl.store(pos_ptr + n, pos, mask=hit)
            running += tl.sum(hit.to(tl.int32), axis=0)
        else:  # the pairs another rank computes: -1
            tl.store(pos_ptr + n, tl.full([BLOCK], -1, tl.int32), mask=(n < N) & (key >= S))


def slot_order(slot_MK: torch.Tensor, counts_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_MK: [M, K] (or [N]) local slot of each flat pair m * K + k on the device, whole numbers >= 0 of
    any dtype and strides (the side rows' float32 columns as they arrived; S or more: another rank's);
    counts_S: int64 [S] on the host, the pairs of each slot. Returns (pairs_Q int64 [Q]: the flat pairs of
    each slot in order, slot after slot; positions_N int32 [N]: q where pairs_Q[q] = n, else -1)."""
    slot_MK = slot_MK if slot_MK.dim() == 2 else slot_MK.reshape(-1, 1)
    (M, K), S = slot_MK.shape, counts_S.shape[0]
    counts = [int(c) for c in counts_S.tolist()]
    base = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    device = slot_MK.device
    base = base.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else base.to(device)
    pairs_Q = torch.empty(sum(counts), dtype=torch.int64, device=device)
    positions_N = torch.empty(M * K, dtype=torch.int32, device=device)
    if M * K:
        block = max(128, min(MAX_BLOCK, triton.next_power_of_2(M * K)))
        _slot_order_kernel[(S + 1,)](slot_MK, M * K, slot_MK.stride(0), slot_MK.stride(1), base, pairs_Q, positions_N,
                                     S, K=K, BLOCK=block, num_warps=8 if block > 1024 else 4)
    return pairs_Q, positions_N
