"""The inline PTX of the 4-bit decode kernels' float16-pair products (thunderep/kernels/half4.py), run through a
bit-exact model of its instructions (ptx_sim.py) on any machine: every code at every position converts to its
exact value in each chain, one word a chain and two, and a chain's sum on any vector the kernels give it is the
exact dot product within float16's rounding. The same chains run compiled in tests/kernels/test_half4.py on a
CUDA GPU; this checks their text where there is none."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("triton")

import ptx_sim  # noqa: E402
from test_half4 import _values, _words  # noqa: E402

from thunderep.kernels import half4  # noqa: E402

# _E2M1_PAIRS's table: its low word is an operand (`opaque | 0x3E3C3800` in `pair_products`), so read it there.
_LOW_TABLE = re.findall(r"opaque \| (0x[0-9A-Fa-f]+)", Path(half4.__file__).read_text())
# name: (the asm, whether it takes two words, the format, the scale of its results: UNIT3 for MODE 3's)
CHAINS = {"int4": (half4._WORD_PRODUCTS.value, False, "int4", 1.0),
          "e2m1_lookup": (half4._E2M1_PAIRS.value, False, "mxfp4", 1.0),
          "e2m1_fp8": (half4._E2M1_FP8.value, False, "mxfp4", half4.UNIT3.value),
          "int4_two_words": (half4._INT4_TWO.value, True, "int4", half4.UNIT3.value),
          "e2m1_fp8_two_words": (half4._E2M1_FP8_TWO.value, True, "mxfp4", half4.UNIT3.value)}


def _chain(name: str, words: np.ndarray, pairs: list[np.ndarray], asm: str | None = None) -> np.ndarray:
    """The chain's float32 results, times its scale: words [..., 1 or 2] (a row's adjacent word positions),
    pairs the vector's float16 pairs p04, p15, p26, p37 of each word position ([..., 1 or 2] 32-bit words)."""
    text, two, _, scale = CHAINS[name]
    asm = asm or text
    if two:
        args = [words[..., 0], words[..., 1]] + [p[..., 0] for p in pairs] + [p[..., 1] for p in pairs]
    else:
        args = [words[..., 0]] + [p[..., 0] for p in pairs]
        if name == "e2m1_lookup":
            args.append(int(_LOW_TABLE[0], 16))
    return ptx_sim.run(asm, *args).view(np.float32).astype(np.float64) * scale


def _unit_pairs(columns: int) -> list[np.ndarray]:
    """[columns, 1, columns // 8, 4 pairs]: for each column q, the vector that is 1 at q and 0 elsewhere, as the
    float16 pairs (8 p + j, 8 p + j + 4) of word position p."""
    pairs = np.zeros((4, columns, columns // 8), dtype=np.int64)
    for q in range(columns):
        position, j = divmod(q, 8)
        pairs[j % 4, q, position] = 0x3C00 << (16 * (j // 4))  # float16 1.0 in the pair's low or high half
    return [p[:, None, :] for p in pairs]


@pytest.mark.parametrize("name", list(CHAINS))
def test_every_code_in_each_chain_is_its_value(name):
    """Each of 2 ** 16 words (pairs of words for the two-word chains), times a unit vector at each of its
    columns, gives exactly that column's code's value: e2m1's table, n - 8 for int4."""
    assert len(_LOW_TABLE) == 1, _LOW_TABLE
    assert not _check_codes(name), name


def _check_codes(name: str, asm: str | None = None) -> list[int]:
    """The columns whose codes some word does not convert to their values."""
    _, two, fmt, _ = CHAINS[name]
    words = _words().numpy()
    words = words.reshape(-1, 2) if two else words[:, None]
    columns = 16 if two else 8
    table = _values(fmt).double().numpy()
    got = _chain(name, words[None], _unit_pairs(columns), asm)  # [columns, words]
    wrong = []
    for q in range(columns):
        want = table[(words[:, q // 8] >> (4 * (q % 8))) & 15]
        if not np.array_equal(got[q], want):
            wrong.append(q)
    return wrong


@pytest.mark.parametrize("name, old, new", [("int4", "0x64086408", "0x64096408"),
                                            ("int4_two_words", "t3, $6, p", "t3, $5, p"),
                                            ("e2m1_fp8", "0x3120", "0x2130"),
                                            ("e2m1_lookup", "0x5919", "0x5909")])
def test_a_wrong_constant_or_operand_is_caught(name, old, new):
    """The check above fails on a chain with one constant or operand changed."""
    text = CHAINS[name][0]
    assert text.count(old) == 1, old
    assert _check_codes(name, text.replace(old, new))


def _f16_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # past float16's range: infinity, as the GPU's conversion
        return x.astype(np.float16).view(np.uint16).astype(np.int64)


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_chain_is_the_dot_product_within_float16_rounding(name):
    """Random words times random float16 vectors whose largest magnitude spans HALF_MIN..HALF_MAX (what
    `half4.half_fits` lets through): |chain - exact| <= gamma_k sum |products| + k subnormal half-quanta, k the
    roundings in the chain (a product and its multiply-adds, then the halves' sum), in float16's unit
    roundoff 2 ** -11 (MODE 3's values at 2 ** -6: the subnormal quantum scaled by its UNIT3)."""
    _, two, fmt, scale = CHAINS[name]
    rng = np.random.default_rng(7)
    rows, positions = 4096, 2 if two else 1
    words = rng.integers(0, 2 ** 32, size=(rows, positions), dtype=np.int64)
    top = 2.0 ** rng.uniform(np.log2(half4.HALF_MIN), np.log2(half4.HALF_MAX), size=(rows, 1))
    v = (rng.standard_normal((rows, 8 * positions)) * top / 4).clip(-top, top).astype(np.float16).astype(np.float64)
    v[np.arange(rows), rng.integers(0, 8 * positions, rows)] = top[:, 0].astype(np.float16)  # the largest
    v_bits = _f16_bits(v).reshape(rows, positions, 8)  # columns 8 p + j
    pairs = [v_bits[..., j] | (v_bits[..., j + 4] << 16) for j in range(4)]
    table = _values(fmt).double().numpy()
    codes = np.stack([table[(words >> (4 * j)) & 15] for j in range(8)], -1).reshape(rows, 8 * positions)
    products = codes * v
    exact = products.sum(1)
    got = _chain(name, words, pairs)
    k = 4 * positions + 1  # the roundings each sum goes through, at most
    u = 2.0 ** -11
    bound = k * u / (1 - k * u) * np.abs(products).sum(1) + k * 2.0 ** -25 * scale
    assert np.isfinite(got).all()
    assert (np.abs(got - exact) <= bound).all(), np.max(np.abs(got - exact) / bound)
    assert np.abs(got - exact).max() > 0  # the vectors are not so kind that nothing rounds


def test_pair16_conversion_puts_its_second_operand_in_the_low_half():
    """`_pair16`'s PTX (`cvt.rn.f16x2.f32 $0, $2, $1`: lo, hi as $1, $2) makes the bits the interpreter's casts
    make (MODE 2)."""
    rng = np.random.default_rng(3)
    lo, hi = (rng.standard_normal(4096) * 2.0 ** rng.uniform(-30, 18, 4096)).astype(np.float32), \
        (rng.standard_normal(4096) * 100).astype(np.float32)
    got = ptx_sim.run("cvt.rn.f16x2.f32 $0, $2, $1;", lo.view(np.uint32), hi.view(np.uint32))
    want = _f16_bits(lo) | (_f16_bits(hi) << 16)
    assert np.array_equal(got.astype(np.int64), want)


def _round_f16(x: Fraction) -> float:
    """x rounded to float16, to nearest even, from its exact value."""
    if x == 0:
        return 0.0
    sign, m = (-1 if x < 0 else 1), abs(x)
    e = max(m.numerator.bit_length() - m.denominator.bit_length() - 1, -15)
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    while e > -14 and Fraction(2) ** e > m:
        e -= 1
    quantum = Fraction(2) ** (max(e, -14) - 10)
    n, rest = divmod(m, quantum)
    n = int(n) + (1 if rest > quantum / 2 or (rest == quantum / 2 and int(n) % 2) else 0)
    value = n * quantum
    return sign * (float("inf") if value >= 65520 else float(value))


def test_the_model_rounds_a_multiply_add_once():
    """`fma.rn.f16x2` in the model against the exact value rounded once, on random float16 triples over the
    whole range (subnormals too) and on ties a double rounding would break the wrong way."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 0x7C00, size=(3, 3000)) | (rng.integers(0, 2, size=(3, 3000)) << 15)
    a, b, c = (bits[i].astype(np.uint16).view(np.float16).astype(np.float64) for i in range(3))
    # (1 + 2 ** -6)(1 + 2 ** -5) is 1 + 48.5 float16 ulps: a tie, to even (down) unless c moves it
    ties = np.array([[1 + 2.0 ** -6, 1 + 2.0 ** -5, c] for c in (2.0 ** -24, -(2.0 ** -24), 0.0)])
    a, b, c = (np.concatenate([x, ties[:, i]]) for i, x in enumerate((a, b, c)))
    got = ptx_sim.run("fma.rn.f16x2 $0, $1, $2, $3;", _f16_bits(a), _f16_bits(b), _f16_bits(c))
    got = (got & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    want = [_round_f16(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a, b, c)]
    assert np.array_equal(got, np.array(want)), np.flatnonzero(got != np.array(want))[:5]
    assert got[-3] > got[-1] == got[-2]  # the tie broken upwards by +2 ** -24 alone
