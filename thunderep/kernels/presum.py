"""The combine's pre-sum on the rank that computed the experts, in one pass over the expert outputs.

Shape legend: Q (token, k) pairs this rank computed, in local-slot order; M received rows, one per
(token, source rank); K experts per token (N = M K flat pairs); D hidden size.

Each received row's pairs are summed, routing-weighted, in float32 and in k order, into one output row
(`thunderep.comm.dispatcher.Dispatcher.combine_async`, and `sorted_mlp.forward_summed` after the experts'
kernels). Written with torch ops, that needs a zeroed [M K, D] float32 buffer, an index copy into it and a
sum over K: about (2 K + 2) M D 4 bytes moved for Q D 2 bytes of input. Here a Triton program per (row,
column block) looks up each of the row's K flat pairs in `positions` (where the pair sits among the Q
outputs, -1 where another rank computed it), accumulates y * w in float32 registers and writes the row
once: Q D + M D elements, the floor. No atomics, so the sums are deterministic.

    positions(pairs_Q, N)               int32 [N]: q where pairs_Q[q] = n, else -1 (no host sync)
    presum(y_QD, w_N, pairs_Q, M, K)    [M, D] in y's dtype; differentiable in y and w (backward: gathers)
    presum_at(y_QD, w, pos_N, M, K)     the same from `positions` (w [M K] or [M, K] strided), not differentiable
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["positions", "presum", "presum_at"]

MAX_BLOCK_D = 1024  # columns a program sums: 8 a thread on 4 warps, 16-byte loads of 16-bit rows


@triton.jit
def _presum_kernel(y_ptr, w_ptr, pos_ptr, out_ptr, D, stride_y, stride_out, stride_wm, stride_wk, K: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):  # the K loads are independent (masked, no branch): all in flight at once
        q = tl.load(pos_ptr + row * K + k)
        w = tl.where(q >= 0, tl.load(w_ptr + row * stride_wm + k * stride_wk).to(tl.float32), 0.0)
        here = inside & ((cols * 0 + q) >= 0)  # the pair's test on every column (a block mask)
        y = tl.load(y_ptr + tl.maximum(q, 0).to(tl.int64) * stride_y + cols, mask=here, other=0.0)
        acc += y.to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def positions(pairs_Q: torch.Tensor, N: int) -> torch.Tensor:
    """pairs_Q: [Q] distinct flat pairs (row * K + k) below N. Returns int32 [N]: pos[pairs_Q[q]] = q, -1
    for the pairs not listed."""
    pos = torch.full((N,), -1, dtype=torch.int32, device=pairs_Q.device)
    pos[pairs_Q.long()] = torch.arange(pairs_Q.shape[0], dtype=torch.int32, device=pairs_Q.device)
    return pos


def presum_at(y_QD: torch.Tensor, w: torch.Tensor, pos_N: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """[M, D]: row m = sum over k in order of w[m, k] * y_QD[pos_N[m K + k]] (pairs with pos -1 skipped),
    summed in float32 and returned in y's dtype. w: [M * K] flat, or [M, K] of any strides (the
    dispatcher's side rows as they arrived: read in place, no copy)."""
    D = y_QD.shape[-1]
    out = torch.empty(M, D, dtype=y_QD.dtype, device=y_QD.device)
    if M and D:
        y = y_QD.contiguous()
        w_MK = w if w.dim() == 2 else w.view(M, K)
        block = min(MAX_BLOCK_D, triton.next_power_of_2(D))
        _presum_kernel[(M, triton.cdiv(D, block))](y, w_MK, pos_N, out, D, y.stride(0), out.stride(0), w_MK.stride(0),
                                                   w_MK.stride(1), K=K, BLOCK=block,
                                                   num_warps=4 if block >= 512 else 1)
    return out


class _PreSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_QD, w_N, pairs_Q, M, K):
        ctx.save_for_backward(y_QD, w_N, pairs_Q)
        ctx.K = K
        return presum_at(y_QD, w_N, positions(pairs_Q, M * K), M, K)

    @staticmethod
    def backward(ctx, grad_MD):
        y_QD, w_N, pairs_Q = ctx.saved_tensors
        g_QD = grad_MD[torch.div(pairs_Q, ctx.K, rounding_mode="floor")].float()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = (g_QD * w_N[pairs_Q].float().unsqueeze(-1)).to(y_QD.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(w_N).index_copy_(0, pairs_Q.long(), (g_QD * y_QD.float()).sum(-1).to(w_N.dtype))
        return grad_y, grad_w, None, None, None


def presum(y_QD: torch.Tensor, w_N: torch.Tensor, pairs_Q: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """[M, D]: row m = sum over its pairs q (pairs_Q[q] // K == m), in k order, of w_N[pairs_Q[q]] * y_QD[q],
    summed in float32 and returned in y's dtype (`presum_at`; differentiable in y and w_N)."""
    return _PreSum.apply(y_QD, w_N, pairs_Q, M, K)
