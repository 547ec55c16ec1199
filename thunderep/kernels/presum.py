"""The combine's pre-sum on the rank that computed the experts, in one pass over the expert outputs.

Shape legend: Q (token, k) pairs this rank computed, in local-slot order; M received rows, one per
(token, source rank); K experts per token; D hidden size.

Each received row's pairs are summed, routing-weighted, in float32 and in k order, into one output row
(`thunderep.comm.dispatcher.Dispatcher.combine_async`). Written with torch ops, that needs a zeroed
[M * K, D] float32 buffer, an index copy into it and a sum over K: about (2 K + 2) M D 4 bytes moved for
Q D 2 bytes of input. Here a Triton program per (row, column block) reads the row's pairs through a CSR
index (pairs sorted by (row, k): `csr`), accumulates y * w in float32 registers and writes the row once:
Q D + M D elements, the floor.

    csr(pairs_Q, M, K)              (pair of each CSR entry [Q], row starts [M + 1]), no host sync
    presum(y_QD, w_Q, pairs_Q, M, K)  [M, D] in y's dtype; differentiable in y and w (backward: gathers)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["csr", "presum"]

BLOCK_D = 256


@triton.jit
def _presum_kernel(y_ptr, w_ptr, pair_ptr, start_ptr, out_ptr, D, stride_y, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    first = tl.load(start_ptr + row)
    last = tl.load(start_ptr + row + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(first, last):
        q = tl.load(pair_ptr + i).to(tl.int64)
        w = tl.load(w_ptr + q).to(tl.float32)
        y = tl.load(y_ptr + q * stride_y + cols, mask=inside, other=0.0).to(tl.float32)
        acc += y * w
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def csr(pairs_Q: torch.Tensor, M: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pairs_Q: int64 [Q] position row * K + k of each pair (distinct). Returns (the pair index of each CSR
    entry, sorted by row then k: int64 [Q]; where each row's entries start: int64 [M + 1])."""
    order_Q = torch.argsort(pairs_Q)
    rows_Q = torch.div(pairs_Q[order_Q], K, rounding_mode="floor")
    starts = torch.searchsorted(rows_Q, torch.arange(M + 1, device=pairs_Q.device, dtype=rows_Q.dtype))
    return order_Q, starts


def _launch(y_QD: torch.Tensor, w_Q: torch.Tensor, order_Q: torch.Tensor, starts: torch.Tensor, M: int) -> torch.Tensor:
    D = y_QD.shape[-1]
    out = torch.empty(M, D, dtype=y_QD.dtype, device=y_QD.device)
    if M and D:
        y = y_QD.contiguous()
        _presum_kernel[(M, triton.cdiv(D, BLOCK_D))](y, w_Q.contiguous(), order_Q, starts, out, D, y.stride(0),
                                                     out.stride(0), BLOCK=BLOCK_D, num_warps=4)
    return out


class _PreSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_QD, w_Q, order_Q, starts, rows_Q, M):
        ctx.save_for_backward(y_QD, w_Q, rows_Q)
        return _launch(y_QD, w_Q, order_Q, starts, M)

    @staticmethod
    def backward(ctx, grad_MD):
        y_QD, w_Q, rows_Q = ctx.saved_tensors
        g_QD = grad_MD[rows_Q].float()
        grad_y = (g_QD * w_Q.float().unsqueeze(-1)).to(y_QD.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (g_QD * y_QD.float()).sum(-1).to(w_Q.dtype) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None, None, None


def presum(y_QD: torch.Tensor, w_Q: torch.Tensor, pairs_Q: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """[M, D]: row m = sum over its pairs q (pairs_Q[q] // K == m), in k order, of w_Q[q] * y_QD[q], summed
    in float32 and returned in y's dtype."""
    order_Q, starts = csr(pairs_Q, M, K)
    rows_Q = torch.div(pairs_Q, K, rounding_mode="floor")
    return _PreSum.apply(y_QD, w_Q, order_Q, starts, rows_Q, M)
