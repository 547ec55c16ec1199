"""What the Triton expert kernels take: the checks of their inputs, each an InputError that names the
values and what would fit.

Shape legend as in ops.py: T tokens, D hidden size, K experts per token, E experts, I intermediate
size, N routed rows in expert order.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from .act import ACTIVATIONS
from .fp8 import Fp8Weight
from .int4 import Int4Weight
from .paths import needs_grad

__all__ = ["DTYPES", "check", "check_fp8", "check_int4", "check_integer", "check_rows", "supported"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str, bias: bool) -> bool:
    """Whether the Triton kernels can run this expert MLP."""
    return (
        activation in ACTIVATIONS
        and not bias
        and x.dtype == w_gate_up.dtype
        and x.dtype in DTYPES
        and w_gate_up.is_contiguous()
    )


def check(x, w_gu, w_d, order, counts, weights, top_k, activation, gemm, subset=False):
    """InputError on inputs the kernels cannot take; `counts` None (the pair kernels take none) is not checked.
    subset: `order` lists some of the T * K flat pairs, `weights` all of them, [T * K] or [T, K]
    (sorted_mlp.forward_summed)."""
    E, I2, D = w_gu.shape
    if gemm not in ("triton", "torch"):
        raise InputError(f"gemm must be 'triton' or 'torch', got {gemm!r}")
    if activation not in ACTIVATIONS:
        raise InputError(f"activation {activation!r} has no Triton kernel; use one of {sorted(ACTIVATIONS)}")
    if x.dtype not in DTYPES:
        raise InputError(f"x has dtype {x.dtype}; the kernels take {', '.join(str(d) for d in DTYPES)}")
    if w_gu.dtype != x.dtype or w_d.dtype != x.dtype:
        raise InputError(f"x ({x.dtype}), w_gate_up ({w_gu.dtype}) and w_down ({w_d.dtype}) must share one dtype: "
                         f"cast the weights or x first")
    if w_gu.device != x.device or w_d.device != x.device:
        raise InputError(f"x ({x.device}), w_gate_up ({w_gu.device}) and w_down ({w_d.device}) must be on one "
                         f"device")
    if w_d.shape != (E, D, I2 // 2) or x.shape[-1] != D:
        raise InputError(f"shapes do not match: x {tuple(x.shape)}, w_gate_up {tuple(w_gu.shape)}, "
                         f"w_down {tuple(w_d.shape)} (expected [E, 2I, D] and [E, D, I])")
    if counts is not None and counts.shape != (E,):
        raise InputError(f"counts_E has shape {tuple(counts.shape)}, expected ({E},)")
    flat = x.shape[0] * top_k
    if order is not None and (order.shape[0] > flat if subset else order.shape[0] != flat):
        raise InputError(f"order_N has {order.shape[0]} rows; x has {x.shape[0]} tokens x top_k {top_k} = "
                         f"{flat}{' (at most)' if subset else ''}")
    if order is not None and weights is not None and \
            weights.shape not in (((flat,), (x.shape[0], top_k)) if subset else (order.shape,)):
        raise InputError(f"weights {tuple(weights.shape)} must match "
                         f"{'the ' + str(flat) + ' flat pairs' if subset else 'order ' + str(tuple(order.shape))}")
    if counts is not None and counts.device.type == "cpu":  # no sync here; on a GPU, see moe_mlp
        check_rows(counts, order, x.shape[0], top_k)


def check_rows(counts: torch.Tensor, order: Optional[torch.Tensor], n_tokens: int, top_k: int) -> None:
    """The checks of counts and order against the rows that read their values: on the CPU only (on a GPU
    each would be a host sync; there the kernels stay in bounds instead, see moe_mlp)."""
    n_rows = order.shape[0] if order is not None else n_tokens
    total = int(counts.sum())
    if total != n_rows or bool((counts < 0).any()):
        raise InputError(f"counts_E {counts.tolist()} must be >= 0 and sum to the {n_rows} rows "
                         f"({'order_N' if order is not None else 'x'}); they sum to {total}")
    flat = n_tokens * top_k
    if order is not None and order.numel() and not 0 <= int(order.min()) <= int(order.max()) < flat:
        raise InputError(f"order_N holds pairs {int(order.min())} to {int(order.max())}; x has "
                         f"{n_tokens} tokens x top_k {top_k}: use pairs in [0, {flat})")


def check_integer(name: str, t: torch.Tensor) -> None:
    """InputError unless `t` holds integers: a float index would be truncated without a word."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor, got {t.dtype}")


def check_fp8(x: torch.Tensor, w_gate_up, w_down, *tensors) -> None:
    """InputError unless both weights are Fp8Weight in x's dtype whose scale blocks the kernels can
    walk, and nothing asks for gradients (FP8 weights are for inference)."""
    if not (isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight)):
        raise InputError(f"w_gate_up ({type(w_gate_up).__name__}) and w_down ({type(w_down).__name__}) must both "
                         f"be Fp8Weight, or both tensors")
    if w_gate_up.w8a8 != w_down.w8a8:
        raise InputError(f"w_gate_up (w8a8={w_gate_up.w8a8}) and w_down (w8a8={w_down.w8a8}) must agree on "
                         f"whether the products run in FP8")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        cols, scale_k = w.shape[2], w.block[1]
        if scale_k < cols and scale_k % 16:
            raise InputError(f"{name}'s scale blocks are {scale_k} columns wide: the kernels take blocks of a "
                             f"multiple of 16 columns, or one block across all {cols}")
        if w.w8a8 and scale_k < cols and scale_k % 32:  # FP8 tensor-core products take 32 columns at once
            raise InputError(f"{name}'s scale blocks are {scale_k} columns wide: FP8 products (w8a8) take blocks "
                             f"of a multiple of 32 columns, or one block across all {cols}")
    if needs_grad(x, *tensors):
        raise InputError("FP8 expert weights are for inference: nothing here differentiates through them (run "
                         "under torch.no_grad(), or train on their dequantized copy, Fp8Weight.dequantize())")


def check_int4(x: torch.Tensor, w_gate_up, w_down, *tensors) -> None:
    """InputError unless both weights are Int4Weight of one format computing in x's dtype, and nothing
    asks for gradients (4-bit weights are for inference)."""
    if not (isinstance(w_gate_up, Int4Weight) and isinstance(w_down, Int4Weight)):
        raise InputError(f"w_gate_up ({type(w_gate_up).__name__}) and w_down ({type(w_down).__name__}) must both "
                         f"be Int4Weight, or neither")
    if w_gate_up.fmt != w_down.fmt or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise InputError(f"w_gate_up ({w_gate_up.fmt}, {w_gate_up.dtype}) and w_down ({w_down.fmt}, {w_down.dtype}) "
                         f"must share one format and compute in x's dtype ({x.dtype})")
    if needs_grad(x, *tensors):
        raise InputError("4-bit expert weights are for inference: nothing here differentiates through them (run "
                         "under torch.no_grad(), or train on their dequantized copy, Int4Weight.dequantize())")
