"""The routed-expert MLP as torch.library custom ops over the Triton kernels, and its public entries.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N routed rows in expert order.

    thunderep::moe_mlp(x, w_gate_up_E2ID, w_down_EDI, order_N, counts_E, weights, top_k, ...)
        -> (y, h_NI, gu_N2I)
    thunderep::moe_mlp_backward(dy, x, ..., h_NI, gu_N2I) -> (dx, dw_gate_up, dw_down, dweights)
    thunderep::moe_mlp_fp8(x, FP8 weights as tensors, ...) -> y            (inference)
    moe_mlp_summed(x_TD, ..., counts_E, order_Q, weights_N, top_k) -> y_TD (some pairs; inference, eager)
    thunderep::route(ids_TK, weights_TK, E, dtype) -> (order_N, counts_E, weights_N)
    thunderep::moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, ...) -> y_TD
    thunderep::moe_mlp_pairs_fp8(x_TD, FP8 weights as tensors, ...) -> y_TD
    thunderep::moe_mlp_pairs_int4(x_TD, 4-bit weights as tensors, ...) -> y_TD    (inference)
    thunderep::moe_mlp_pairs_int4_gptoss(x_TD, 4-bit weights and biases, ...) -> y_TD    (inference)

Two entry modes of moe_mlp, one op:
  * gathered (`order_N` given; routed_moe_mlp, below): x is x_TD; row r reads token order_N[r] // K;
    the down projection's epilogue multiplies by weights[order_N[r]] (the flat [T*K] routing weights)
    and writes flat row order_N[r]; y = y_TKD.sum(K) -> [T, D].
  * sorted (`order_N` None, the expert-parallel runtime): x is x_ND already grouped by expert; y is
    the unweighted [N, D] in the same order.

`routed_moe_mlp` (FusedExperts' entry, from the router's ids and weights) runs inference on one token,
and on a few more where paths.pairs_win chooses them, through the pair kernels (decode.py), with no
sort; otherwise it sorts the pairs by expert and calls `moe_mlp` (gathered mode).

What the ops run is in sorted_mlp.py and decode.py, their tile configs in tiles.py, the choice of path
in paths.py and grouped_gemm.gemm_path. `h_NI` and `gu_N2I` are returned for backward only (empty
[0, ...] unless `save`). The ops carry `register_fake`, so torch.compile traces through them;
`register_autograd` chains forward to backward (the FP8 and pair ops are inference-only). Eager calls
run the implementations directly: the dispatcher's custom-op layer costs host time comparable to a
decode step's GPU time.

4-bit weights (int4.Int4Weight, MXFP4 or int4) run the pair kernels of pairs4.py, which read the
packed tiles; on the sorted path (prompts, and 2 to 16 tokens where the sorted route measured faster)
`moe_mlp` and `moe_mlp_summed` run the sorted kernels of sorted4.py, which read them too, where
`paths.sorted4_packed` says so, else dequantize them into x's dtype for the call, one layer's experts at
a time, and run the 16-bit kernels. gpt-oss's experts (biases, clamped SwiGLU) run pairs4_gptoss.py's pair kernels
(`moe_mlp_pairs_gptoss`, decode only).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from . import checks, decode, pairs4_gptoss, paths, sorted_mlp
from . import grouped_gemm as G
from .checks import check_fp8, check_int4, supported
from .fp8 import Fp8Weight
from .int4 import Int4Weight
from .tuning import kernel_configs

__all__ = ["check_fp8", "kernel_configs", "moe_mlp", "moe_mlp_pairs", "moe_mlp_pairs_gptoss", "moe_mlp_summed",
           "pairs_if_decode", "route", "routed_moe_mlp", "supported"]


_moe_mlp_op = torch.library.custom_op("thunderep::moe_mlp", mutates_args=())(sorted_mlp.forward)


@_moe_mlp_op.register_fake
def _(x, w_gate_up, w_down, order, counts, weights, top_k, activation, interleaved, save, gemm):
    E, I2, D = w_gate_up.shape
    n_rows = order.shape[0] if order is not None else x.shape[0]
    rows = n_rows if save else 0
    return x.new_empty(x.shape[0], D), x.new_empty(rows, I2 // 2), x.new_empty(rows, I2)


_moe_mlp_backward_op = torch.library.custom_op("thunderep::moe_mlp_backward", mutates_args=())(sorted_mlp.backward)


@_moe_mlp_backward_op.register_fake
def _(dy, x, w_gate_up, w_down, order, counts, weights, h, gu, top_k, activation, interleaved, gemm):
    n = h.shape[0] if weights is not None else 0
    dtype = weights.dtype if weights is not None else x.dtype
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down), x.new_empty(n, dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, w_gate_up, w_down, order, counts, weights, top_k, activation, interleaved, save, gemm = inputs
    _, h, gu = output
    ctx.save_for_backward(x, w_gate_up, w_down, order, counts, weights, h, gu)
    ctx.set_materialize_grads(False)  # h and gu are never used downstream: no zero [N, 3I] gradients
    ctx.top_k, ctx.activation, ctx.interleaved, ctx.save = top_k, activation, interleaved, save


def _backward(ctx, dy, dh, dgu, backward_op=_moe_mlp_backward_op):
    """The op's autograd formula. `backward_op`: the backward custom op (what torch.compile traces, as an
    opaque node) or, from the eager autograd.Function, its implementation."""
    x, w_gate_up, w_down, order, counts, weights, h, gu = ctx.saved_tensors
    if dy is None:  # y did not reach the loss
        return (None,) * 11
    if not ctx.save:
        raise RuntimeError("thunderep::moe_mlp ran with save=False: its intermediates were not kept for backward")
    E, I2, D = w_gate_up.shape
    gemm = G.gemm_path(dy, h.shape[0], E, D, I2 // 2, backward=True)
    dx, dw_gu, dw_d, dweights = backward_op(
        dy, x, w_gate_up, w_down, order, counts, weights, h, gu, ctx.top_k, ctx.activation, ctx.interleaved,
        gemm)
    return dx, dw_gu, dw_d, None, None, (dweights if weights is not None else None), None, None, None, None, None


_moe_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def _moe_mlp_fp8_impl(
    x: torch.Tensor, q_gate_up: torch.Tensor, s_gate_up: torch.Tensor, block_gate_up: list[int],
    q_down: torch.Tensor, s_down: torch.Tensor, block_down: list[int], order: Optional[torch.Tensor],
    counts: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, activation: str, interleaved: bool,
    w8a8: bool = False,
) -> torch.Tensor:
    """The forward of `sorted_mlp.forward` on FP8 weights (fp8.Fp8Weight, as tensors for the custom op)."""
    w_gu = Fp8Weight(q_gate_up, s_gate_up, tuple(block_gate_up), x.dtype, w8a8)
    w_d = Fp8Weight(q_down, s_down, tuple(block_down), x.dtype, w8a8)
    y, _, _ = sorted_mlp.forward(x, w_gu, w_d, order, counts, weights, top_k, activation, interleaved, False, "triton")
    return y


_moe_mlp_fp8_op = torch.library.custom_op("thunderep::moe_mlp_fp8", mutates_args=())(_moe_mlp_fp8_impl)


@_moe_mlp_fp8_op.register_fake
def _(x, q_gate_up, s_gate_up, block_gate_up, q_down, s_down, block_down, order, counts, weights, top_k,
      activation, interleaved, w8a8=False):
    return x.new_empty(x.shape[0], q_gate_up.shape[2])


class _MoeMlpFunction(torch.autograd.Function):
    """The op's autograd in eager mode without the dispatcher's custom-op layer, whose host time a small
    training step's kernels do not cover (docs/BENCHMARKS.md, "Host time of small steps"); torch.compile
    traces the custom ops instead. Same implementation, context and backward as the op."""

    @staticmethod
    def forward(ctx, *inputs):
        output = sorted_mlp.forward(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[1], output[2])  # h and gu: kept for backward only
        return output

    @staticmethod
    def backward(ctx, dy, dh, dgu):
        return _backward(ctx, dy, dh, dgu, backward_op=sorted_mlp.backward)


def moe_mlp(
    x: torch.Tensor,
    w_gate_up_E2ID: torch.Tensor,
    w_down_EDI: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    order_N: torch.Tensor | None = None,
    weights_N: torch.Tensor | None = None,
    top_k: int = 1,
    activation: str = "silu",
    interleaved: bool = False,
) -> torch.Tensor:
    """The expert MLP through the Triton kernels.

    x: [T, D] with `order_N` (gathered mode) or [N, D] sorted by expert (sorted mode).
    w_gate_up_E2ID: [E, 2I, D]; w_down_EDI: [E, D, I] (Hugging Face 5.x layout), x's dtype; weights that
    are not contiguous (a transposed view) are copied on every call.
    counts_E: [E] rows per expert (any integer dtype, any device; moved to x's device), >= 0, summing to
    N. Checked where x is on the CPU; on a GPU that would cost a sync, so the kernels instead
    take negative counts as 0 and read and write no row past N: rows the counts leave out come out
    undefined, never out of bounds.
    order_N: [N] integer, the flat (token * top_k + slot) pair of each sorted row, in [0, N): checked
    where x is on the CPU; on a GPU a pair outside it reads out of bounds.
    weights_N: [T * K] routing weights in flat order (gathered mode only).
    Returns y_TD (gathered: weighted and summed over each token's K rows) or y_ND (sorted, unweighted).
    """
    checks.check_integer("counts_E", counts_E)
    if order_N is not None:
        checks.check_integer("order_N", order_N)
    counts = counts_E.to(device=x.device, dtype=torch.int32, non_blocking=True)
    order = order_N.to(torch.int32) if order_N is not None else None
    weights = weights_N.reshape(-1).contiguous() if weights_N is not None else None
    if weights is not None and order is None:
        raise InputError("weights_N needs order_N (the sorted mode returns unweighted rows)")
    if isinstance(w_gate_up_E2ID, Fp8Weight) or isinstance(w_down_EDI, Fp8Weight):
        check_fp8(x, w_gate_up_E2ID, w_down_EDI, weights)
        op = _moe_mlp_fp8_op if torch.compiler.is_compiling() else _moe_mlp_fp8_impl
        w_gu, w_d = w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous()
        return op(x.contiguous(), w_gu.q, w_gu.scale, list(w_gu.block), w_d.q, w_d.scale, list(w_d.block), order,
                  counts, weights, top_k, activation, interleaved, w_gu.w8a8)
    n_rows = order.shape[0] if order is not None else x.shape[0]
    if isinstance(w_gate_up_E2ID, Int4Weight) or isinstance(w_down_EDI, Int4Weight):
        check_int4(x, w_gate_up_E2ID, w_down_EDI, weights)
        if paths.sorted4_packed(n_rows, w_down_EDI.shape[0]) and not torch.compiler.is_compiling():
            return sorted_mlp.forward(x.contiguous(), w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous(), order,
                                      counts, weights, top_k, activation, interleaved, False, "triton")[0]
        w_gate_up_E2ID, w_down_EDI = w_gate_up_E2ID.dequantize(), w_down_EDI.dequantize()  # (above)
    needs_grad = paths.needs_grad(x, w_gate_up_E2ID, w_down_EDI, weights)
    E, I2, D = w_gate_up_E2ID.shape
    gemm = G.gemm_path(x, n_rows, E, D, I2 // 2)
    # Eager mode calls the implementation itself (inference) or through an autograd.Function (training):
    # the dispatcher's custom-op layer costs host time comparable to a decode step's GPU time;
    # torch.compile needs the op.
    if torch.compiler.is_compiling():
        op = _moe_mlp_op
    else:
        op = _MoeMlpFunction.apply if needs_grad else sorted_mlp.forward
    y, _, _ = op(x.contiguous(), w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous(), order, counts, weights,
                 top_k, activation, interleaved, needs_grad, gemm)
    return y


def moe_mlp_summed(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, counts_E: torch.Tensor,
                   *, order_Q: torch.Tensor, weights_N: torch.Tensor, top_k: int, activation: str = "silu",
                   interleaved: bool = False, positions_N: torch.Tensor | None = None) -> torch.Tensor | None:
    """Some of the (token, k) pairs, weighted and summed per token: y_TD [T, D] in x's dtype (float32 sums).

    The receiving rank of expert parallelism: x_TD its received rows (one per (token, rank)), order_Q the
    flat pairs t * top_k + k its experts compute, grouped by expert by counts_E, weights_N [T * top_k] or
    [T, top_k] (any strides: read in place) every pair's routing weight. The gather of the rows is the up
    kernel's A load (or one gather for the grouped GEMM route), the weighting and the per-row sum one pass
    over the outputs after the down kernel (sorted_mlp.forward_summed, presum.py; positions_N: int32
    [T * top_k], where each flat pair sits in order_Q, -1 for the others, where the caller has it:
    `kernels.slot_order`). Inference
    only: None where gradients are needed (the caller then expands the rows and runs `moe_mlp`, whose
    backward exists). FP8 and 4-bit weights as in `moe_mlp`."""
    checks.check_integer("counts_E", counts_E)
    checks.check_integer("order_Q", order_Q)
    packed = isinstance(w_gate_up_E2ID, Int4Weight) or isinstance(w_down_EDI, Int4Weight)
    if packed:
        check_int4(x_TD, w_gate_up_E2ID, w_down_EDI, weights_N)
        if not paths.sorted4_packed(order_Q.shape[0], w_down_EDI.shape[0]):
            w_gate_up_E2ID, w_down_EDI = w_gate_up_E2ID.dequantize(), w_down_EDI.dequantize()
            packed = False
    fp8 = isinstance(w_gate_up_E2ID, Fp8Weight) or isinstance(w_down_EDI, Fp8Weight)
    if fp8:
        check_fp8(x_TD, w_gate_up_E2ID, w_down_EDI, weights_N)
    elif paths.needs_grad(x_TD, w_gate_up_E2ID, w_down_EDI, weights_N):
        return None
    counts = counts_E.to(device=x_TD.device, dtype=torch.int32, non_blocking=True)
    E, I2, D = w_gate_up_E2ID.shape
    gemm = "triton" if fp8 or packed else G.gemm_path(x_TD, order_Q.shape[0], E, D, I2 // 2)
    weights = weights_N if weights_N.dim() == 2 else weights_N.reshape(-1)  # [T, K] read in place, strided or not
    return sorted_mlp.forward_summed(x_TD.contiguous(), w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous(),
                                     order_Q.to(torch.int32), counts, weights, top_k, activation, interleaved, gemm,
                                     positions_N)


_route_op = torch.library.custom_op("thunderep::route", mutates_args=())(sorted_mlp.route)


@_route_op.register_fake
def _(ids_TK, weights_TK, E, dtype):
    N = ids_TK.numel()
    w_dtype = weights_TK.dtype if weights_TK is not None else dtype
    return (ids_TK.new_empty(N, dtype=torch.int32), ids_TK.new_empty(E, dtype=torch.int32),
            ids_TK.new_empty(N, dtype=w_dtype))


def route(ids_TK: torch.Tensor, weights_TK: torch.Tensor | None, E: int, dtype: torch.dtype):
    """(order_N [N] int32, counts_E [E] int32, weights_N [N]) for at most paths.ROUTE_MAX_PAIRS pairs, through
    passes.route_kernel. ids_TK: [T, K] integer; weights_TK: [T, K] or None (weights_N is then 1 in `dtype`).
    Ids outside [0, E) count as expert 0 with weight 0 for -1, NaN otherwise. weights_N carries no
    gradient: with gradients, callers take it as a mask (weights_TK None) and multiply the routing
    weights by it (flat order is the same)."""
    op = _route_op if torch.compiler.is_compiling() else sorted_mlp.route
    return op(ids_TK.contiguous(), weights_TK.contiguous() if weights_TK is not None else None, E, dtype)


def _int32_counts(ids_TK: torch.Tensor, E: int) -> torch.Tensor:
    """[E] int32 rows per expert, without a device-to-host sync."""
    flat = ids_TK.reshape(-1)
    return torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))


def routed_moe_mlp(
    x_TD: torch.Tensor,
    w_gate_up_E2ID: torch.Tensor,
    w_down_EDI: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor | None = None,
    *,
    counts_E: torch.Tensor | None = None,
    activation: str = "silu",
    interleaved: bool = False,
) -> torch.Tensor:
    """y_TD = sum over k of weights_TK[t, k] * expert_{ids_TK[t, k]}(x_TD[t]): the expert MLP from the
    router's output.

    Inference on one token (decode) runs the pair kernels: one matrix-vector pass per (token, slot)
    pair, no sort, two launches; on a few more tokens, whichever of the two paths measured faster at
    that shape and T (`paths.pairs_win`). Otherwise the pairs are sorted by expert and `moe_mlp` runs
    (counts_E [E], if the router computed it, saves recounting); on at most paths.ROUTE_MAX_PAIRS pairs one
    Triton program sorts and counts them, with gradients too.
    x_TD: [T, D]; ids_TK: [T, K] integer; weights_TK: [T, K] or None (unweighted sum over K); the expert
    weights as for `moe_mlp`.
    Inference treats id -1 as a pair computed elsewhere (it adds nothing; the pair kernels skip it, the
    sorted path computes it as expert 0 with weight 0) and gives NaN for a token with any other id
    outside [0, E); so does training on at most paths.ROUTE_MAX_PAIRS pairs (the -1 pair's gradients are zero).
    Larger batches with gradients need ids in [0, E).
    """
    if ids_TK.dim() != 2 or x_TD.dim() != 2 or ids_TK.shape[0] != x_TD.shape[0]:
        raise InputError(f"ids_TK {tuple(ids_TK.shape)} must be [T, K] for x_TD {tuple(x_TD.shape)}")
    checks.check_integer("ids_TK", ids_TK)
    if weights_TK is not None and weights_TK.shape != ids_TK.shape:
        raise InputError(f"weights_TK {tuple(weights_TK.shape)} must match ids_TK {tuple(ids_TK.shape)}")
    T, K = ids_TK.shape

    def sorted_path(ids: torch.Tensor) -> torch.Tensor:  # ids: ids_TK, or another routing when timing paths
        if T * K <= paths.ROUTE_MAX_PAIRS:
            grad = paths.needs_grad(x_TD, w_gate_up_E2ID, w_down_EDI, weights_TK)
            # With gradients the program's weights are a mask, 1 for a known id, 0 for -1, NaN for any
            # other, and the routing weights themselves times it go on: their gradient flows, and ids
            # outside [0, E) give what inference gives.
            order_N, counts, weights_N = route(ids, None if grad else weights_TK, w_gate_up_E2ID.shape[0],
                                                x_TD.dtype)
            if grad and weights_TK is not None:
                weights_N = weights_TK.reshape(-1) * weights_N
            return moe_mlp(x_TD, w_gate_up_E2ID, w_down_EDI, counts, order_N=order_N, weights_N=weights_N,
                           top_k=K, activation=activation, interleaved=interleaved)
        order_N = torch.argsort(ids.reshape(-1), stable=True)
        counts = counts_E if counts_E is not None and ids is ids_TK else _int32_counts(ids, w_gate_up_E2ID.shape[0])
        return moe_mlp(x_TD, w_gate_up_E2ID, w_down_EDI, counts, order_N=order_N, weights_N=weights_TK, top_k=K,
                       activation=activation, interleaved=interleaved)

    if T <= max(paths.PAIRS_TUNE_MAX_TOKENS, paths.pairs_max_tokens()):
        checks.check(x_TD, w_gate_up_E2ID, w_down_EDI, None, None, None, K, activation, "triton")
        if paths.pairs_win(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved, sorted_path,
                           moe_mlp_pairs):
            return moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved)
    return sorted_path(ids_TK)


def _moe_mlp_pairs_impl(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
    weights: Optional[torch.Tensor], activation: str, interleaved: bool,
) -> torch.Tensor:
    return decode.pairs_forward(x, w_gate_up, w_down, ids, weights, activation, interleaved)


_moe_mlp_pairs_op = torch.library.custom_op("thunderep::moe_mlp_pairs", mutates_args=())(_moe_mlp_pairs_impl)


@_moe_mlp_pairs_op.register_fake
def _(x, w_gate_up, w_down, ids, weights, activation, interleaved):
    return x.new_empty(x.shape[0], w_down.shape[1])


def _moe_mlp_pairs_fp8_impl(
    x: torch.Tensor, q_gate_up: torch.Tensor, s_gate_up: torch.Tensor, block_gate_up: list[int],
    q_down: torch.Tensor, s_down: torch.Tensor, block_down: list[int], ids: torch.Tensor,
    weights: Optional[torch.Tensor], activation: str, interleaved: bool,
) -> torch.Tensor:
    return decode.pairs_forward(x, Fp8Weight(q_gate_up, s_gate_up, tuple(block_gate_up), x.dtype),
                  Fp8Weight(q_down, s_down, tuple(block_down), x.dtype), ids, weights, activation, interleaved)


_moe_mlp_pairs_fp8_op = torch.library.custom_op("thunderep::moe_mlp_pairs_fp8", mutates_args=())(
    _moe_mlp_pairs_fp8_impl)


@_moe_mlp_pairs_fp8_op.register_fake
def _(x, q_gate_up, s_gate_up, block_gate_up, q_down, s_down, block_down, ids, weights, activation, interleaved):
    return x.new_empty(x.shape[0], q_down.shape[1])


def _moe_mlp_pairs_int4_impl(
    x: torch.Tensor, packed_gate_up: torch.Tensor, scale_gate_up: torch.Tensor, zero_gate_up: Optional[torch.Tensor],
    group_gate_up: int, packed_down: torch.Tensor, scale_down: torch.Tensor, zero_down: Optional[torch.Tensor],
    group_down: int, fmt: str, ids: torch.Tensor, weights: Optional[torch.Tensor], activation: str, interleaved: bool,
) -> torch.Tensor:
    w_gu = Int4Weight(packed_gate_up, scale_gate_up, group_gate_up, x.dtype, fmt, zero_gate_up)
    w_d = Int4Weight(packed_down, scale_down, group_down, x.dtype, fmt, zero_down)
    return decode.pairs4_forward(x, w_gu, w_d, ids, weights, activation, interleaved)


_moe_mlp_pairs_int4_op = torch.library.custom_op("thunderep::moe_mlp_pairs_int4", mutates_args=())(
    _moe_mlp_pairs_int4_impl)


@_moe_mlp_pairs_int4_op.register_fake
def _(x, packed_gate_up, scale_gate_up, zero_gate_up, group_gate_up, packed_down, scale_down, zero_down, group_down,
      fmt, ids, weights, activation, interleaved):
    return x.new_empty(x.shape[0], packed_down.shape[1])


def _moe_mlp_pairs_int4_gptoss_impl(
    x: torch.Tensor, packed_gate_up: torch.Tensor, scale_gate_up: torch.Tensor, zero_gate_up: Optional[torch.Tensor],
    group_gate_up: int, bias_gate_up: torch.Tensor, packed_down: torch.Tensor, scale_down: torch.Tensor,
    zero_down: Optional[torch.Tensor], group_down: int, bias_down: torch.Tensor, fmt: str, ids: torch.Tensor,
    weights: Optional[torch.Tensor], alpha: float, limit: float,
) -> torch.Tensor:
    w_gu = Int4Weight(packed_gate_up, scale_gate_up, group_gate_up, x.dtype, fmt, zero_gate_up)
    w_d = Int4Weight(packed_down, scale_down, group_down, x.dtype, fmt, zero_down)
    return pairs4_gptoss.pairs4_gptoss_forward(x, w_gu, bias_gate_up, w_d, bias_down, ids, weights, alpha, limit)


_moe_mlp_pairs_int4_gptoss_op = torch.library.custom_op("thunderep::moe_mlp_pairs_int4_gptoss", mutates_args=())(
    _moe_mlp_pairs_int4_gptoss_impl)


@_moe_mlp_pairs_int4_gptoss_op.register_fake
def _(x, packed_gate_up, scale_gate_up, zero_gate_up, group_gate_up, bias_gate_up, packed_down, scale_down, zero_down,
      group_down, bias_down, fmt, ids, weights, alpha, limit):
    return x.new_empty(x.shape[0], packed_down.shape[1])


def moe_mlp_pairs_gptoss(x_TD: torch.Tensor, w_gate_up_E2ID: Int4Weight, b_gate_up_E2I: torch.Tensor,
                         w_down_EDI: Int4Weight, b_down_ED: torch.Tensor, ids_TK: torch.Tensor,
                         weights_TK: torch.Tensor | None, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts (biases, gate/up rows interleaved, clamped SwiGLU: pairs4_gptoss.py) on 4-bit
    weights through the pair kernels (inference). x_TD: [T, D]; w_gate_up_E2ID [E, 2I, D] and w_down_EDI
    [E, D, I]: int4.Int4Weight computing in x's dtype; b_gate_up_E2I: [E, 2I], b_down_ED: [E, D];
    ids_TK: [T, K] integer (-1: another rank's expert); weights_TK: [T, K] or None (unweighted)."""
    check_int4(x_TD, w_gate_up_E2ID, w_down_EDI, weights_TK, b_gate_up_E2I, b_down_ED)
    E, I2, D = w_gate_up_E2ID.shape
    if tuple(b_gate_up_E2I.shape) != (E, I2) or tuple(b_down_ED.shape) != (E, D):
        raise InputError(f"biases {tuple(b_gate_up_E2I.shape)} and {tuple(b_down_ED.shape)} must be [E, 2I] "
                         f"{(E, I2)} and [E, D] {(E, D)}")
    op = _moe_mlp_pairs_int4_gptoss_op if torch.compiler.is_compiling() else _moe_mlp_pairs_int4_gptoss_impl
    w_gu, w_d = w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous()
    return op(x_TD.contiguous(), w_gu.packed, w_gu.scale, w_gu.zero, w_gu.group, b_gate_up_E2I.contiguous(),
              w_d.packed, w_d.scale, w_d.zero, w_d.group, b_down_ED.contiguous(), w_gu.fmt,
              ids_TK.reshape(-1).contiguous(), weights_TK.reshape(-1).contiguous() if weights_TK is not None else None,
              float(alpha), float(limit))


def moe_mlp_pairs(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, ids_TK: torch.Tensor,
                  weights_TK: torch.Tensor | None, activation: str, interleaved: bool) -> torch.Tensor:
    """y_TD through the pair kernels (inference). x_TD: [T, D]; w_gate_up_E2ID: [E, 2I, D] and
    w_down_EDI: [E, D, I] in x's dtype, or both fp8.Fp8Weight or both int4.Int4Weight computing in it;
    ids_TK: [T, K] integer; weights_TK: [T, K] or None (unweighted). Inputs are checked by the caller
    (ops.routed_moe_mlp)."""
    if isinstance(w_gate_up_E2ID, Int4Weight) or isinstance(w_down_EDI, Int4Weight):
        check_int4(x_TD, w_gate_up_E2ID, w_down_EDI, weights_TK)
        op = _moe_mlp_pairs_int4_op if torch.compiler.is_compiling() else _moe_mlp_pairs_int4_impl
        w_gu, w_d = w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous()
        return op(x_TD.contiguous(), w_gu.packed, w_gu.scale, w_gu.zero, w_gu.group, w_d.packed, w_d.scale, w_d.zero,
                  w_d.group, w_gu.fmt, ids_TK.contiguous(), weights_TK.contiguous() if weights_TK is not None else None,
                  activation, interleaved)
    if isinstance(w_gate_up_E2ID, Fp8Weight):
        op = _moe_mlp_pairs_fp8_op if torch.compiler.is_compiling() else _moe_mlp_pairs_fp8_impl
        w_gu, w_d = w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous()
        return op(x_TD.contiguous(), w_gu.q, w_gu.scale, list(w_gu.block), w_d.q, w_d.scale, list(w_d.block),
                  ids_TK.contiguous(), weights_TK.contiguous() if weights_TK is not None else None, activation,
                  interleaved)
    op = _moe_mlp_pairs_op if torch.compiler.is_compiling() else _moe_mlp_pairs_impl
    return op(x_TD.contiguous(), w_gate_up_E2ID.contiguous(), w_down_EDI.contiguous(), ids_TK.contiguous(),
              weights_TK.contiguous() if weights_TK is not None else None, activation, interleaved)


def pairs_if_decode(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, ids_TK: torch.Tensor,
                    weights_TK: torch.Tensor | None, activation: str, interleaved: bool, fallback=None,
                    experts: int | None = None, kind: str = "sorted", second: tuple | None = None
                    ) -> torch.Tensor | None:
    """`moe_mlp_pairs` (x cast to the weights' dtype) where `decode_applies`, or, given the caller's
    `fallback(ids_TK)` (what the caller runs on None), where `paths.pairs_win` chooses the pair kernels
    (`experts`, `kind` as there); else None. The caller has checked that the Triton kernels can run
    these experts. second: a second (gate_up, down) pair of 16-bit tensors the ids past the first's rows
    read (`decode.pairs_forward`; no fallback: nothing else reads two tensors); None where the weights
    are not 16-bit."""
    if x_TD.shape[0] > max(paths.PAIRS_TUNE_MAX_TOKENS, paths.pairs_max_tokens()) and kind != paths.IN_PLACE:
        return None  # neither applies: x is not cast
    if second is not None and (fallback is not None or not all(isinstance(w, torch.Tensor) for w in
                                                                (w_gate_up_E2ID, w_down_EDI))):
        return None  # before any path is timed on the first set alone
    x_TD = x_TD.to(w_gate_up_E2ID.dtype)
    if fallback is not None:
        if not paths.pairs_win(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved, fallback,
                               moe_mlp_pairs, experts, kind):
            return None
    elif not paths.decode_applies(x_TD.shape[0], x_TD, weights_TK, w_gate_up_E2ID, w_down_EDI, kind=kind):
        return None
    if second is not None:
        return decode.pairs_forward(x_TD.contiguous(), w_gate_up_E2ID, w_down_EDI, ids_TK.reshape(-1).contiguous(),
                                    weights_TK.reshape(-1).contiguous() if weights_TK is not None else None,
                                    activation, interleaved, second=second)
    return moe_mlp_pairs(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved)
