"""4-bit expert weights (thunderep/kernels/int4.py): the packed format against plain loops, and the
4-bit pair kernels (pairs4.py) and the sorted path on them against the float64 reference on the exactly
dequantized weights: compiled on a CUDA GPU where one is present, else in Triton's CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from thunderep.errors import InputError
from thunderep.kernels.int4 import Int4Weight

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _loop_dequantize(w: Int4Weight) -> torch.Tensor:
    """W[e, r, c] from the bytes one value at a time (float64): low nibble first, group c // G."""
    E, R, C = w.shape
    out = torch.empty(E, R, C, dtype=torch.float64)
    for e in range(E):
        for r in range(R):
            for c in range(C):
                n = (int(w.packed[e, r, c // 2]) >> (4 * (c % 2))) & 15
                g = c // w.group
                if w.fmt == "mxfp4":
                    out[e, r, c] = _E2M1[n] * 2.0 ** (int(w.scale[e, r, g]) - 127)
                else:
                    zero = int(w.zero[e, r, g]) if w.zero is not None else 0
                    out[e, r, c] = (n - 8 - zero) * float(w.scale[e, r, g])
    return out


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 8), ("mxfp4", 32)])
def test_quantize_round_trip_and_dequantize_equals_a_loop(fmt, group):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 6, 40, generator=gen) * torch.logspace(-3, 1, 6)[:, None]  # rows of very different size
    w[1, :2] = 0.0  # an all-zero group stays zero
    q = Int4Weight.quantize(w.to(torch.bfloat16), fmt, group)
    G = q.group
    assert q.packed.shape == (2, 6, 20) and q.scale.shape == (2, 6, -(-40 // G)) and q.shape == (2, 6, 40)
    deq = q.dequantize(dtype=torch.float64)
    assert torch.equal(deq, _loop_dequantize(q))
    assert torch.equal(deq[1, :2], torch.zeros(2, 40, dtype=torch.float64))
    wb = w.to(torch.bfloat16).double()
    amax = torch.nn.functional.pad(wb, (0, -(-40 // G) * G - 40)).view(2, 6, -1, G).abs().amax(-1)
    amax = amax.repeat_interleave(G, -1)[..., :40]
    # int4: within half a step (amax / 14); e2m1: within half a step of the top binade (amax / 8 at most)
    bound = amax / (14 if fmt == "int4" else 4) * 1.001
    assert bool(((deq - wb).abs() <= bound).all())
    assert torch.equal(q.dequantize(slice(1, 2), torch.float64), deq[1:2])


def test_int4_weight_rejects_what_the_kernels_cannot_read():
    packed = torch.zeros(2, 8, 8, dtype=torch.uint8)
    with pytest.raises(InputError, match=r"scale must be float32, bfloat16 or float16 \(2, 8, 1\)"):
        Int4Weight(packed, torch.ones(2, 8, 2), 16, torch.bfloat16)
    with pytest.raises(InputError, match="32 for mxfp4"):
        Int4Weight(packed, torch.ones(2, 8, 1, dtype=torch.uint8), 16, torch.bfloat16, "mxfp4")
    with pytest.raises(InputError, match="uint8"):
        Int4Weight(packed.float(), torch.ones(2, 8, 1), 16, torch.bfloat16)
    with pytest.raises(InputError, match="bfloat16 or float16"):
        Int4Weight(packed, torch.ones(2, 8, 1), 16, torch.float32)
    with pytest.raises(InputError, match="zero must be int8"):
        Int4Weight(packed, torch.ones(2, 8, 1), 16, torch.bfloat16, zero=torch.zeros(2, 8, 1))
    with pytest.raises(InputError, match="C even"):
        Int4Weight.quantize(torch.ones(1, 4, 7))


# ---- the kernels on 4-bit weights ----------------------------------------------------------------------

triton = pytest.importorskip("triton")

from test_moe_triton import DEVICE, make_case, reference, rel_err  # noqa: E402

from thunderep.kernels import decode  # noqa: E402
from thunderep.kernels.ops import moe_mlp, routed_moe_mlp  # noqa: E402


def _asymmetric(w: Int4Weight, seed: int) -> Int4Weight:
    """w with random zero points in [-3, 3] (compressed-tensors' asymmetric int4)."""
    zero = torch.randint(-3, 4, w.scale.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    zero = zero.to(w.scale.device)
    return Int4Weight(w.packed, w.scale, w.group, w.dtype, "int4", zero)


def _check(T, D, I, E, K, dtype, fmt, group, tol, seed=0, ids=None, zero=False, weighted=True, interleaved=False):
    x, w_gu, w_d, drawn, weights = make_case(T, D, I, E, K, dtype, seed)
    ids = drawn if ids is None else ids.to(DEVICE)
    q_gu, q_d = Int4Weight.quantize(w_gu, fmt, group), Int4Weight.quantize(w_d, fmt, group)
    if zero:
        q_gu, q_d = _asymmetric(q_gu, seed), _asymmetric(q_d, seed + 1)
    weights = weights.to(dtype) if weighted else None
    with torch.no_grad():
        y = routed_moe_mlp(x, q_gu, q_d, ids, weights, interleaved=interleaved)
    ref_w = weights.double() if weighted else torch.ones(T, K, dtype=torch.float64, device=DEVICE)
    known = (ids >= 0) & (ids < E)
    y_ref = reference(x.double(), q_gu.dequantize(dtype=torch.float64), q_d.dequantize(dtype=torch.float64),
                      torch.where(known, ids, 0), torch.where(known, ref_w, 0.0), interleaved=interleaved)
    assert y.shape == (T, D) and y.dtype == dtype
    assert rel_err(y, y_ref) < tol, f"relative error {rel_err(y, y_ref):.2e} against the reference"
    return y


def chains_here(monkeypatch, fp8_conversion: bool = True):
    """Where a test of the float16 chains (inline PTX, half4.py) runs: compiled on a CUDA GPU, skipped below sm_89
    where it needs MXFP4's FP8 conversion; without one, the interpreter runs their PTX through ptx_sim's model, in
    the HALF modes an sm_89 or later GPU runs (1, or 3 where THUNDEREP_HALF_PRODUCTS=2 asks for two words a
    chain)."""
    import ptx_sim
    from thunderep import env
    from thunderep.kernels import paths

    if DEVICE == "cuda":
        if fp8_conversion and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("the FP8 conversion runs on sm_89 and later")
        return
    ptx_sim.in_interpreter(monkeypatch)
    monkeypatch.setattr(paths, "half_mode", lambda device, fmt: 3 if env.half_products() == 2 else 1)


@pytest.fixture(params=["pairs", "sorted", "sorted4"])
def path(request, monkeypatch):
    """Pin inference on the 4-bit pair kernels, on the sorted path with dequantized weights, or on the
    sorted kernels reading the packed bytes (sorted4.py)."""
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30) if request.param == "pairs" else "0")
    monkeypatch.setenv("THUNDEREP_SORTED4", "packed" if request.param == "sorted4" else "dequant")
    return request.param


CASES = [  # T, D, I, E, K, fmt, group, zero points
    (3, 64, 48, 4, 2, "mxfp4", 32, False),
    (2, 64, 40, 4, 2, "int4", 32, False),  # I = 40: a partial group of 8 at the end of each down row
    (3, 48, 32, 3, 3, "int4", 16, True),  # asymmetric: zero points per group
    (2, 48, 48, 3, 2, "int4", 24, True),  # a group that is no power of two: a scale per word
    # rows of 22 and 18 bytes (not 4-byte aligned): the pair kernels read bytes, not words
    (2, 44, 36, 3, 2, "int4", 32, True),
    (2, 36, 44, 3, 2, "mxfp4", 32, False),
    (2, 48, 40, 3, 2, "int4", 4, False),  # groups of 4 (not whole words): bytes, a scale per 2 bytes
    (2, 48, 48, 3, 2, "int4", 12, True),  # groups of 12: bytes, a scale per byte
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-D{}-I{}-E{}-K{}-{}-g{}{}".format(
    *c[:7], "-zero" if c[7] else ""))
def test_int4_matches_dequantized(case, path):
    # float16 on the sorted path (the CPU interpreter's bfloat16 tl.dot is wrong for plain weights too);
    # the pair kernels multiply elementwise in float32: bfloat16 there.
    dtype = torch.bfloat16 if path == "pairs" else torch.float16
    _check(*case[:5], dtype, case[5], case[6], tol=2e-2 if dtype == torch.bfloat16 else 2e-3, zero=case[7])


@pytest.mark.parametrize("T", [5, 160], ids=["rows-16", "rows-64"])
@pytest.mark.parametrize("fmt,zero,D,I,group", [("int4", True, 256, 128, 32), ("mxfp4", False, 80, 48, 32),
                                                ("int4", False, 96, 40, 32), ("int4", True, 256, 256, 128),
                                                ("int4", False, 96, 48, 24), ("mxfp4", False, 256, 128, 32)],
                         ids=["int4-zero-even-chunks", "mxfp4-partial-chunk", "int4-group-tail", "int4-g128",
                              "int4-g24", "mxfp4-even-chunks"])
def test_sorted4_kernels_match_the_dequantized_path(T, fmt, zero, D, I, group, monkeypatch):
    """The sorted kernels reading the packed bytes (sorted4.py) against the float64 reference and the
    16-bit kernels on the dequantized weights, through `moe_mlp` (each pair's row gathered, weighted sums)
    and `moe_mlp_summed` (some of the pairs, expert parallelism's receiving side): chunks that divide k or
    leave a partial one, 16 and 64 rows per tile (the default tiles' 128 and 64 columns of k), a down
    row of 40 columns with groups of 32 (a last partial group), zero points, gate and up rows interleaved;
    scales loaded per group (groups tiling the chunk), per column (a chunk inside a group of 128) and per
    byte (groups of 24). MXFP4 also through Triton's scaled dot (THUNDEREP_SORTED4=scaled), whole and partial
    chunks."""
    from thunderep.kernels.ops import moe_mlp_summed

    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    E, K = 4, 2
    x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.float16, 7)
    q_gu, q_d = Int4Weight.quantize(w_gu, fmt, group), Int4Weight.quantize(w_d, fmt, group)
    if zero:
        q_gu, q_d = _asymmetric(q_gu, 1), _asymmetric(q_d, 2)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE).half()
    inter = fmt == "mxfp4"  # gate and up rows interleaved (gpt-oss's layout)
    ref_w = (q_gu.dequantize(dtype=torch.float64), q_d.dequantize(dtype=torch.float64))
    y_ref = reference(x.double(), *ref_w, ids, weights.double(), interleaved=inter)
    keep = torch.arange(T * K, device=DEVICE) % 3 != 0  # the summed call's pairs: two in three
    flat = ids.reshape(-1)
    order = torch.nonzero(keep).flatten()
    order = order[torch.argsort(flat[order], stable=True)].to(torch.int32)
    counts = torch.bincount(flat[order.long()], minlength=E)
    summed_ref = reference(x.double(), *ref_w, ids, torch.where(keep.view(T, K), weights.double(), 0.0),
                           interleaved=inter)
    outs = {}
    for mode in ("packed", "dequant") + (("scaled",) if fmt == "mxfp4" else ()):
        monkeypatch.setenv("THUNDEREP_SORTED4", mode)
        with torch.no_grad():
            outs[mode] = (routed_moe_mlp(x, q_gu, q_d, ids, weights, interleaved=inter),
                          moe_mlp_summed(x, q_gu, q_d, counts, order_Q=order, weights_N=weights, top_k=K,
                                         interleaved=inter))
    for y, y_sum in outs.values():
        assert rel_err(y, y_ref) < 2e-3 and rel_err(y_sum, summed_ref) < 2e-3, (rel_err(y, y_ref),
                                                                                 rel_err(y_sum, summed_ref))
    assert rel_err(outs["packed"][0], outs["dequant"][0].double()) < 1e-3
    if "scaled" in outs:  # the same products through tl.dot_scaled
        assert rel_err(outs["scaled"][0], outs["dequant"][0].double()) < 1e-3


def test_sorted4_path_by_rows_per_expert(monkeypatch):
    """Unset, THUNDEREP_SORTED4 leaves the choice to the mean rows per expert (packed up to
    SORTED4_MAX_ROWS); set, it pins the path; any other value is a ConfigError naming it."""
    from thunderep.errors import ConfigError
    from thunderep.kernels import paths

    monkeypatch.delenv("THUNDEREP_SORTED4", raising=False)
    assert paths.sorted4_packed(64 * 2, 8) and paths.sorted4_packed(64 * 8, 128)  # 16 and 4 rows per expert
    assert paths.sorted4_packed(paths.SORTED4_MAX_ROWS * 8, 8)
    assert not paths.sorted4_packed((paths.SORTED4_MAX_ROWS + 1) * 8, 8) and not paths.sorted4_packed(4096 * 2, 8)
    monkeypatch.setenv("THUNDEREP_SORTED4", "dequant")
    assert not paths.sorted4_packed(3, 8)
    monkeypatch.setenv("THUNDEREP_SORTED4", "packed")
    assert paths.sorted4_packed(4096 * 2, 8)
    monkeypatch.setenv("THUNDEREP_SORTED4", "fast")
    with pytest.raises(ConfigError, match="THUNDEREP_SORTED4='fast'"):
        paths.sorted4_packed(3, 8)


@pytest.mark.parametrize("up,down", [((16, 32), (16, 32)), ((8, 16), (32, 64)), ((64, 256), (8, 16))],
                         ids=["chunks-32", "narrow", "wide"])
def test_int4_pair_kernel_tails(up, down, monkeypatch):
    """The pair kernels' loops with column tiles and chunks that divide neither D = 80 nor I = 56 (a last
    partial chunk, a column tile past the matrix), chunks narrower and wider than a group, one chunk
    covering a whole row; unweighted and interleaved gate/up; rows read as words (16 bytes wide where D
    or I is a multiple of 32: D = 96), and (D = 84, I = 52: rows of 42 and 26 bytes) as bytes."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": up[0], "BLOCK_K": up[1], "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": down[0], "BLOCK_K": down[1], "num_warps": 4})
    _check(2, 80, 56, 5, 2, torch.float16, "int4", 32, tol=2e-3, zero=True, weighted=False, interleaved=True)
    _check(1, 96, 56, 5, 3, torch.float16, "mxfp4", 32, tol=2e-3, seed=1)
    _check(2, 84, 52, 5, 2, torch.float16, "int4", 32, tol=2e-3, zero=True, seed=2)
    _check(1, 84, 52, 5, 2, torch.float16, "mxfp4", 32, tol=2e-3, seed=3)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_int4_pair_loads_two_chunks_ahead_equal_one_ahead_bit_for_bit(fmt, monkeypatch):
    """DEPTH 2 (each chunk's words loaded two chunks ahead, pairs4._words_loop) gives DEPTH 1's outputs bit for
    bit in both passes: 4 chunks and a tail (D = 96 and I = 56 in chunks of 32: the loads two past the end
    masked), one chunk covering the row (chunks of 128), and the float32 loop (HALF off); and each is within
    the reference's error. The pinned configs' register caps (maxnreg) reach the launch as an option."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    for half in ("1", "0"):
        monkeypatch.setenv("THUNDEREP_HALF_PRODUCTS", half)
        for block_k in (32, 128):
            outs = []
            for depth in (1, 2):
                config = {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4, "DEPTH": depth, "maxnreg": 64 * depth}
                monkeypatch.setattr(decode, "PAIRS4_UP", config)
                monkeypatch.setattr(decode, "PAIRS4_DOWN", config)
                outs.append(_check(2, 96, 56, 5, 2, torch.bfloat16, fmt, 32, tol=2e-2, zero=fmt == "int4"))
            assert torch.equal(outs[0], outs[1]), (half, block_k)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_two_words_a_chain_give_one_words_outputs(fmt, monkeypatch):
    """Two words a float16 chain (THUNDEREP_HALF_PRODUCTS=2, HALF 3; MXFP4's codes through the FP8 conversion)
    in both passes: within the reference's error at full chunks, a tail and one chunk covering a row, 1 and 5
    tokens, and within float16's rounding of one word a chain's outputs (HALF 1: its products are 2 ** -6 times
    those, exactly but where one falls under float16's normal range). Compiled on a CUDA GPU; without one, the
    interpreter runs the same inline PTX through a model of its instructions (ptx_sim.py), in the modes an
    sm_89 or later GPU runs."""
    chains_here(monkeypatch, fp8_conversion=fmt == "mxfp4")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    for block_k, T in ((32, 1), (128, 5)):
        config = {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4}
        monkeypatch.setattr(decode, "PAIRS4_UP", config)
        monkeypatch.setattr(decode, "PAIRS4_DOWN", config)
        outs = {}
        for half in ("1", "2"):
            monkeypatch.setenv("THUNDEREP_HALF_PRODUCTS", half)
            outs[half] = _check(T, 96, 56, 5, 2, torch.bfloat16, fmt, 32, tol=2e-2, seed=T)
        assert rel_err(outs["2"], outs["1"].double()) < 8e-3, (block_k, T)


@pytest.mark.parametrize("up,down,zero", [((16, 32), (16, 32), True), ((8, 16), (32, 64), False),
                                          ((64, 256), (8, 16), False)], ids=["chunks-32", "narrow", "wide"])
def test_inline_ptx_chains_in_every_loop_and_tail(up, down, zero, monkeypatch):
    """The float16 chains a CUDA GPU runs (one word a chain, HALF 1; two, HALF 3) through the pair kernels' loops
    and tails of `test_int4_pair_kernel_tails` (D = 96, I = 56) and the gpt-oss pair kernels': within the
    reference's error, two words a chain within float16's rounding of one and not equal to it (they ran); and
    (zero) int4 with zero points, one word a chain in both (through the vector's planes). Compiled on a CUDA GPU
    of sm_89 or later; elsewhere through the PTX model."""
    from thunderep.kernels import pairs4_gptoss

    chains_here(monkeypatch)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": up[0], "BLOCK_K": up[1], "num_warps": 4})
    monkeypatch.setattr(pairs4_gptoss, "GPTOSS4_UP", {"BLOCK_N": up[0], "BLOCK_K": up[1], "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": down[0], "BLOCK_K": down[1], "num_warps": 4})
    outs = {}
    for half in ("1", "2"):
        monkeypatch.setenv("THUNDEREP_HALF_PRODUCTS", half)
        outs[half] = [_check(2, 96, 56, 5, 2, torch.float16, "int4", 32, tol=2e-3, interleaved=True),
                      _check(1, 96, 56, 5, 3, torch.float16, "mxfp4", 32, tol=2e-3, seed=1),
                      _gptoss_check(2, 96, 56, 5, 2, "mxfp4", 1.702, 7.0, seed=3)]
        if zero:
            outs[half].append(_check(2, 96, 56, 5, 2, torch.float16, "int4", 32, tol=2e-3, zero=True, seed=2))
    for one, two in zip(outs["1"][:3], outs["2"][:3]):
        assert rel_err(two, one.double()) < 4e-3 and not torch.equal(one, two)
    if zero:
        assert torch.equal(outs["1"][3], outs["2"][3])


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_int4_half_products_run_where_the_vector_fits(fmt, monkeypatch):
    """HALF (4-bit products in float16 pairs, the default on CUDA and in the interpreter): within the
    reference's error where it runs; a token whose vector's largest magnitude is past HALF_MAX (3e4, in its
    last chunk: its float16 sums would overflow) or under HALF_MIN (1e-6 a element: float16 subnormals) runs
    the float32 products instead, bit for bit what THUNDEREP_HALF_PRODUCTS=0 gives it, finite and within the error;
    a token that fits runs the float16 pairs (its output differs from the float32 products'). The down
    pass's choice measured on h."""
    from thunderep.kernels.half4 import HALF_MAX, HALF_MIN

    assert 32 * HALF_MAX < 65504 and HALF_MIN >= 2.0 ** -8
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4})
    x, w_gu, w_d, ids, weights = make_case(3, 96, 56, 5, 2, torch.bfloat16, 7)
    x[0, 90] = 3e4  # in the last chunk: the measurement runs over every chunk the loop reads
    x[1] = x[1] * 1e-6
    q_gu, q_d = Int4Weight.quantize(w_gu, fmt, 32), Int4Weight.quantize(w_d, fmt, 32)
    y_ref = reference(x.double(), q_gu.dequantize(dtype=torch.float64), q_d.dequantize(dtype=torch.float64), ids,
                      weights.double())
    outs = {}
    for half in ("1", "0"):
        monkeypatch.setenv("THUNDEREP_HALF_PRODUCTS", half)
        with torch.no_grad():
            outs[half] = routed_moe_mlp(x, q_gu, q_d, ids, weights.to(torch.bfloat16))
        assert torch.isfinite(outs[half]).all()
        for t in range(3):
            assert rel_err(outs[half][t], y_ref[t]) < 2e-2, (half, t, rel_err(outs[half][t], y_ref[t]))
    assert torch.equal(outs["1"][:2], outs["0"][:2])  # past HALF_MAX, under HALF_MIN: the float32 products
    assert not torch.equal(outs["1"][2], outs["0"][2])  # fits: the float16 pairs ran


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_int4_half_vector_pairs_equal_the_planes_bit_for_bit(fmt, dtype, monkeypatch):
    """HALF's 16-bit vectors read as float16 pairs straight from their words (`half4.vector_pairs`) give the
    outputs of the same products through the float32 planes (`pairs4.half_chunk_planes`) bit for bit, in both
    passes, at full chunks and a tail, and so does the down pass reading h's float16-pair copy that the
    gate/up pass writes (`decode.PAIRED_H`, on by default) against converting h itself; a vector whose rows
    are not 4-byte aligned (a view one element in) is read through an aligned copy (`decode.vector_rows`)
    and gives its own rows' outputs."""
    from thunderep.kernels import pairs4

    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4})
    x, w_gu, w_d, ids, weights = make_case(3, 96, 56, 5, 2, dtype, 11)
    q_gu, q_d = Int4Weight.quantize(w_gu, fmt, 32), Int4Weight.quantize(w_d, fmt, 32)
    wide = torch.zeros(3 * 96 + 1, dtype=dtype, device=x.device)
    shifted = wide[1:].view(3, 96)
    shifted.copy_(x)
    assert shifted.data_ptr() % 4 and decode.vector_rows(shifted).data_ptr() % 4 == 0
    assert decode.paired_h(torch.empty(6, 56, dtype=dtype), 2, q_d) is not None  # the copy is made here
    with torch.no_grad():
        pairs = routed_moe_mlp(x, q_gu, q_d, ids, weights.to(dtype))
        unaligned = routed_moe_mlp(shifted, q_gu, q_d, ids, weights.to(dtype))
        monkeypatch.setattr(decode, "PAIRED_H", False)
        converted = routed_moe_mlp(x, q_gu, q_d, ids, weights.to(dtype))
        monkeypatch.setattr(pairs4, "half_chunk", pairs4.half_chunk_planes)
        planes = routed_moe_mlp(x, q_gu, q_d, ids, weights.to(dtype))
    assert torch.isfinite(pairs).all() and torch.equal(pairs, planes) and torch.equal(unaligned, pairs)
    assert torch.equal(converted, pairs)


def test_int4_half_down_pass_takes_float32_for_a_large_h(monkeypatch):
    """A vector that fits for the gate/up pass (x of the usual size) but whose h does not (gate/up scales
    x 3000: h near 1e5) stays finite and within the reference's error: the down pass, which measures h, runs
    the float32 products for it."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT": True, "num_warps": 4})
    x, w_gu, w_d, ids, weights = make_case(2, 96, 64, 5, 2, torch.bfloat16, 11)
    q_gu, q_d = Int4Weight.quantize(w_gu, "int4", 32), Int4Weight.quantize(w_d, "int4", 32)
    q_gu = Int4Weight(q_gu.packed, q_gu.scale * 3000, q_gu.group, q_gu.dtype, "int4")
    with torch.no_grad():
        y = routed_moe_mlp(x, q_gu, q_d, ids, weights.to(torch.bfloat16))
    y_ref = reference(x.double(), q_gu.dequantize(dtype=torch.float64), q_d.dequantize(dtype=torch.float64), ids,
                      weights.double())
    assert y_ref.abs().max() > 1e4 and torch.isfinite(y).all() and rel_err(y, y_ref) < 2e-2, rel_err(y, y_ref)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_int4_split_down_pass_equals_the_slot_loop_bit_for_bit(fmt, monkeypatch):
    """SPLIT (one down program per slot, the last to arrive summing the partials in slot order) gives the
    slot loop's output bit for bit, within the reference's error, with an odd K, a column tile past D, a
    pair of another rank (-1) and an unknown id (NaN for its token only); the counts are left at 0, so a
    second call agrees too."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4})
    ids = torch.tensor([[0, 2, 4], [1, -1, 3], [4, 3, 2]])
    outs = []
    for split in (False, True, True):
        monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "SPLIT": split})
        outs.append(_check(3, 80, 56, 5, 3, torch.bfloat16, fmt, 32, tol=2e-2, ids=ids, zero=fmt == "int4"))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    x, w_gu, w_d, _, weights = make_case(2, 80, 56, 5, 3, torch.bfloat16, 0)
    q_gu, q_d = Int4Weight.quantize(w_gu, fmt), Int4Weight.quantize(w_d, fmt)
    with torch.no_grad():
        y = routed_moe_mlp(x, q_gu, q_d, torch.tensor([[0, 9, 1], [1, 2, 3]], device=DEVICE), weights.bfloat16())
    assert bool(y[0].isnan().all()) and not bool(y[1].isnan().any())


@pytest.mark.parametrize("split", [False, True], ids=["slot-loop", "split"])
def test_int4_down_pass_parts_of_i_match_the_reference(split, monkeypatch):
    """PARTS (the down pass's I cut into ranges, the last program to arrive summing the partials): within
    the reference's error for 3 parts of I = 104 in chunks of 32 (a short last part and an empty one), zero
    points, a pair of another rank (-1); deterministic, and the counts are left at 0, so a second call gives
    the same bits; with the slot loop also rows read as bytes (I = 52), split per slot also groups wider than
    a chunk (128: parts of whole groups) and an unknown id (NaN for its token only)."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(decode, "PAIRS4_UP", {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "SPLIT": split,
                                                "PARTS": 3})
    ids = torch.tensor([[0, 2, 4], [1, -1, 3], [4, 3, 2]])
    first = _check(3, 80, 104, 5, 3, torch.bfloat16, "int4", 32, tol=2e-2, ids=ids, zero=True)
    assert torch.equal(first, _check(3, 80, 104, 5, 3, torch.bfloat16, "int4", 32, tol=2e-2, ids=ids, zero=True))
    if not split:  # (each case once, to keep the interpreter's time down)
        _check(2, 84, 52, 5, 2, torch.float16, "mxfp4", 32, tol=2e-2, seed=2)
        return
    _check(2, 96, 256, 5, 2, torch.bfloat16, "int4", 128, tol=2e-2, seed=1)
    x, w_gu, w_d, _, weights = make_case(2, 80, 104, 5, 3, torch.bfloat16, 0)
    q_gu, q_d = Int4Weight.quantize(w_gu, "int4"), Int4Weight.quantize(w_d, "int4")
    with torch.no_grad():
        y = routed_moe_mlp(x, q_gu, q_d, torch.tensor([[0, 9, 1], [1, 2, 3]], device=DEVICE), weights.bfloat16())
    assert bool(y[0].isnan().all()) and not bool(y[1].isnan().any())


def test_int4_pairs_skip_minus_one_and_nan_for_unknown_ids(monkeypatch):
    """Id -1 adds nothing (another rank's expert); any other id outside [0, E) makes its token NaN."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    ids = torch.tensor([[0, -1], [2, 1], [-1, -1]])
    y = _check(3, 64, 32, 3, 2, torch.float16, "mxfp4", 32, tol=2e-3, ids=ids)
    assert torch.equal(y[2], torch.zeros(64, dtype=torch.float16, device=DEVICE))
    x, w_gu, w_d, _, weights = make_case(2, 64, 32, 3, 2, torch.float16, 0)
    q_gu, q_d = Int4Weight.quantize(w_gu, "int4"), Int4Weight.quantize(w_d, "int4")
    with torch.no_grad():
        y = routed_moe_mlp(x, q_gu, q_d, torch.tensor([[0, 7], [1, 2]], device=DEVICE), weights.half())
    assert bool(y[0].isnan().all()) and not bool(y[1].isnan().any())


def test_int4_sorted_mode_and_no_gradients():
    """moe_mlp's sorted mode (rows grouped by expert) on 4-bit weights, and the refusal of gradients."""
    x, w_gu, w_d, ids, _ = make_case(6, 32, 48, 4, 1, torch.float16, 3)
    q_gu, q_d = Int4Weight.quantize(w_gu, "int4", 16), Int4Weight.quantize(w_d, "int4", 16)
    counts = torch.bincount(ids.reshape(-1), minlength=4)
    x_sorted = x[torch.argsort(ids.reshape(-1), stable=True)]
    with torch.no_grad():
        y = moe_mlp(x_sorted, q_gu, q_d, counts)
    ids_sorted = torch.sort(ids.reshape(-1), stable=True).values[:, None]
    y_ref = reference(x_sorted.double(), q_gu.dequantize(dtype=torch.float64), q_d.dequantize(dtype=torch.float64),
                      ids_sorted, torch.ones(6, 1, dtype=torch.float64, device=DEVICE))
    assert y.dtype == torch.float16 and rel_err(y, y_ref) < 2e-3
    with pytest.raises(InputError, match="4-bit expert weights are for inference"):
        moe_mlp(x_sorted.requires_grad_(), q_gu, q_d, counts)


def test_int4_custom_op_equals_the_direct_call():
    """thunderep::moe_mlp_pairs_int4 (what torch.compile traces) gives what the eager call gives, bit for
    bit, and its fake gives the output's shape and dtype."""
    x, w_gu, w_d, ids, weights = make_case(2, 64, 32, 4, 2, torch.float16, 5)
    q_gu, q_d = Int4Weight.quantize(w_gu, "mxfp4"), Int4Weight.quantize(w_d, "mxfp4")
    args = (x, q_gu.packed, q_gu.scale, None, 32, q_d.packed, q_d.scale, None, 32, "mxfp4", ids, weights.half(),
            "silu", False)
    with torch.no_grad():
        direct = decode.pairs4_forward(x, q_gu, q_d, ids.reshape(-1), weights.half().reshape(-1), "silu", False)
        via_op = torch.ops.thunderep.moe_mlp_pairs_int4(*args[:10], ids.reshape(-1), weights.half().reshape(-1),
                                                        *args[12:])
    assert torch.equal(direct, via_op)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.thunderep.moe_mlp_pairs_int4(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                        for a in args))
    assert fake.shape == (2, 64) and fake.dtype == torch.float16


import triton.language as tl  # noqa: E402

from thunderep.kernels import codes4  # noqa: E402


@triton.jit
def _conversions_kernel(w_ptr, b_ptr, out_ptr, MXFP4: tl.constexpr):
    """For the 2 ** 16 words at w_ptr: out rows 0..7 the values of each half's codes at bits 0, 4, 8, 12
    (low half, high half, per shift) through int4_halves (bits 8 and 12: of the word shifted by 8, as the
    kernels do) / e2m1_halves; for the 256 bytes at b_ptr: rows 8 and 9 (first 256 columns) their low and
    high codes through nibbles4, row 10 (first 16) codes4."""
    i = tl.arange(0, 65536)
    w = tl.load(w_ptr + i)
    for s in tl.static_range(4):
        if MXFP4:
            lo, hi = codes4.e2m1_halves(w, 4 * s)
            lo, hi = lo * codes4.E2M1_UNIT, hi * codes4.E2M1_UNIT
        elif s < 2:
            lo, hi = codes4.int4_halves(w, 4 * s)
        else:
            lo, hi = codes4.int4_halves(w >> 8, 4 * s - 8)
        tl.store(out_ptr + (2 * s) * 65536 + i, lo)
        tl.store(out_ptr + (2 * s + 1) * 65536 + i, hi)
    j = tl.arange(0, 256)
    lo, hi = codes4.nibbles4(tl.load(b_ptr + j), MXFP4)
    tl.store(out_ptr + 8 * 65536 + j, lo)
    tl.store(out_ptr + 9 * 65536 + j, hi)
    tl.store(out_ptr + 10 * 65536 + j, codes4.codes4(j % 16, MXFP4), mask=j < 16)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_conversions_are_exact_for_every_code(fmt):
    """Every 4-bit code at every position of a 32-bit word (both halves, every shift), of a byte, and alone
    converts to exactly its value (int4: n - 8; e2m1: the table, signed zero and the subnormal 0.5 included)
    with no integer-to-float conversion."""
    u = torch.arange(65536, dtype=torch.int64)
    u_high = (u * 7919 + 12345) % 65536  # a different pattern in each half
    words = (u | (u_high << 16)).to(torch.int32)
    out = torch.full((11, 65536), float("nan"), device=DEVICE)
    b = torch.arange(256, dtype=torch.int32, device=DEVICE)
    _conversions_kernel[(1,)](words.to(DEVICE), b, out, MXFP4=fmt == "mxfp4")
    table = torch.tensor(_E2M1 if fmt == "mxfp4" else [n - 8.0 for n in range(16)])
    want = torch.empty(11, 65536)
    for s in range(4):
        want[2 * s], want[2 * s + 1] = table[(u >> (4 * s)) & 15], table[(u_high >> (4 * s)) & 15]
    want[8, :256], want[9, :256], want[10, :16] = table[torch.arange(256) & 15], table[torch.arange(256) >> 4], table
    out, keep = out.cpu(), torch.ones(11, 65536, dtype=torch.bool)
    keep[8:, 256:] = False
    keep[10, 16:] = False
    # bit for bit: -0.0 stays -0.0
    assert torch.equal(out[keep].view(torch.int32), want[keep].view(torch.int32))


# ---- gpt-oss's experts on 4-bit weights (pairs4_gptoss.py) ----------------------------------------------

def _gptoss_reference(x, w_gu, b_gu, w_d, b_d, ids, weights, alpha, limit):
    """float64 y_TD of transformers' GptOssExperts math: gate/up rows interleaved, biases, clamped SwiGLU;
    ids outside [0, E) add nothing."""
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w_gu.shape[0]:
                continue
            gu = w_gu[e] @ x[t] + b_gu[e]
            gate, up = gu[::2].clamp(max=limit), gu[1::2].clamp(min=-limit, max=limit)
            h = (up + 1) * gate * torch.sigmoid(gate * alpha)
            y[t] += float(weights[t, k]) * (w_d[e] @ h + b_d[e])
    return y


def _gptoss_check(T, D, I, E, K, fmt, alpha, limit, seed=0, ids=None, weighted=True, zero=False):
    from thunderep.kernels.ops import moe_mlp_pairs_gptoss

    dtype = torch.bfloat16
    x, w_gu, w_d, drawn, weights = make_case(T, D, I, E, K, dtype, seed)
    ids = drawn if ids is None else ids.to(DEVICE)
    gen = torch.Generator().manual_seed(seed + 7)
    b_gu = (torch.randn(E, 2 * I, generator=gen) * 0.5).to(DEVICE, dtype)
    b_d = (torch.randn(E, D, generator=gen) * 0.5).to(DEVICE, dtype)
    q_gu, q_d = Int4Weight.quantize(w_gu, fmt), Int4Weight.quantize(w_d, fmt)
    if zero:
        q_gu, q_d = _asymmetric(q_gu, seed), _asymmetric(q_d, seed + 1)
    weights = weights.to(dtype) if weighted else None
    with torch.no_grad():
        y = moe_mlp_pairs_gptoss(x, q_gu, b_gu, q_d, b_d, ids, weights, alpha, limit)
    ref_w = weights.double() if weighted else torch.ones(T, K, dtype=torch.float64, device=DEVICE)
    y_ref = _gptoss_reference(x.double(), q_gu.dequantize(dtype=torch.float64), b_gu.double(),
                              q_d.dequantize(dtype=torch.float64), b_d.double(), ids, ref_w, alpha, limit)
    assert y.shape == (T, D) and y.dtype == dtype
    assert rel_err(y, y_ref) < 1e-2, f"relative error {rel_err(y, y_ref):.2e} against the reference"
    return y


@pytest.mark.parametrize("fmt,limit,zero", [("mxfp4", 7.0, False), ("mxfp4", 0.3, False), ("int4", 0.3, True)],
                         ids=["mxfp4", "mxfp4-clamped", "int4-zero-clamped"])
def test_gptoss_pairs4_match_the_float64_reference(fmt, limit, zero, monkeypatch):
    """gpt-oss's experts (biases, interleaved gate/up, clamped SwiGLU with alpha 1.702) on 4-bit weights
    against the float64 reference on the exactly dequantized weights; limit 0.3 clamps most gates. The down
    pass reading h's float16-pair copy (`decode.PAIRED_H`, made where there are no zero points) gives what
    converting h itself gives, bit for bit."""
    paired = _gptoss_check(3, 64, 48, 4, 2, fmt, 1.702, limit, zero=zero)
    monkeypatch.setattr(decode, "PAIRED_H", False)
    assert torch.equal(_gptoss_check(3, 64, 48, 4, 2, fmt, 1.702, limit, zero=zero), paired)


@pytest.mark.parametrize("up,down", [((16, 32), (16, 32, False, 1)), ((8, 16), (32, 64, True, 1)),
                                     ((64, 256), (8, 16, False, 1)), ((16, 32), (32, 32, True, 3)),
                                     ((16, 32), (16, 32, False, 2))],
                         ids=["chunks-32", "narrow-split", "wide", "split-parts", "parts"])
def test_gptoss_pairs4_tails(up, down, monkeypatch):
    """Column tiles and chunks that divide neither D = 80 nor I = 56 (partial chunks and groups, a tile
    past the matrix), unweighted; and MXFP4 at D = 96 with three experts a token; the down pass (the plain
    one with biases) split per slot and cut into parts of I (each expert's bias added once)."""
    from thunderep.kernels import pairs4_gptoss

    monkeypatch.setattr(pairs4_gptoss, "GPTOSS4_UP", {"BLOCK_N": up[0], "BLOCK_K": up[1], "num_warps": 4})
    monkeypatch.setattr(decode, "PAIRS4_DOWN", {"BLOCK_N": down[0], "BLOCK_K": down[1], "num_warps": 4,
                                                "SPLIT": down[2], "PARTS": down[3]})
    _gptoss_check(2, 80, 56, 5, 2, "int4", 1.702, 0.5, weighted=False)
    _gptoss_check(1, 96, 56, 5, 3, "mxfp4", 1.702, 7.0, seed=1)


def test_gptoss_pairs4_skip_minus_one_nan_for_unknown_and_custom_op():
    """Id -1 adds nothing, not even its bias (another rank's expert); any other id outside [0, E) makes its
    token NaN; thunderep::moe_mlp_pairs_int4_gptoss gives the eager call's output bit for bit."""
    from thunderep.kernels.ops import moe_mlp_pairs_gptoss

    ids = torch.tensor([[0, -1], [2, 1], [-1, -1]])
    y = _gptoss_check(3, 64, 32, 3, 2, "mxfp4", 1.702, 7.0, ids=ids)
    assert torch.equal(y[2], torch.zeros(64, dtype=torch.bfloat16, device=DEVICE))
    x, w_gu, w_d, _, weights = make_case(2, 64, 32, 3, 2, torch.bfloat16, 0)
    q_gu, q_d = Int4Weight.quantize(w_gu, "mxfp4"), Int4Weight.quantize(w_d, "mxfp4")
    b_gu = b_d = torch.ones(3, 64, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        y = moe_mlp_pairs_gptoss(x, q_gu, b_gu, q_d, b_d, torch.tensor([[0, 7], [1, 2]], device=DEVICE), weights,
                                 1.702, 7.0)
        assert bool(y[0].isnan().all()) and not bool(y[1].isnan().any())
        ids = torch.tensor([[0, 2], [1, 2]], device=DEVICE)
        direct = moe_mlp_pairs_gptoss(x, q_gu, b_gu, q_d, b_d, ids, weights, 1.702, 7.0)
        via_op = torch.ops.thunderep.moe_mlp_pairs_int4_gptoss(x, q_gu.packed, q_gu.scale, None, 32, b_gu, q_d.packed,
                                                               q_d.scale, None, 32, b_d, "mxfp4", ids.reshape(-1),
                                                               weights.reshape(-1), 1.702, 7.0)
    assert torch.equal(direct, via_op)
    with pytest.raises(InputError, match=r"biases \(3, 64\) and \(3, 32\) must be \[E, 2I\]"):
        moe_mlp_pairs_gptoss(x, q_gu, b_gu, q_d, b_d[:, :32], ids, weights, 1.702, 7.0)
