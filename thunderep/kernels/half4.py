"""4-bit words times a vector in float16 pairs: the decode kernels' products at fewer instructions a weight
(pairs4.py's HALF chunk), int4 as below, e2m1 (MXFP4) by a byte lookup (`_E2M1_PAIRS`, after the int4 part).

pairs4.py's word chunk converts each code to float32 and multiplies there: about 4.5-5 instructions a
weight, which is what holds the one-token pair kernels under the bandwidth their loads alone reach
(docs/benchmarks/2026-12-05-int4-experts-h200.md). Here a word's 8 codes stay in float16 pairs: one logic
operation puts two codes into float16 1024's mantissa (`codes4.int4_halves16`'s trick), one packed
multiply-add makes them n - 8 exactly, one packed multiply-add per two codes multiplies them by the
vector's float16 pairs and sums, and each word's two halves (4 products each) are widened and added once:
about 16 instructions a word instead of some 25. On CUDA that is inline PTX (`lop3`, `fma.rn.f16x2`,
`cvt.rn.f16x2.f32`: sm_80 and later, nothing Hopper-only); Triton's interpreter, which runs no PTX, runs
the same sums in float16 tensor operations (MODE 2), which round where the PTX rounds except that a
multiply-add there rounds twice.

Float16 holds the products only where the vector's magnitudes fit: a half's sum of 4 products is at most
32 times the vector's largest magnitude (|n - 8| <= 8), under float16's largest finite 65504 while that
magnitude is at most HALF_MAX; and the vector's smallest elements keep their weight in the sum while it is
at least HALF_MIN (an element under float16's smallest normal, 2 ** -14, is then under 2 ** -6 of the
largest, and its rounding under 2 ** -25 absolute). `packed_dot` measures the vector once per program and
runs the float32 chunk for a vector outside that range, so no input overflows or loses its small elements.

e2m1 codes: a code's low 3 bits index its magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6), each a float16 whose low
byte is 0, so one byte permute (`prmt`, sm_20 and later) looks up 4 codes' high bytes from an 8-byte table
held in two registers; another permute places two of them as a float16 pair (its zero bytes are the
sign-replicated copies of a byte under 0x80), and one logic operation ors the two sign bits in. About 15
instructions for a word's 8 values, where placing the bits by shifts needed a packed multiply by 2 ** 14
after them (float16's exponent bias) and some 23. The values are exact and at most 6 in magnitude, so int4's
range bounds hold as they are. (That shift form, timed earlier with the vector read through planes, made the
one-token gate/up pass slower: docs/benchmarks/2026-12-05-int4-experts-h200.md, 2026-12-07.)

MODE 3 (`paths.half_mode`) converts the codes at 2 ** -6 times their values and sums two adjacent words' 16
products in one float16 chain, its halves added in float16 and widened once (`word_pair_products`; one word a
chain where a chunk has an odd number of words or a group other than a multiple of 16 columns, or the vector
goes through planes: e2m1's as below, int4's as MODE 1): e2m1's through the FP8 conversion (sm_89 and
later: each code's bits placed as an e4m3 byte are exactly 2 ** -6 times its value, and one conversion makes
two such bytes a float16 pair, about 12 instructions for a word's 8 values against the lookup's 15,
`_E2M1_FP8`), int4's by the placing multiply-adds scaled (`_INT4_SCALED`, no extra instruction). The products
and sums are 2 ** -6 times MODE 1's, scaled back once a group (UNIT3); they round alike but where a product
falls under float16's smallest normal (an element under 2 ** -7 times a value of 0.5): its rounding is then at
most 2 ** -25, 2 ** -19 in the values' units, under float16's own rounding of a half's sum once the vector's
largest magnitude is at least HALF_MIN; the longer chain and the halves' float16 sum round at 2 ** -11 of a
chain's sum. 16 products stay at most 2 times the vector's largest magnitude, far inside float16's range.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes4 import E2M1_UNIT, e2m1_halves, int4_halves16
from .vector4 import vector_words

__all__ = ["HALF_MAX", "HALF_MIN", "UNIT3", "half_fits", "half_word_products", "pair_products",
           "vector_pairs", "word_pair_products"]

HALF_MAX = 1024.0  # the largest vector magnitude the float16 products take (32 x 1024 < 65504, with margin)
HALF_MIN = 2.0 ** -8  # the smallest largest-magnitude they take (see the module's doc)

# The end of both conversions below: the 4 float16 pairs of codes t0..t3 times the vector's pairs, each half's
# 4 products summed in float16, the halves widened and added.
_CHAIN = """mul.f16x2 p, t0, $2;
fma.rn.f16x2 p, t1, $3, p;
fma.rn.f16x2 p, t2, $4, p;
fma.rn.f16x2 p, t3, $5, p;
"""
_PRODUCTS = _CHAIN + """mov.b32 {plo, phi}, p;
cvt.f32.f16 flo, plo;
cvt.f32.f16 fhi, phi;
add.f32 $0, flo, fhi;
}"""
# A chain's end with its halves added in float16 and widened once (MODE 3: a word's 8 products are at most
# 48 x 2 ** -6 times the vector's largest magnitude, two words' 16 at most 2 times, far under float16's largest).
_WIDENED_ONCE = """mov.b32 {plo, phi}, p;
add.f16 plo, plo, phi;
cvt.f32.f16 $0, plo;
}"""
_PRODUCTS_SUMMED = _CHAIN + _WIDENED_ONCE
# A word's 8 int4 codes n placed into float16 pairs t0..t3 as 1024 + n (t0, t2) and 1024 + 16 n (t1, t3).
_INT4_PLACED = """shr.b32 w8, {word}, 8;
lop3.b32 t0, {word}, 0x000F000F, 0x64006400, 0xea;
lop3.b32 t1, {word}, 0x00F000F0, 0x64006400, 0xea;
lop3.b32 t2, w8, 0x000F000F, 0x64006400, 0xea;
lop3.b32 t3, w8, 0x00F000F0, 0x64006400, 0xea;
"""
# One word's 8 int4 codes (nibble j: column 8 q + j, in half j // 4 at bits 4 (j % 4)) times the vector's
# 4 float16 pairs ($2..$5: columns (8q, 8q+4), (8q+1, 8q+5), (8q+2, 8q+6), (8q+3, 8q+7)), as one float32.
_WORD_PRODUCTS = tl.constexpr("""{
.reg .b32 off, step, shift, t0, t1, t2, t3, w8, p;
.reg .f16 plo, phi;
.reg .f32 flo, fhi;
mov.b32 off, 0x64086408;
mov.b32 step, 0x2C002C00;
mov.b32 shift, 0xD480D480;
""" + _INT4_PLACED.format(word="$1") + """sub.f16x2 t0, t0, off;
fma.rn.f16x2 t1, t1, step, shift;
sub.f16x2 t2, t2, off;
fma.rn.f16x2 t3, t3, step, shift;
""" + _PRODUCTS)
# (1024 + n) - 1032 = n - 8 (0x6408: 1032); (1024 + 16 n) / 16 - 72 = n - 8 (0x2C00: 1 / 16, 0xD480: -72):
# exact in float16, as the codes' conversions of codes4.py.

# The same for e2m1 codes (MXFP4). Magnitude table, float16 high bytes of 0, 0.5, 1, 1.5 (tlo) and 2, 3, 4, 6
# (thi). a, b: the magnitudes' bytes of codes 0..3 and 4..7 (the sign bits masked off the selectors: a set one
# would replicate the byte's sign). t_j = bytes (0, a_j, 0, b_j): selector nibbles 8 + j (a_j's sign
# replicated: 0), j, 8 + j, 4 + j. Then code j's and j + 4's sign bits (bits 4 j + 3, 4 j + 19) shifted to 15
# and 31 and or'ed in.
_E2M1_PAIRS = tl.constexpr("""{
.reg .b32 thi, m, a, b, t0, t1, t2, t3, p;
.reg .f16 plo, phi;
.reg .f32 flo, fhi;
mov.b32 thi, 0x46444240;
and.b32 m, $1, 0x77777777;
prmt.b32 a, $6, thi, m;
shr.b32 m, m, 16;
prmt.b32 b, $6, thi, m;
prmt.b32 t0, a, b, 0x4808;
prmt.b32 t1, a, b, 0x5919;
prmt.b32 t2, a, b, 0x6A2A;
prmt.b32 t3, a, b, 0x7B3B;
shl.b32 m, $1, 12;
lop3.b32 t0, m, 0x80008000, t0, 0xea;
shl.b32 m, $1, 8;
lop3.b32 t1, m, 0x80008000, t1, 0xea;
shl.b32 m, $1, 4;
lop3.b32 t2, m, 0x80008000, t2, 0xea;
lop3.b32 t3, $1, 0x80008000, t3, 0xea;
""" + _PRODUCTS)
# The same for e2m1 codes through the GPU's FP8 conversion (MODE 3: sm_89 and later). A code's sign to bit 7 of
# a byte and its exponent and mantissa bits to bits 4..2 make the e4m3 byte of exactly 2 ** -6 times its value
# (e2m1's subnormal 0.5 e4m3's subnormal 2 ** -7), so one word takes each byte's even code (e: low nibble,
# shifted up 2, its sign up 4) and another each byte's odd code (o: high nibble, shifted down 2, its sign in
# place), and one conversion makes each 16-bit half of them a float16 pair. The byte permute first swaps the
# word's middle bytes, so the halves come out as codes (j, j + 4), the vector pairs' order. The products are
# 2 ** -6 times MODE 1's; the chunk's sums are scaled back (UNIT3). A word's two halves are added in
# float16 (`_PRODUCTS_SUMMED`: one instruction fewer a word).
_FP8_BYTES = """prmt.b32 w, {word}, 0, 0x3120;
shr.b32 o, w, 2;
and.b32 s, w, 0x80808080;
lop3.b32 o, o, 0x1C1C1C1C, s, 0xea;
shl.b32 e, w, 2;
shl.b32 s, w, 4;
and.b32 s, s, 0x80808080;
lop3.b32 e, e, 0x1C1C1C1C, s, 0xea;
mov.b32 {{elo, ehi}}, e;
mov.b32 {{olo, ohi}}, o;
cvt.rn.f16x2.e4m3x2 t0, elo;
cvt.rn.f16x2.e4m3x2 t1, olo;
cvt.rn.f16x2.e4m3x2 t2, ehi;
cvt.rn.f16x2.e4m3x2 t3, ohi;
"""
_FP8_REGS = """{
.reg .b32 w, e, o, s, t0, t1, t2, t3, p;
.reg .b16 elo, ehi, olo, ohi;
.reg .f16 plo, phi;
.reg .f32 flo, fhi;
"""
_E2M1_FP8 = tl.constexpr(_FP8_REGS + _FP8_BYTES.format(word="$1") + _PRODUCTS_SUMMED)


def _two_words(regs: str, convert: str) -> tl.constexpr:
    """Two words ($1, $2: word positions 2 q and 2 q + 1 of a row), each converted by `convert` into float16
    pairs t0..t3 at 2 ** -6 times the values, times their vector pairs ($3..$6, $7..$10): all 16 products in one
    float16 chain (at most 16 x 8 x 2 ** -6 = 2 times the vector's largest magnitude), its halves added in
    float16 and widened once ($0)."""
    return tl.constexpr(regs + convert.format(word="$1") + """mul.f16x2 p, t0, $3;
fma.rn.f16x2 p, t1, $4, p;
fma.rn.f16x2 p, t2, $5, p;
fma.rn.f16x2 p, t3, $6, p;
""" + convert.format(word="$2") + """fma.rn.f16x2 p, t0, $7, p;
fma.rn.f16x2 p, t1, $8, p;
fma.rn.f16x2 p, t2, $9, p;
fma.rn.f16x2 p, t3, $10, p;
""" + _WIDENED_ONCE)


_E2M1_FP8_TWO = _two_words(_FP8_REGS, _FP8_BYTES)
# int4 codes placed as for `_WORD_PRODUCTS` (`_INT4_PLACED`), then scaled by 2 ** -6 in the same multiply-adds:
# (1024 + n) 2 ** -6 - 16.125 and (1024 + 16 n) 2 ** -10 - 1.125 are (n - 8) 2 ** -6, exactly (0x2400: 2 ** -6,
# 0xCC08: -16.125, 0x1400: 2 ** -10, 0xBC80: -1.125).
_INT4_SCALED = _INT4_PLACED + """fma.rn.f16x2 t0, t0, s0, o0;
fma.rn.f16x2 t1, t1, s1, o1;
fma.rn.f16x2 t2, t2, s0, o0;
fma.rn.f16x2 t3, t3, s1, o1;
"""
_INT4_TWO = _two_words("""{
.reg .b32 s0, o0, s1, o1, t0, t1, t2, t3, w8, p;
.reg .f16 plo, phi;
mov.b32 s0, 0x24002400;
mov.b32 o0, 0xCC08CC08;
mov.b32 s1, 0x14001400;
mov.b32 o1, 0xBC80BC80;
""", _INT4_SCALED)
UNIT3: tl.constexpr = tl.constexpr(64.0)  # MODE 3's products are 2 ** -6 times the values'

@triton.jit
def half_fits(top):
    """Whether a vector of largest magnitude `top` runs the float16 products (`HALF_MIN` <= top <= `HALF_MAX`;
    a NaN or infinite top does not)."""
    return (top <= 1024.0) & (top >= 0.00390625)


@triton.jit
def _pair16(lo, hi, MODE: tl.constexpr):
    """[HW] float32 elements as float16 pairs in one 32-bit word (lo in the low half): MODE 1 one PTX
    conversion; MODE 2 (the interpreter) the same bits from Triton casts."""
    if MODE == 1 or MODE == 3:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        lo16 = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi16 = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        return lo16 | (hi16 << 16)


@triton.jit
def _half(p, HALF: tl.constexpr):
    """The float16 in half HALF (0 low, 1 high) of each 32-bit word of p."""
    return ((p >> (16 * HALF)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _codes16(w, J: tl.constexpr, opaque, MXFP4: tl.constexpr):
    """Codes J and J + 4 of each word of w as float16 (low half's, high half's), the values exactly: int4's
    n - 8 (`codes4.int4_halves16`), e2m1's (`codes4.e2m1_halves` times E2M1_UNIT: exact, at most 6)."""
    if MXFP4:
        lo, hi = e2m1_halves(w, 4 * J, opaque)
        return (lo * E2M1_UNIT).to(tl.float16), (hi * E2M1_UNIT).to(tl.float16)
    else:
        return int4_halves16(w >> (8 * (J // 2)), 4 * (J % 2), opaque)


@triton.jit
def pair_products(w, p04, p15, p26, p37, opaque, MODE: tl.constexpr, MXFP4: tl.constexpr = False):
    """[BLOCK_N, HW] float32: each word of w (int4 or, MXFP4, e2m1 codes, [BLOCK_N, HW]) times the vector's 4
    float16 pairs ([HW] 32-bit words: columns (8q, 8q+4), (8q+1, 8q+5), (8q+2, 8q+6), (8q+3, 8q+7)), summed
    over the word's 8 values: each half's 4 products summed in float16, then the halves widened and added.
    MODE 1: inline PTX; 2: Triton operations (the interpreter). opaque: a uint32 zero
    (`pairs4.packed_dot`)."""
    if MODE == 1 and MXFP4:  # the table's low word ($6) one register for all words, the high one an immediate
        return tl.inline_asm_elementwise(_E2M1_PAIRS, "=r,r,r,r,r,r,r",
                                         [w.to(tl.uint32, bitcast=True), p04[None, :], p15[None, :], p26[None, :],
                                          p37[None, :], opaque | 0x3E3C3800], dtype=tl.float32, is_pure=True, pack=1)
    elif MODE == 3 and MXFP4:  # 2 ** -6 times MODE 1's sums
        return tl.inline_asm_elementwise(_E2M1_FP8, "=r,r,r,r,r,r",
                                         [w.to(tl.uint32, bitcast=True), p04[None, :], p15[None, :],
                                          p26[None, :], p37[None, :]], dtype=tl.float32, is_pure=True, pack=1)
    elif MODE == 1 or MODE == 3:
        return tl.inline_asm_elementwise(_WORD_PRODUCTS, "=r,r,r,r,r,r",
                                         [w.to(tl.uint32, bitcast=True), p04[None, :], p15[None, :],
                                          p26[None, :], p37[None, :]], dtype=tl.float32, is_pure=True, pack=1)
    else:
        lo, hi = _codes16(w, 0, opaque, MXFP4)
        p_lo = lo * _half(p04, 0)[None, :]
        p_hi = hi * _half(p04, 1)[None, :]
        lo, hi = _codes16(w, 1, opaque, MXFP4)
        p_lo += lo * _half(p15, 0)[None, :]
        p_hi += hi * _half(p15, 1)[None, :]
        lo, hi = _codes16(w, 2, opaque, MXFP4)
        p_lo += lo * _half(p26, 0)[None, :]
        p_hi += hi * _half(p26, 1)[None, :]
        lo, hi = _codes16(w, 3, opaque, MXFP4)
        p_lo += lo * _half(p37, 0)[None, :]
        p_hi += hi * _half(p37, 1)[None, :]
        return p_lo.to(tl.float32) + p_hi.to(tl.float32)


@triton.jit
def word_pair_products(w, p04, p15, p26, p37, MXFP4: tl.constexpr):
    """[BLOCK_N, HW / 2] float32 (MODE 3): two adjacent words of a row (word positions 2 q and 2 q + 1, HW even),
    converted at 2 ** -6 times their values (MXFP4: through the FP8 conversion, sm_89 and later; int4: scaled in
    its placing multiply-adds) and their 16 products summed in one float16 chain, widened once; 2 ** -6 times
    the values' sums (UNIT3). Arguments as `pair_products`'."""
    wa, wb = _pairs_of(w.to(tl.uint32, bitcast=True))
    a04, b04 = _pairs_of(p04)
    a15, b15 = _pairs_of(p15)
    a26, b26 = _pairs_of(p26)
    a37, b37 = _pairs_of(p37)
    return tl.inline_asm_elementwise(_E2M1_FP8_TWO if MXFP4 else _INT4_TWO, "=r,r,r,r,r,r,r,r,r,r,r",
                                     [wa, wb, a04[None, :], a15[None, :], a26[None, :], a37[None, :],
                                      b04[None, :], b15[None, :], b26[None, :], b37[None, :]],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _pairs_of(x):
    """x's even and odd elements along its last dimension (of even size)."""
    if len(x.shape) == 2:
        return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    else:
        return tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))


@triton.jit
def half_word_products(w, x0, x4, x1, x5, x2, x6, x3, x7, opaque, MODE: tl.constexpr, MXFP4: tl.constexpr = False):
    """`pair_products` of the vector's 8 planes ([HW] float32, `vector4.planes`' order), each two made one
    float16 pair. The vector must fit (`half_fits`)."""
    return pair_products(w, _pair16(x0, x4, MODE), _pair16(x1, x5, MODE), _pair16(x2, x6, MODE),
                         _pair16(x3, x7, MODE), opaque, MODE, MXFP4)


@triton.jit
def vector_pairs(v_ptr, k0, C, HW: tl.constexpr, MODE: tl.constexpr):
    """A 16-bit vector's chunk at column k0 (C a multiple of 8; zero past C) as the 4 float16 pairs
    `pair_products` takes ([HW] 32-bit words: columns (8q, 8q+4), (8q+1, 8q+5), (8q+2, 8q+6), (8q+3, 8q+7)):
    each word position's 16 bytes in one load as 4 words, split in registers (the load's own layout: no
    shared memory, no barriers, where `vector4.planes`' split of a flat load goes through shared memory), and
    each pair made from two of those words: float16 halves moved into place; bfloat16 ones widened by a shift
    or a mask and converted as `_pair16` (the same bits as from `planes`). Timed with the vector written in
    this layout beforehand (`examples/pairs4_profile.py --paired-vector`): Mixtral's one-token pair 8.6% faster."""
    w01, w23, w45, w67 = vector_words(v_ptr, k0, C, HW)
    if v_ptr.dtype.element_ty == tl.float16:
        p04 = (w01 & 0xFFFF) | (w45 << 16)
        p15 = (w01 >> 16) | (w45 & 0xFFFF0000)
        p26 = (w23 & 0xFFFF) | (w67 << 16)
        p37 = (w23 >> 16) | (w67 & 0xFFFF0000)
    else:  # bfloat16: float32's top half
        p04 = _pair16(_low_bf16(w01), _low_bf16(w45), MODE)
        p15 = _pair16(_high_bf16(w01), _high_bf16(w45), MODE)
        p26 = _pair16(_low_bf16(w23), _low_bf16(w67), MODE)
        p37 = _pair16(_high_bf16(w23), _high_bf16(w67), MODE)
    return p04, p15, p26, p37


@triton.jit
def _low_bf16(w):
    return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _high_bf16(w):
    return (w & 0xFFFF0000).to(tl.float32, bitcast=True)
