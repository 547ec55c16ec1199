"""The float16-pair products of the 4-bit decode kernels (thunderep/kernels/half4.py): every code at every
position of a word converts to its exact value, int4's and e2m1's, in every form the kernels run: inline PTX
(compiled on a CUDA GPU; in the interpreter through a model of its instructions, ptx_sim.py) and Triton
operations (the interpreter's own mode)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import ptx_sim  # noqa: E402
from test_int4 import _E2M1, chains_here  # noqa: E402
from test_moe_triton import DEVICE  # noqa: E402

from thunderep.kernels import half4, paths  # noqa: E402

ROWS = 512  # words a program


@triton.jit
def _unit_products_kernel(w_ptr, out_ptr, MODE: tl.constexpr, MXFP4: tl.constexpr, ROWS: tl.constexpr):
    """out[i, q] = word i times a vector that is 1 at column q of the word position and 0 elsewhere: code q's
    value, through `half4.pair_products` (the word in each of the 8 positions of a row of words)."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    q = tl.arange(0, 8)
    w = tl.load(w_ptr + i).to(tl.uint32, bitcast=True)[:, None] + tl.zeros((ROWS, 8), dtype=tl.uint32)
    one_lo = tl.full((8,), 0x3C00, tl.uint32)  # float16 1.0 in the low half
    zero = tl.zeros((8,), dtype=tl.uint32)
    p04 = tl.where(q == 0, one_lo, zero) | tl.where(q == 4, one_lo << 16, zero)
    p15 = tl.where(q == 1, one_lo, zero) | tl.where(q == 5, one_lo << 16, zero)
    p26 = tl.where(q == 2, one_lo, zero) | tl.where(q == 6, one_lo << 16, zero)
    p37 = tl.where(q == 3, one_lo, zero) | tl.where(q == 7, one_lo << 16, zero)
    out = half4.pair_products(w, p04, p15, p26, p37, tl.zeros((ROWS, 8), dtype=tl.uint32), MODE, MXFP4)
    tl.store(out_ptr + i[:, None] * 8 + q[None, :], out)


def _words() -> torch.Tensor:
    """2 ** 16 words: every 16-bit pattern in the low half, another in the high half."""
    u = torch.arange(65536, dtype=torch.int64)
    return u | (((u * 7919 + 12345) % 65536) << 16)


def _values(fmt: str) -> torch.Tensor:
    """Each of the 16 codes' values: e2m1's table for MXFP4, n - 8 for int4."""
    return torch.tensor(_E2M1 if fmt == "mxfp4" else [n - 8.0 for n in range(16)])


def _modes(fmt: str, monkeypatch) -> list[int]:
    """The HALF modes to check for fmt: on a CUDA GPU the one `paths.half_mode` picks, and both one word a chain
    (1) and two (3) where it has MXFP4's FP8 conversion (sm_89 and later); in the interpreter its Triton
    operations (2), and 1 and 3 through the PTX model."""
    mode = paths.half_mode(torch.device(DEVICE), fmt)
    if DEVICE != "cuda":
        ptx_sim.in_interpreter(monkeypatch)
        return [mode, 1, 3]
    two = mode in (1, 3) and (fmt == "int4" or torch.cuda.get_device_capability() >= (8, 9))
    return [1, 3] if two else [mode]


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_pair_products_convert_every_code_exactly(fmt, monkeypatch):
    """Each of 2 ** 16 words, times a unit vector at each of its 8 columns, gives exactly that column's code's
    value: the table for e2m1 (the subnormal 0.5 and every sign; 2 ** -6 times it through the FP8 conversion,
    HALF 3), n - 8 for int4. Code j is nibble j % 4 of half j // 4."""
    words = _words()
    table = _values(fmt)
    want = torch.empty(65536, 8)
    for j in range(8):
        want[:, j] = table[(words >> (4 * j)) & 15]
    for mode in _modes(fmt, monkeypatch):
        assert mode in (1, 2, 3), mode
        out = torch.full((65536, 8), float("nan"), device=DEVICE)
        _unit_products_kernel[(65536 // ROWS,)](words.to(torch.int32).to(DEVICE), out, MODE=mode,
                                                MXFP4=fmt == "mxfp4", ROWS=ROWS)
        unit = half4.UNIT3.value if mode == 3 and fmt == "mxfp4" else 1.0  # int4's single words: unscaled
        assert torch.equal(out.cpu() * unit, want), mode  # values: a zero's sign is a sum's, not the code's


@triton.jit
def _unit_pair_products_kernel(w_ptr, out_ptr, MXFP4: tl.constexpr, ROWS: tl.constexpr):
    """out[i, q] = words 2 i and 2 i + 1 as one row's two word positions times a vector that is 1 at column q
    (0..15) and 0 elsewhere, through `half4.word_pair_products`."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pos = tl.arange(0, 2)
    w = tl.load(w_ptr + 2 * i[:, None] + pos[None, :]).to(tl.uint32, bitcast=True)
    one_lo = tl.full((2,), 0x3C00, tl.uint32)
    zero = tl.zeros((2,), dtype=tl.uint32)
    for q in tl.static_range(16):
        at = pos == q // 8
        j = q % 8
        p04 = tl.where(at & (j == 0), one_lo, zero) | tl.where(at & (j == 4), one_lo << 16, zero)
        p15 = tl.where(at & (j == 1), one_lo, zero) | tl.where(at & (j == 5), one_lo << 16, zero)
        p26 = tl.where(at & (j == 2), one_lo, zero) | tl.where(at & (j == 6), one_lo << 16, zero)
        p37 = tl.where(at & (j == 3), one_lo, zero) | tl.where(at & (j == 7), one_lo << 16, zero)
        out = half4.word_pair_products(w, p04, p15, p26, p37, MXFP4)  # [ROWS, 1]
        tl.store(out_ptr + i[:, None] * 16 + q, out)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_word_pair_products_convert_every_code_exactly(fmt, monkeypatch):
    """Two words a float16 chain (HALF 3; MXFP4 through the FP8 conversion): each of 2 ** 16 word pairs times a
    unit vector at each of its 16 columns gives 2 ** -6 times that column's code's value (inline PTX: in the
    interpreter through the PTX model)."""
    chains_here(monkeypatch, fp8_conversion=fmt == "mxfp4")
    words = _words()
    table = _values(fmt)
    want = torch.empty(32768, 16)
    for q in range(16):
        want[:, q] = table[(words[q // 8::2] >> (4 * (q % 8))) & 15]
    out = torch.full((32768, 16), float("nan"), device=DEVICE)
    _unit_pair_products_kernel[(32768 // ROWS,)](words.to(torch.int32).to(DEVICE), out, MXFP4=fmt == "mxfp4",
                                                 ROWS=ROWS)
    assert torch.equal(out.cpu() * half4.UNIT3.value, want)


def test_int4_codes_scaled_in_their_placing_multiply_adds_are_their_values():
    """`half4._INT4_SCALED`'s constants, each multiply-add computed exactly and rounded once to float16 as
    `fma.rn.f16x2` does: a code n placed as 1024 + n (low nibbles) or 1024 + 16 n (high nibbles) becomes exactly
    (n - 8) 2 ** -6."""
    def half(bits):
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).double().item()

    fragment = half4._INT4_TWO.value
    consts = {name: int(fragment.split(f"mov.b32 {name}, ")[1][:10], 16) & 0xFFFF for name in ("s0", "o0", "s1", "o1")}
    n = torch.arange(16, dtype=torch.float64)
    low = ((1024 + n) * half(consts["s0"]) + half(consts["o0"])).half()
    high = ((1024 + 16 * n) * half(consts["s1"]) + half(consts["o1"])).half()
    want = ((n - 8) / 64).half()
    assert torch.equal(low, want) and torch.equal(high, want)
    assert torch.equal(want.double() * 64, n - 8)  # exact in float16


def test_e2m1_codes_placed_as_fp8_bytes_are_their_values():
    """The bit placement of `half4._E2M1_FP8`, step for step in integer operations here: after the middle bytes'
    swap, each byte's even code (shifted up 2, its sign up 4) and odd code (shifted down 2, its sign in place)
    read as e4m3 are exactly 2 ** -6 times the e2m1 values, in the order (j, j + 4) of the vector pairs."""
    words = _words()
    w = (words & 0xFF) | ((words >> 16) & 0xFF) << 8 | ((words >> 8) & 0xFF) << 16 | ((words >> 24) & 0xFF) << 24
    assert "prmt.b32 w, $1, 0, 0x3120;" in half4._E2M1_FP8.value  # the swap above
    e = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    o = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)

    def fp8(word, byte):
        return ((word >> (8 * byte)) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()

    got = torch.stack([fp8(e, 0), fp8(o, 0), fp8(e, 2), fp8(o, 2),  # t0..t3's low halves: codes 0..3
                       fp8(e, 1), fp8(o, 1), fp8(e, 3), fp8(o, 3)], 1)  # high halves: codes 4..7
    table = _values("mxfp4")
    want = torch.stack([table[(words >> (4 * j)) & 15] for j in range(8)], 1)
    assert torch.equal(got * half4.UNIT3.value, want)


@pytest.mark.parametrize("capability, asked, want", [((8, 6), None, {"int4": 3, "mxfp4": 1}),
                                                     ((8, 9), None, {"int4": 3, "mxfp4": 3}),
                                                     ((9, 0), None, {"int4": 3, "mxfp4": 3}),
                                                     ((12, 0), "2", {"int4": 3, "mxfp4": 3}),
                                                     ((8, 6), "2", {"int4": 3, "mxfp4": 1}),
                                                     ((9, 0), "1", {"int4": 1, "mxfp4": 1}),
                                                     ((9, 0), "0", {"int4": 0, "mxfp4": 0}),
                                                     ((7, 5), None, {"int4": 0, "mxfp4": 0})])
def test_half_mode_takes_two_words_a_chain_where_asked_and_the_gpu_has_it(monkeypatch, capability, asked, want):
    """Unset or THUNDEREP_HALF_PRODUCTS=2, two words a chain (HALF 3): int4 on every GPU of sm_80 and later, MXFP4
    through the FP8 conversion on sm_89 and later (before, one word a chain, 1); =1 one word, =0 float32; before
    sm_80, float32."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if asked is None:
        monkeypatch.delenv("THUNDEREP_HALF_PRODUCTS", raising=False)
    else:
        monkeypatch.setenv("THUNDEREP_HALF_PRODUCTS", asked)
    monkeypatch.setattr(paths, "_capability", lambda index: capability)
    assert {fmt: paths.half_mode(torch.device("cuda", 0), fmt) for fmt in want} == want
    assert paths.half_mode(torch.device("cuda", 0), "fp8") == 0


def test_half_products_switch_rejects_other_values(monkeypatch):
    from thunderep.errors import ConfigError

    monkeypatch.setenv("THUNDEREP_HALF_PRODUCTS", "3")
    with pytest.raises(ConfigError, match=r"THUNDEREP_HALF_PRODUCTS='3': use 0 \(float32 products\), 1 or 2"):
        paths.half_mode(torch.device("cuda", 0), "mxfp4")
