"""4-bit expert weights (int4.py) dequantized in one pass: each packed byte read once, each value written once.

Shape legend: E experts, R rows, C columns of one expert's matrix, H = C / 2 packed bytes a row,
nG = ceil(C / G) group scales a row (G the group).

    dequantize4(packed_ERH, scale_ERG, zero_ERG, group, mxfp4, dtype)   W [E, R, C] in dtype

A program takes a [BLOCK_R, BLOCK_C] tile of W (rows of the flattened E * R, columns): it loads the
tile's [BLOCK_R, BLOCK_C / 2] bytes, converts each byte's low and high nibble (the even and odd column)
to float32 exactly with no integer-to-float conversion (codes4.nibbles4: e2m1, or int4's n - 8; minus
the zero point), multiplies by the group's scale in float32 and interleaves the two halves into one
store in `dtype`: the values and the rounding of `Int4Weight.dequantize`'s torch path (one float32
product, then the cast). Inputs are read by their strides (a slice of experts needs no copy); the
output is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codes4 import nibbles4, scales4

__all__ = ["dequantize4"]

TILE = 4096  # W values a program writes
MAX_BLOCK_C = 1024
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _dequant4_kernel(p_ptr, s_ptr, z_ptr, out_ptr, rows, R, H, stride_pe, stride_pr, stride_ph, stride_se,
                     stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, GROUP: tl.constexpr,
                     MXFP4: tl.constexpr, ZERO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[row, c] for rows program_id(0) * BLOCK_R + [0, BLOCK_R) of the flattened [E * R] and columns
    program_id(1) * BLOCK_C + [0, BLOCK_C). packed [E, R, H] uint8, scales (and zero points, ZERO)
    [E, R, nG] by strides; out [E * R, 2 H] contiguous."""
    HB: tl.constexpr = BLOCK_C // 2
    row_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    byte_B = tl.program_id(1) * HB + tl.arange(0, HB)
    e_R = (row_R // R).to(tl.int64)
    r_R = (row_R % R).to(tl.int64)
    ok = (row_R < rows)[:, None] & (byte_B < H)[None, :]
    b = tl.load(p_ptr + (e_R * stride_pe + r_R * stride_pr)[:, None] + (byte_B.to(tl.int64) * stride_ph)[None, :],
                mask=ok, other=0).to(tl.int32)
    g_B = (2 * byte_B // GROUP).to(tl.int64)  # both columns of a byte share a group (GROUP is even)
    scale = scales4(s_ptr + (e_R * stride_se + r_R * stride_sr)[:, None] + (g_B * stride_sg)[None, :], ok,
                          MXFP4)
    lo, hi = nibbles4(b, MXFP4)
    if ZERO:
        z = tl.load(z_ptr + (e_R * stride_ze + r_R * stride_zr)[:, None] + (g_B * stride_zg)[None, :], mask=ok,
                    other=0).to(tl.float32)
        lo, hi = lo - z, hi - z
    w = tl.interleave(lo * scale, hi * scale)  # [BLOCK_R, BLOCK_C]: column 2 p from byte p's low nibble
    cols_C = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    out = out_ptr + row_R.to(tl.int64)[:, None] * (2 * H) + cols_C[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(row_R < rows)[:, None] & (cols_C < 2 * H)[None, :])


def dequantize4(packed_ERH: torch.Tensor, scale_ERG: torch.Tensor, zero_ERG: torch.Tensor | None, group: int,
                mxfp4: bool, dtype: torch.dtype, block_c: int | None = None, block_r: int | None = None,
                num_warps: int = 4) -> torch.Tensor:
    """W [E, R, 2 H] in `dtype` (bfloat16, float16 or float32), contiguous, on packed's device.
    packed_ERH: uint8, low nibble the even column. scale_ERG: [E, R, ceil(2 H / group)], uint8 e8m0
    exponents (mxfp4) or float32 / bfloat16 / float16 (int4). zero_ERG: int8 like scale_ERG (int4) or
    None. group: even. Any strides. block_c / block_r: the tile (default: up to MAX_BLOCK_C columns,
    TILE values)."""
    assert dtype in _OUT_DTYPES and group % 2 == 0, (dtype, group)  # Int4Weight.dequantize checks these
    E, R, H = packed_ERH.shape
    out = torch.empty(E, R, 2 * H, dtype=dtype, device=packed_ERH.device)
    if out.numel() == 0:
        return out
    block_c = block_c or min(MAX_BLOCK_C, max(16, triton.next_power_of_2(2 * H)))
    block_r = block_r or max(1, TILE // block_c)
    zero = zero_ERG if zero_ERG is not None else scale_ERG  # not read without zero points
    grid = (triton.cdiv(E * R, block_r), triton.cdiv(2 * H, block_c))
    _dequant4_kernel[grid](packed_ERH, scale_ERG, zero, out, E * R, R, H, *packed_ERH.stride(), *scale_ERG.stride(),
                           *zero.stride(), GROUP=group, MXFP4=mxfp4, ZERO=zero_ERG is not None, BLOCK_R=block_r,
                           BLOCK_C=block_c, num_warps=num_warps)
    return out
