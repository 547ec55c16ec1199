"""Decode on 4-bit expert weights for gpt-oss's experts: a gate/up pair kernel with biases and gpt-oss's
clamped SwiGLU, and the launches; the down pass is pairs4.py's with biases (`down_pairs4_kernel` BIAS,
decode.down4: autotuned, split per slot and cut into parts of I as any model's).

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K (token, slot) pairs in flat (token-major) order, HK = BLOCK_K / 2 packed columns of a chunk.

gpt-oss's experts (transformers' GptOssExperts) compute, for one token x and expert e,

    gu = x @ Wgu[e].T + bgu[e]                 Wgu [2I, D], rows interleaved: gate 2c, up 2c + 1
    g = min(gu[2c], limit); u = clamp(gu[2c + 1], -limit, limit)
    h[c] = (u + 1) * g * sigmoid(alpha * g)
    out = h @ Wd[e].T + bd[e]                  Wd [D, I]

and the token's output is the routing-weighted sum of `out` over its K experts (the bias weighted too).
The 4-bit matrices are held as the kernels read them, [E, 2I, D / 2] and [E, D, I / 2] bytes with
their scales (int4.Int4Weight): gpt-oss's MXFP4 checkpoint stores them so (its tensors show the
transpose). The products run as in pairs4.py (packed words converted in registers, float32); the biases are
read in their own dtype and added in float32. Expert ids as there: -1 reads nothing and adds nothing
(nor its bias); any other id outside [0, E) makes its token NaN. Inference only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import decode, paths
from .pairs import up_pair_start
from .pairs4 import packed_dot2, store_h
from .tiles import pairs4_default
from .tuning import cdiv
from .words4 import words_ok

__all__ = ["GPTOSS4_UP", "pairs4_gptoss_forward", "up_pairs4_gptoss_kernel"]

# The gate/up pass's launch config, pinned: None takes the plain 4-bit pair kernels' default for the shape
# (tiles.pairs4_default; not autotuned); a dict {"BLOCK_N", "BLOCK_K", "num_warps"} runs that config. The
# down pass is the plain one with biases (pairs4.down_pairs4_kernel BIAS: autotuned, or decode.PAIRS4_DOWN).
GPTOSS4_UP: dict | None = None


def _config(pinned: dict | None, programs, C: int) -> dict:
    if pinned is not None:
        return dict(pinned)
    config = pairs4_default(programs, C)
    return {**config.kwargs, "num_warps": config.num_warps}


@triton.jit
def up_pairs4_gptoss_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, h_ptr, ids_ptr, count_ptr, I, D, E, top_k, n_counts,
                            alpha, limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be,
                            stride_hm, GROUP: tl.constexpr, MXFP4: tl.constexpr, ZERO: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS4: tl.constexpr = False,
                            HALF: tl.constexpr = 0, PDL: tl.constexpr = False, hp_ptr=0,
                            PAIRED: tl.constexpr = False):
    """h[j, c] = gpt-oss's clamped SwiGLU of (x[j // K] . Wgu[ids[j], 2c] + b[ids[j], 2c],
    x[j // K] . Wgu[ids[j], 2c + 1] + b[ids[j], 2c + 1]) for pair j = program_id(0), columns c of tile
    program_id(1). x: [T, D]; W: packed [E, 2I, D / 2] uint8 with scales (and zero points, ZERO)
    [E, 2I, ceil(D / GROUP)] by strides; b: [E, 2I]; h: [T*K, I]. WORDS4: D a multiple of 32 (words4.load_words);
    HALF: the products in float16 pairs (pairs4.packed_dot). Also zeroes the down pass's counts and, PDL,
    lets it launch early, and, PAIRED, writes h's float16-pair copy to hp, as pairs4.up_pairs4_kernel."""
    j, cols_N, expert, known, skipped, ok_N = up_pair_start(ids_ptr, count_ptr, E, I, top_k, n_counts, BLOCK_N, PDL)
    gate_N, up_N = (2 * cols_N).to(tl.int64), (2 * cols_N + 1).to(tl.int64)
    gw_N = w_ptr + expert * stride_we + gate_N * stride_wn
    uw_N = w_ptr + expert * stride_we + up_N * stride_wn
    gs_N = expert * stride_se + gate_N * stride_sn
    us_N = expert * stride_se + up_N * stride_sn
    x_row = x_ptr + (j // top_k).to(tl.int64) * stride_xm
    words = words_ok(w_ptr, stride_we, stride_wn, D)
    opaque = (expert >> 32).to(tl.uint32)  # 0 (expert is in [0, E)); to the compiler, any value (packed_dot)
    acc_g, acc_u = packed_dot2(gw_N, s_ptr + gs_N, z_ptr + gs_N, uw_N, s_ptr + us_N, z_ptr + us_N, D, ok_N, x_row,
                               words, opaque, stride_sk, GROUP, MXFP4, ZERO, BLOCK_K, WORDS4=WORDS4, HALF=HALF)
    b_row = b_ptr + expert * stride_be
    g_N = acc_g + tl.load(b_row + gate_N, mask=ok_N, other=0.0).to(tl.float32)
    u_N = acc_u + tl.load(b_row + up_N, mask=ok_N, other=0.0).to(tl.float32)
    g_N = tl.minimum(g_N, limit)
    u_N = tl.minimum(tl.maximum(u_N, -limit), limit)
    h = (u_N + 1.0) * (g_N * tl.sigmoid(alpha * g_N))
    h = tl.where(known, h, tl.where(skipped, 0.0, float("nan")))
    store_h(h, h_ptr, hp_ptr, j, cols_N, I, stride_hm, PAIRED)


def pairs4_gptoss_forward(x: torch.Tensor, w_gate_up, b_gate_up: torch.Tensor, w_down, b_down: torch.Tensor,
                          ids: torch.Tensor, weights: torch.Tensor | None, alpha: float,
                          limit: float) -> torch.Tensor:
    """y_TD of gpt-oss's experts through the two 4-bit pair launches (module docstring). x: [T, D];
    w_gate_up [E, 2I, D] (gate/up rows interleaved) and w_down [E, D, I]: int4.Int4Weight computing in
    x's dtype, contiguous; b_gate_up [E, 2I] and b_down [E, D] contiguous; ids: [T * K] (-1: a pair
    computed elsewhere); weights: [T * K] or None (unweighted)."""
    x = decode.vector_rows(x)
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, N = I2 // 2, ids.numel()
    h = x.new_empty(N, I)
    half = paths.half_mode(x.device, w_gate_up.fmt)
    h_pairs = decode.paired_h(h, half, w_down)
    pdl = paths.pdl_applies(x.device)
    buffers = decode.down4_buffers(x, T, N, D)
    up = _config(GPTOSS4_UP, lambda bn: N * cdiv(I, bn), D)
    up_pairs4_gptoss_kernel[(N, cdiv(I, up["BLOCK_N"]))](
        x, w_gate_up.packed, b_ptr=b_gate_up, h_ptr=h, ids_ptr=ids, count_ptr=buffers[1], I=I, D=D, E=E,
        top_k=N // T, n_counts=buffers[2], alpha=float(alpha), limit=float(limit), stride_xm=x.stride(0),
        stride_wn=w_gate_up.packed.stride(1), stride_be=b_gate_up.stride(0), stride_hm=h.stride(0),
        WORDS4=D % 32 == 0, HALF=half, PDL=pdl, stride_we=w_gate_up.packed.stride(0), **w_gate_up.kernel_args(),
        **up, **decode.paired_args(h_pairs))
    return decode.down4(h, w_down, ids, weights, T, buffers, pdl, half, bias=b_down, h_pairs=h_pairs)
