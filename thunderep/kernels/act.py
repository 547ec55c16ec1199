"""Triton device helpers that several kernel modules share: the gated activation and its derivative,
the gate/up column layout, and the FP8 weight scales.

    act(g, ACT)          silu (0), gelu (1), gelu_tanh (2), relu (3): the codes of ACTIVATIONS
    act_grad(g, ACT)     d act(g) / d g
    gate_up_cols         the gate and up columns of intermediate columns in a [*, 2I] gate/up layout
    dequant              an FP8 weight tile times its scales, rounded to the products' dtype
    weight_scales        pointers to the scales of FP8 weight rows (fp8.py's layout)
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ACTIVATIONS", "act", "act_grad", "dequant", "gate_up_cols", "weight_scales"]

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@triton.jit
def act(g, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g)
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        return tl.maximum(g, 0.0)


@triton.jit
def act_grad(g, ACT: tl.constexpr):
    """d act(g) / d g."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * g * g)
        return cdf + g * pdf
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        d_inner = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        return 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * d_inner
    else:
        return (g > 0).to(tl.float32)


@triton.jit
def gate_up_cols(cols, I, INTERLEAVED: tl.constexpr):
    """Columns of the gate and up halves for intermediate columns `cols` in a [*, 2I] gate/up layout:
    gate rows first (c, c + I) or interleaved (2c, 2c + 1)."""
    if INTERLEAVED:
        return 2 * cols, 2 * cols + 1
    else:
        return cols, cols + I


@triton.jit
def dequant(w, scale, DT: tl.constexpr):
    """An FP8 weight tile times its scales (broadcast to it), rounded to DT: the value
    `fp8.Fp8Weight.dequantize` gives, so FP8 weights compute what their dequantized copy computes."""
    return (w.to(tl.float32) * scale).to(DT)


@triton.jit
def weight_scales(ws_ptr, expert, rows_N, stride_wse, stride_wsn, SCALE_N: tl.constexpr):
    """Pointers [BLOCK_N] to the k = 0 scale of weight rows rows_N of `expert` (scale rows of SCALE_N
    weight rows each)."""
    return ws_ptr + expert.to(tl.int64) * stride_wse + (rows_N // SCALE_N).to(tl.int64) * stride_wsn
