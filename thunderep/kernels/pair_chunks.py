"""Decode in one weight pass: each program takes one (token, slot) pair's slice of the intermediate columns
through both projections, so no program waits for another's h.

Shape legend as in pairs.py: T tokens, D hidden size, K experts per token, E experts, I intermediate
size, N = T * K (token, slot) pairs in flat (token-major) order, C = cdiv(I, BLOCK_I) column chunks.

    _chunk_pairs_kernel  h = act(x[j // K] @ Wg[e, c].T) * (x[j // K] @ Wu[e, c].T)  (BLOCK_I columns c)
                         part[j, c] = w[j] * (Wd[e][:, c] @ h)                        (float32, [D])
    _sum_parts_kernel    y[t] = sum over k, c of part[t*K + k, c]                   (fixed order)

The two-pass pair kernels (pairs.py) split the work the other way: the down pass needs a pair's whole h
row, so it starts only when the gate/up pass has finished, and each pass ramps up and drains on its own.
Here every weight byte is read in the first launch, by programs that depend on nothing; what crosses
programs is N * C float32 partials of D values (a few MB, through L2), summed by a small second launch.
That launch is a programmatic dependent of the first where the GPU has it (sm_90 and later,
`pairs.pdl_applies`): its programs wait (griddepcontrol.wait) instead of being launched after the first
kernel ends. The sum over k and c runs in a fixed order (no float atomics): same input, same bits.

Which shapes take this path: `chunks_apply` (docs/BENCHMARKS.md, "Decode in one weight pass").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from . import tuning
from .moe_triton import ACTIVATIONS, _act, _gate_up_cols
from .pdl import gdc_launch_dependents, gdc_wait, pdl_applies

__all__ = ["chunks_apply", "moe_mlp_chunks"]


@triton.jit
def _chunk_pairs_kernel(x_ptr, wgu_ptr, wd_ptr, part_ptr, ids_ptr, weight_ptr, I, D, E, top_k, stride_xm,
                        stride_gue, stride_gun, stride_de, stride_dd, ACT: tl.constexpr,
                        INTERLEAVED: tl.constexpr, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr,
                        PDL: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """part[j, c, :] = w[j] * (Wd[e][:, cols] @ h_cols) with h_cols = act(x . Wg[e, cols]) * (x . Wu[e, cols])
    for pair j = program_id(0), expert e = ids[j], intermediate columns cols of chunk c = program_id(1).

    Elementwise multiply-adds into float32 tiles, as the pair kernels: [BLOCK_I, BLOCK_K] over D for
    gate/up (rows of Wgu are contiguous along D), then [BLOCK_D, BLOCK_I] over D for the down product
    (Wd: [E, D, I], contiguous along I). h is rounded to the weights' dtype before the down product, as
    the two-pass kernels store it. part: [N, C, D] float32. Expert id -1 (another rank's pair) reads no
    weight and writes 0; any other id outside [0, E) writes NaN."""
    if PDL:  # the sum's programs may launch now and wait for this grid's partials
        gdc_launch_dependents()
    j = tl.program_id(0)
    chunk = tl.program_id(1)
    cols_I = chunk * BLOCK_I + tl.arange(0, BLOCK_I)
    expert = tl.load(ids_ptr + j).to(tl.int64)
    known = (expert >= 0) & (expert < E)
    skipped = expert == -1
    expert = tl.where(known, expert, 0)
    col_ok_I = cols_I < tl.where(known, I, 0)  # no weight reads for a pair without a (valid) expert
    gate_I, up_I = _gate_up_cols(cols_I, I, INTERLEAVED)
    k_K = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (j // top_k).to(tl.int64) * stride_xm + k_K
    gu_base = wgu_ptr + expert * stride_gue
    g_ptrs = gu_base + gate_I.to(tl.int64)[:, None] * stride_gun + k_K[None, :]
    u_ptrs = gu_base + up_I.to(tl.int64)[:, None] * stride_gun + k_K[None, :]
    acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok_K = (k_K < D - k0) | EVEN_K
        xv = tl.load(x_ptrs, mask=k_ok_K, other=0.0).to(tl.float32)
        ok = col_ok_I[:, None] & k_ok_K[None, :]
        acc_g += tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32) * xv[None, :]
        acc_u += tl.load(u_ptrs, mask=ok, other=0.0).to(tl.float32) * xv[None, :]
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h_I = _act(tl.sum(acc_g, 1), ACT) * tl.sum(acc_u, 1)
    h_I = h_I.to(wd_ptr.dtype.element_ty).to(tl.float32)  # as the two-pass kernels store h
    if WEIGHTED:
        h_I = h_I * tl.load(weight_ptr + j).to(tl.float32)
    h_I = tl.where(col_ok_I, h_I, 0.0)
    h_I = tl.where(known | skipped, h_I, float("nan"))
    d_D = tl.arange(0, BLOCK_D)
    w_ptrs = wd_ptr + expert * stride_de + d_D.to(tl.int64)[:, None] * stride_dd + cols_I[None, :]
    part_ptrs = part_ptr + (j.to(tl.int64) * tl.num_programs(1) + chunk) * D + d_D
    for d0 in range(0, D, BLOCK_D):
        d_ok_D = d_D < D - d0
        w = tl.load(w_ptrs, mask=d_ok_D[:, None] & col_ok_I[None, :], other=0.0)
        tl.store(part_ptrs, tl.sum(w.to(tl.float32) * h_I[None, :], 1), mask=d_ok_D)
        w_ptrs += BLOCK_D * stride_dd
        part_ptrs += BLOCK_D


@triton.jit
def _sum_parts_kernel(part_ptr, y_ptr, n_parts, D, stride_ym, PDL: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """y[t, cols] = sum over p of part[t, p, cols] for token t = program_id(0), columns of tile
    program_id(1); part: [T, n_parts, D] float32. [BLOCK_P, BLOCK_D] tiles, summed over p at the end:
    a fixed order for a given config."""
    if PDL:  # launched as a dependent of _chunk_pairs_kernel: wait until its partials are written
        gdc_wait()
    t = tl.program_id(0)
    cols_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    p_P = tl.arange(0, BLOCK_P)
    ptrs = part_ptr + (t.to(tl.int64) * n_parts + p_P)[:, None] * D + cols_D[None, :]
    acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        ok = (p_P < n_parts - p0)[:, None] & (cols_D < D)[None, :]
        acc += tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
        ptrs += BLOCK_P * D
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + cols_D, tl.sum(acc, 0).to(y_ptr.dtype.element_ty),
             mask=cols_D < D)


# ---- host side ----------------------------------------------------------------------------------------


def _chunk_cfg(bi, bk, bd, warps, stages):
    return triton.Config({"BLOCK_I": bi, "BLOCK_K": bk, "BLOCK_D": bd}, num_warps=warps, num_stages=stages)


# Narrow chunks give more programs (Qwen3 at T = 1: 8 pairs x 768 columns); each program's partial is D
# float32 values, so the narrowest chunk also sets the partials' size (_MIN_BLOCK_I).
_CHUNK_CONFIGS = [_chunk_cfg(*c) for c in [
    (16, 256, 512, 4, 2), (16, 512, 512, 8, 2), (32, 128, 256, 4, 3), (32, 256, 256, 4, 2), (32, 256, 256, 8, 2),
    (64, 128, 128, 4, 3), (64, 128, 128, 8, 3), (64, 256, 128, 8, 2)]]
_DEFAULT_CHUNK = _chunk_cfg(32, 128, 256, 4, 3)
_MIN_BLOCK_I = min(cfg.kwargs["BLOCK_I"] for cfg in _CHUNK_CONFIGS)
_SUM_CONFIGS = [triton.Config({"BLOCK_P": bp, "BLOCK_D": bd}, num_warps=w, num_stages=1)
                for bp, bd, w in [(16, 64, 2), (32, 64, 4), (16, 128, 4), (32, 32, 2), (64, 32, 4)]]
_DEFAULT_SUM = triton.Config({"BLOCK_P": 32, "BLOCK_D": 64}, num_warps=4, num_stages=1)

_CHUNK_PAIRS, _CHUNK_PAIRS_PLAIN = tuning.tuned("chunk_pairs", _chunk_pairs_kernel, _CHUNK_CONFIGS,
                                                ["I", "D", "top_k", "INTERLEAVED", "WEIGHTED"], even_k="D")
_SUM_PARTS, _SUM_PARTS_PLAIN = tuning.tuned("sum_parts", _sum_parts_kernel, _SUM_CONFIGS, ["n_parts", "D"])


def chunks_apply() -> bool:
    """Whether decode runs the one-pass kernels instead of the two-pass pair kernels:
    THUNDEREP_PAIR_CHUNKS=1 (on) or 0 (off); unset, off."""
    raw = os.environ.get("THUNDEREP_PAIR_CHUNKS", "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"THUNDEREP_PAIR_CHUNKS={raw!r}: use 0 (off) or 1, or leave it unset")
    return raw == "1"


def moe_mlp_chunks(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor | None, activation: str, interleaved: bool) -> torch.Tensor:
    """y_TD through the one-pass kernels (inference); arguments as pairs.moe_mlp_pairs's implementation
    (contiguous x, ids and weights; w_down unit stride along I)."""
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, N = I2 // 2, ids.numel()
    top_k = N // T
    pdl = pdl_applies(x.device)
    part = torch.empty(N * triton.cdiv(I, _MIN_BLOCK_I) * D, dtype=torch.float32, device=x.device)
    chosen = tuning.launch(
        _CHUNK_PAIRS, _CHUNK_PAIRS_PLAIN, _DEFAULT_CHUNK, lambda meta: (N, triton.cdiv(I, meta["BLOCK_I"])),
        x.device, x_ptr=x, wgu_ptr=w_gate_up, wd_ptr=w_down, part_ptr=part, ids_ptr=ids,
        weight_ptr=weights if weights is not None else x, I=I, D=D, E=E, top_k=top_k, stride_xm=x.stride(0),
        stride_gue=w_gate_up.stride(0), stride_gun=w_gate_up.stride(1), stride_de=w_down.stride(0),
        stride_dd=w_down.stride(1), ACT=ACTIVATIONS[activation], INTERLEAVED=interleaved,
        WEIGHTED=weights is not None, PDL=pdl)
    y = x.new_empty(T, D)
    tuning.launch(_SUM_PARTS, _SUM_PARTS_PLAIN, _DEFAULT_SUM, lambda meta: (T, triton.cdiv(D, meta["BLOCK_D"])),
                  x.device, part_ptr=part, y_ptr=y, n_parts=top_k * triton.cdiv(I, chosen.kwargs["BLOCK_I"]), D=D,
                  stride_ym=y.stride(0), PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return y
