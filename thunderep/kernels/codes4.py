"""4-bit codes to floats in registers, exactly and with no integer-to-float instruction: int4 (n - 8) and
e2m1 (MXFP4's values), one code at a time (`codes4`, `nibbles4`, `int4_plane`) or both 16-bit halves of a
32-bit word per operation (`int4_halves`, `e2m1_halves`), and the group scales (`scales4`: int4's float
scales, MXFP4's e8m0 exponents). The decode kernels (pairs4.py) and the dequantization pass (dequant4.py)
convert through these."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["E2M1_UNIT", "codes4", "e2m1_halves", "int4_halves", "int4_halves16", "int4_plane", "nibbles4", "scales4"]

# The e2m1 planes are float16 values 2 ** -14 times the e2m1 value (`e2m1_halves`): sums are scaled back.
E2M1_UNIT: tl.constexpr = tl.constexpr(16384.0)


@triton.jit
def int4_plane(u, SHIFT: tl.constexpr):
    """The int4 codes n at bits SHIFT..SHIFT+3 of u (32-bit, SHIFT <= 16) as float32 n - 8, exactly, one value
    per operation (bytes, single codes): or'ed into the mantissa of 2 ** 23 they read as 2 ** 23 + n * 2 **
    SHIFT, and one multiply-add (exact: integers below 2 ** 24 and powers of two) scales and offsets them."""
    MASK: tl.constexpr = 15 << SHIFT
    STEP: tl.constexpr = 1.0 / (1 << SHIFT)
    OFFSET: tl.constexpr = (1 << (23 - SHIFT)) + 8.0
    f = ((u & MASK) | 0x4B000000).to(tl.float32, bitcast=True)
    return f * STEP - OFFSET


@triton.jit
def int4_halves(w, SHIFT: tl.constexpr, opaque=0):
    """The int4 codes n at bits SHIFT..SHIFT+3 (SHIFT 0 or 4) of each 16-bit half of w as float32 n - 8 (low
    half's, high half's), exactly: one logic operation puts both into float16 1024's mantissa in place
    (1024 + n * 2 ** SHIFT), one float16 multiply-add (exact; both halves in one packed instruction) scales
    and offsets them, then each half is widened (`int4_halves16`). opaque: a uint32 zero (`packed_dot`)."""
    lo, hi = int4_halves16(w, SHIFT, opaque)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def int4_halves16(w, SHIFT: tl.constexpr, opaque=0):
    """`int4_halves` before the widening, in float16 (n - 8 is exact there; `half_chunk` multiplies there)."""
    STEP: tl.constexpr = 1.0 / (1 << SHIFT)
    OFFSET: tl.constexpr = (1024 >> SHIFT) + 8.0
    t = (w.to(tl.uint32, bitcast=True) & (0x000F000F << SHIFT)) | (0x64006400 + opaque)
    lo = t.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo * STEP - OFFSET, hi * STEP - OFFSET


@triton.jit
def e2m1_halves(w, SHIFT: tl.constexpr, opaque=0):
    """The e2m1 codes at bits SHIFT..SHIFT+3 of each 16-bit half of w (int32, SHIFT <= 12) as two float32
    tensors (low half's, high half's), each 2 ** -14 times the e2m1 value (E2M1_UNIT scales back), exactly:
    the sign bit goes to float16's sign (bit 15), the two exponent bits and the mantissa bit to bits 11..9,
    so exponent 0 is a float16 subnormal (0 or 0.5 * 2 ** -14) as e2m1's own subnormal is; float16
    subnormals convert to float32 exactly (float32 subnormals, which the GPU flushes, never arise). Both
    halves in the same two shifts and two logic operations. opaque: a uint32 zero (`packed_dot`)."""
    u = w.to(tl.uint32, bitcast=True)
    if SHIFT <= 9:
        bits = (u << (9 - SHIFT)) & 0x0E000E00
    else:
        bits = (u >> (SHIFT - 9)) & 0x0E000E00
    t = bits | ((u << (12 - SHIFT)) & (0x80008000 + opaque))  # the two sign bits
    lo = t.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def codes4(n, MXFP4: tl.constexpr):
    """4-bit codes n (int32, 0..15) as float32, exactly: e2m1 values (sign bit 8; exponent bits 2..1;
    mantissa bit 0; exponent 0 subnormal), or int4's n - 8; the conversions of `int4_plane` and
    `e2m1_halves`, one value at a time."""
    if MXFP4:
        v, _ = e2m1_halves(n << 12, 12)
        v = v * E2M1_UNIT
    else:
        v = int4_plane(n, 0)
    return v


@triton.jit
def nibbles4(b, MXFP4: tl.constexpr):
    """The two codes of bytes b (int32, 0..255) as float32 (low nibble, high nibble), exactly as `codes4`:
    the high nibble converted in place (no shift) for int4, both nibbles in one pair of halves for e2m1."""
    if MXFP4:
        lo, hi = e2m1_halves((b << 12) | (b << 24), 12)
        lo, hi = lo * E2M1_UNIT, hi * E2M1_UNIT
    else:
        lo, hi = int4_plane(b, 0), int4_plane(b, 4)
    return lo, hi


@triton.jit
def scales4(s_ptrs, ok, MXFP4: tl.constexpr):
    """The group scales at s_ptrs as float32 (0 where not ok): e8m0 exponents as 2 ** (s - 127) (built from
    the bits: s << 23 for s >= 1; s = 0 is 2 ** -127, the float32 subnormal 0x00400000, which is less than
    any of those, so one max picks it), or int4's float scales."""
    if MXFP4:
        s = tl.load(s_ptrs, mask=ok, other=0).to(tl.int32)
        value = tl.maximum(s << 23, 0x00400000).to(tl.float32, bitcast=True)  # s = 0: 2 ** -127's bits
        value = tl.where(ok, value, 0.0)
    else:
        value = tl.load(s_ptrs, mask=ok, other=0.0).to(tl.float32)
    return value
