"""FP8 expert weights (thunderep/kernels/fp8.py): the block-scale format against a plain loop, and the
kernels on FP8 weights against the same kernels and the float64 reference on the dequantized weights,
in Triton's CPU interpreter without CUDA and on the model shapes on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from thunderep.errors import InputError
from thunderep.kernels.fp8 import FP8, FP8_MAX, Fp8Weight

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def _loop_dequantize(w: Fp8Weight) -> torch.Tensor:
    """W[e, r, c] = dtype(q[e, r, c] * scale[e, r // bR, c // bC]), one row block at a time."""
    E, R, C = w.shape
    bR, bC = w.block
    out = torch.empty(E, R, C, dtype=w.dtype)
    q = w.q.float().cpu()
    scale = w.scale.cpu()
    for r in range(R):
        cols = torch.arange(C) // bC
        out[:, r] = (q[:, r] * scale[:, r // bR][:, cols]).to(w.dtype)
    return out


@pytest.mark.parametrize("block", [None, (16, 16), (5, 32), (128, 128), (7, 100)])
def test_quantize_round_trip_and_dequantize_equals_a_loop(block):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=gen) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different size
    w[1, :8] = 0.0  # an all-zero block gets scale 1 and stays zero
    q = Fp8Weight.quantize(w.to(torch.bfloat16), block=block)
    bR, bC = block or (1, 96)
    assert q.block == (bR, bC) and q.scale.shape == (3, -(-40 // bR), -(-96 // bC)) and q.dtype == torch.bfloat16
    deq = q.dequantize()
    assert torch.equal(deq, _loop_dequantize(q))
    assert torch.equal(deq[1, :8], torch.zeros(8, 96, dtype=torch.bfloat16))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, plus half the subnormal step of its block's
    # scale, plus bfloat16's rounding of the product.
    full_scale = q.scale.repeat_interleave(bR, 1)[:, :40].repeat_interleave(bC, 2)[:, :, :96]
    wb = w.to(torch.bfloat16).float()
    bound = wb.abs() * (2**-4 + 2**-8) + full_scale * 2**-9 * 1.01
    assert bool(((deq.float() - wb).abs() <= bound).all())
    # The largest magnitude of each block maps to FP8_MAX exactly.
    assert q.q.float().abs().max().item() == FP8_MAX
    assert torch.equal(q.dequantize(slice(1, 3)), deq[1:3])


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gpu_quantize_equals_the_cpu_bit_for_bit(block):
    """A rank quantizes its experts on its own device: the FP8 bytes and scales must not depend on which
    (CUDA divides by a Python number through its reciprocal, one bit off the CPU's division)."""
    w = torch.randn(4, 256, 384, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    cpu, gpu = Fp8Weight.quantize(w, block), Fp8Weight.quantize(w.cuda(), block)
    assert torch.equal(gpu.scale.cpu(), cpu.scale)
    assert torch.equal(gpu.q.cpu().view(torch.uint8), cpu.q.view(torch.uint8))


def test_fp8_weight_rejects_what_the_kernels_cannot_read():
    q = torch.zeros(2, 8, 16, dtype=FP8)
    with pytest.raises(InputError, match=r"scale must be float32 \(2, 1, 1\)"):
        Fp8Weight(q, torch.ones(2, 8, 1), (8, 16), torch.bfloat16)
    with pytest.raises(InputError, match="float8_e4m3fn"):
        Fp8Weight(q.float(), torch.ones(2, 1, 1), (8, 16), torch.bfloat16)
    with pytest.raises(InputError, match="bfloat16 or float16"):
        Fp8Weight(q, torch.ones(2, 1, 1), (8, 16), torch.float32)
    with pytest.raises(InputError, match="two sizes >= 1"):
        Fp8Weight(q, torch.ones(2, 1, 1), (0, 16), torch.bfloat16)
    with pytest.raises(InputError, match=r"\[E, R, C\] float"):
        Fp8Weight.quantize(torch.ones(8, 16))


# ---- the kernels on FP8 weights ----------------------------------------------------------------------

triton = pytest.importorskip("triton")

from test_moe_triton import CUDA, DEVICE, MODEL_SHAPES, make_case, reference, rel_err  # noqa: E402

from thunderep.kernels import sorted_mlp, tiles  # noqa: E402
from thunderep.kernels.ops import moe_mlp, routed_moe_mlp  # noqa: E402


def _fp8_case(T, D, I, E, K, dtype, seed, blocks, ids=None):
    """x, both weights as Fp8Weight (blocks: (gate_up's, down's); None: one scale per row), ids (drawn
    unless given), weights."""
    x, w_gu, w_d, drawn, weights = make_case(T, D, I, E, K, dtype, seed)
    ids = drawn if ids is None else ids
    return (x, Fp8Weight.quantize(w_gu, blocks[0]), Fp8Weight.quantize(w_d, blocks[1]), ids.to(x.device),
            weights.to(device=x.device, dtype=dtype))


def _check_fp8(T, D, I, E, K, dtype, blocks, tol, seed=0, ids=None):
    """routed_moe_mlp on FP8 weights against the float64 reference on their dequantized values, and
    against the same call on the dequantized weights (bf16 / fp16 tensors). Returns both outputs."""
    x, w_gu, w_d, ids, weights = _fp8_case(T, D, I, E, K, dtype, seed, blocks, ids)
    deq_gu, deq_d = w_gu.dequantize(), w_d.dequantize()
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, ids, weights)
        y_deq = routed_moe_mlp(x, deq_gu, deq_d, ids, weights)
    y_ref = reference(x.double(), w_gu.dequantize(dtype=torch.float64), w_d.dequantize(dtype=torch.float64), ids,
                      weights.double())
    assert y.shape == (T, D) and y.dtype == dtype
    assert rel_err(y, y_ref) < tol, f"relative error {rel_err(y, y_ref):.2e} against the reference"
    assert rel_err(y, y_deq) < tol, f"relative error {rel_err(y, y_deq):.2e} against the dequantized weights"
    return y, y_deq


@pytest.fixture(params=["pairs", "sorted"])
def path(request, monkeypatch):
    """Pin inference on the pair kernels (at every T) or on the sorted kernels (at every T)."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30) if request.param == "pairs" else "0")
    return request.param


INTERP_FP8_CASES = [  # T, D, I, E, K, (gate_up block, down block)
    (5, 32, 48, 4, 2, (None, None)),
    (3, 32, 48, 4, 2, ((16, 16), (16, 16))),
    (4, 64, 80, 6, 2, ((5, 32), (7, 16))),  # row blocks that divide neither 2I nor D
    (1, 16, 16, 8, 3, ((128, 128), (128, 128))),  # one block holds a whole matrix
]


@pytest.mark.skipif(CUDA, reason="the GPU tests cover these on the compiled kernels")
@pytest.mark.parametrize("case", INTERP_FP8_CASES, ids=lambda c: "T{}-D{}-I{}-E{}-K{}-{}".format(*c[:5], c[5][0]))
def test_interpreter_fp8_matches_dequantized(case, path, monkeypatch):
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    if path == "pairs":  # a BLOCK_K wider than 16-column scale blocks: the launch narrows it
        monkeypatch.setattr(tiles, "DEFAULT_UP_PAIR", tiles.pair_cfg(16, 32, 4, 3, dot=False))
    # float16: the interpreter's bfloat16 tl.dot is wrong for plain bfloat16 weights as well (the
    # bfloat16 products run on the GPU tests); bfloat16 on the pair kernels, which have no tl.dot here.
    _check_fp8(*case[:5], torch.float16, case[5], tol=2e-3)
    if path == "pairs":
        # The interpreter rounds float32 to bfloat16 by truncation (torch to nearest): bfloat16's tolerance.
        _check_fp8(*case[:5], torch.bfloat16, case[5], tol=2e-2, seed=1)


_PAIR_VARIANTS = {  # (gate/up config, down config): every loop of the pair kernels
    "dot-split": (dict(dot=True), dict(split=True)),
    "ahead-split-ahead": (dict(dot=False, ahead=True), dict(split=True, ahead=True)),
    "x_rows-split-x_rows": (dict(dot=False, ahead=True, x_rows=True), dict(split=True, ahead=True, x_rows=True)),
    "fma-all_slots": (dict(dot=False), dict(split=False, all_slots=True)),
    "fma-all_slots-x_rows": (dict(dot=False), dict(split=False, all_slots=True, x_rows=True)),
    "reduce-split_reduce": (dict(dot=False, reduce=True), dict(split=True, reduce=True)),
    "ahead_reduce-ahead_reduce": (dict(dot=False, ahead=True, reduce=True), dict(split=False, ahead=True, reduce=True)),
}


@pytest.mark.skipif(CUDA, reason="the GPU tests cover these on the compiled kernels")
@pytest.mark.parametrize("variant", _PAIR_VARIANTS)
def test_interpreter_fp8_pair_kernel_variants(variant, monkeypatch):
    """Each way the pair kernels loop (tuned per shape on a GPU), pinned, on FP8 weights whose 16-column
    scale blocks are narrower than the configs' 32-column chunks."""
    up, down = _PAIR_VARIANTS[variant]
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(tiles, "DEFAULT_UP_PAIR", tiles.pair_cfg(16, 32, 4, 1, **up))
    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR",  # the split pass's counts have room for 8-column tiles
                        tiles.pair_cfg(16 if down.get("split") else 4, 32, 4, 1, **down))
    _check_fp8(3, 32, 48, 4, 3, torch.float16, ((16, 16), (5, 16)), tol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["row", "128x128"])
@pytest.mark.parametrize("variant", _PAIR_VARIANTS)
def test_gpu_fp8_pair_kernel_variants(variant, blocks, monkeypatch):
    """Each way the pair kernels loop, pinned and compiled, with 512-column chunks (narrowed to 128 for
    128 x 128 blocks): the autotuner picks among them per shape, so the GPU tests with fixed configs
    would otherwise compile only the defaults."""
    up, down = _PAIR_VARIANTS[variant]
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setattr(tiles, "DEFAULT_UP_PAIR", tiles.pair_cfg(4 if up.get("reduce") else 16, 512, 4, 1,
                                                                           **up))
    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(16, 512, 4, 1, **down))
    _check_fp8(3, 2048, 768, 8, 3, torch.bfloat16, (None, None) if blocks == "row" else ((128, 128), (128, 128)),
               tol=2e-2)


@pytest.mark.skipif(CUDA, reason="the GPU tests cover these on the compiled kernels")
def test_interpreter_fp8_sorted_mode_and_float16(monkeypatch):
    """moe_mlp's sorted mode (rows already grouped by expert, unweighted) and float16 products."""
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    x, w_gu, w_d, ids, _ = _fp8_case(6, 32, 48, 4, 1, torch.float16, 3, ((16, 16), None))
    counts = torch.bincount(ids.reshape(-1), minlength=4)
    x_sorted = x[torch.argsort(ids.reshape(-1), stable=True)]
    with torch.no_grad():
        y = moe_mlp(x_sorted, w_gu, w_d, counts)
    ids_sorted = torch.sort(ids.reshape(-1), stable=True).values[:, None]
    y_ref = reference(x_sorted.double(), w_gu.dequantize().double(), w_d.dequantize().double(), ids_sorted,
                      torch.ones(6, 1, dtype=torch.float64))
    assert y.dtype == torch.float16 and rel_err(y, y_ref) < 2e-3


def _check_fp8_tails(counts, config, D, I, dtype, blocks, tol, monkeypatch):
    """The sorted kernels pinned to one row-kernel config (autotuning off) on routing with exactly
    counts[e] rows for expert e (K = 1, rows shuffled): last tiles that take a tail of rows, on FP8
    weights (the kernels' transposed product, moe_triton._dot_k), against the float64 reference."""
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    monkeypatch.setitem(tiles.DEFAULT_ROW, config.kwargs["BLOCK_M"], config)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(3))][:, None]
    assert tiles.m_key(len(ids), len(counts))[0] == config.kwargs["BLOCK_M"]
    _check_fp8(len(ids), D, I, len(counts), 1, dtype, blocks, tol, ids=ids.to(DEVICE))


@pytest.mark.skipif(CUDA, reason="test_gpu_fp8_last_tile_takes_a_tail covers this on the compiled kernels")
@pytest.mark.parametrize("blocks", ["row", "16x16"])
def test_interpreter_fp8_last_tile_takes_a_tail(blocks, monkeypatch):
    """444 rows over 8 experts in 64-row tiles with tails of up to 32 rows (as test_moe_triton's
    test_interpreter_last_tile_takes_a_tail): experts of 70, 96 and 150 rows end in a tile with a tail."""
    _check_fp8_tails([70, 96, 97, 20, 0, 150, 10, 1], tiles.row_cfg(64, 32, 16, 4, 1, tail=True, group=1), 32,
                     48, torch.float16, (None, None) if blocks == "row" else ((16, 16), (16, 16)), 2e-3,
                     monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["row", "128x128"])
def test_gpu_fp8_last_tile_takes_a_tail(blocks, monkeypatch):
    """The compiled kernels at the 128-row size class with tails (as test_moe_triton's
    test_gpu_last_tile_takes_a_tail), on FP8 weights."""
    _check_fp8_tails([134, 192, 193, 40, 0, 300, 100, 150], tiles.row_cfg(128, 128, 64, 8, 3, tail=True, group=1),
                     1024, 512, torch.bfloat16, (None, None) if blocks == "row" else ((128, 128), (128, 128)), 2e-2,
                     monkeypatch)


def test_fp8_weights_refuse_gradients_and_mixed_weights():
    x, w_gu, w_d, ids, weights = _fp8_case(2, 16, 16, 4, 2, torch.bfloat16, 0, (None, None))
    with pytest.raises(InputError, match="FP8 expert weights are for inference"):
        routed_moe_mlp(x.clone().requires_grad_(), w_gu, w_d, ids, weights)
    with pytest.raises(InputError, match="must both be Fp8Weight"):
        with torch.no_grad():
            routed_moe_mlp(x, w_gu, w_d.dequantize(), ids, weights)
    odd = Fp8Weight.quantize(w_d.dequantize(), (1, 8))
    with pytest.raises(InputError, match="8 columns wide"):
        with torch.no_grad():
            routed_moe_mlp(x, w_gu, odd, ids, weights)
    with pytest.raises(InputError, match=r"x \(torch.float16\), w_gate_up \(torch.bfloat16\)"):
        with torch.no_grad():
            routed_moe_mlp(x.half(), w_gu, w_d, ids, weights)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("T", [1, 4, 64, 512])
@pytest.mark.parametrize("blocks", ["row", "128x128"])
def test_gpu_fp8_model_shapes(shape, T, blocks):
    """On the compiled kernels, tuned: one scale per row, and 128 x 128 blocks (DeepSeek-V3's
    checkpoints), against the float64 reference on the exact dequantized values and against the bfloat16
    kernels on the values rounded to bfloat16."""
    D, I, E, K = MODEL_SHAPES[shape]
    _check_fp8(T, D, I, E, K, torch.bfloat16, (None, None) if blocks == "row" else ((128, 128), (128, 128)),
               tol=2e-2, seed=T)


# ---- W8A8: FP8 inputs too, on the sorted kernels --------------------------------------------------------

from thunderep.kernels.fp8 import dequantize_rows, quantize_rows  # noqa: E402


def _w8a8_reference(x, w_gu, w_d, ids, weights, quantized=True):
    """float64 y of the W8A8 kernels (fp8.py): x quantized per row, h rounded to x's dtype then quantized
    per row, the products exact over the exactly dequantized weights; `quantized` False: the same
    without quantizing x and h (weight-only FP8, exact)."""
    def rows(t):
        return dequantize_rows(*quantize_rows(t), dtype=torch.float64) if quantized else t.double()

    wg, wd = w_gu.dequantize(dtype=torch.float64), w_d.dequantize(dtype=torch.float64)
    xd = rows(x)
    y = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        gate, up = (xd[tok] @ wg[e].T).chunk(2, dim=-1)
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype)
        y = y.index_add(0, tok, (rows(h) @ wd[e].T) * weights[tok, slot, None].double())
    return y


def _check_w8a8(T, D, I, E, K, dtype, blocks, tol, seed=0, ids=None):
    """routed_moe_mlp on W8A8 weights, the sorted kernels pinned, against _w8a8_reference; and at least
    5x nearer to it than to the weight-only reference: the inputs were quantized."""
    x, w_gu, w_d, ids, weights = _fp8_case(T, D, I, E, K, dtype, seed, blocks, ids)
    w_gu, w_d = w_gu.with_w8a8(), w_d.with_w8a8()
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, ids, weights)
    ref = _w8a8_reference(x, w_gu, w_d, ids, weights)
    weight_only = _w8a8_reference(x, w_gu, w_d, ids, weights, quantized=False)
    assert y.shape == (T, D) and y.dtype == dtype
    err, off = rel_err(y, ref), rel_err(y, weight_only)
    assert err < tol and err * 5 < off, f"relative error {err:.2e} (weight-only reference: {off:.2e})"


@pytest.mark.parametrize("shape", [(5, 48), (3, 1), (0, 8)])
def test_quantize_rows_round_trip(shape):
    """One scale per row, amax / FP8_MAX: each value within e4m3's 2^-4 plus half its row's subnormal step."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, shape[0])[:, None]
    if shape[0] > 1:
        x[1] = 0.0  # an all-zero row: scale 1, zeros
    q, scale = quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    back = dequantize_rows(q, scale)
    xb = x.to(torch.bfloat16).float()
    assert bool(((back - xb).abs() <= xb.abs() * 2**-4 + scale[:, None] * 2**-10).all())
    if shape[0] > 1:
        assert scale[1] == 1 and not back[1].any()
    if shape[1] > 1:
        assert torch.equal(q.float().abs().amax(1)[scale != 1], torch.full_like(scale[scale != 1], FP8_MAX))


@pytest.mark.skipif(CUDA, reason="the GPU tests cover these on the compiled kernels")
@pytest.mark.parametrize("case", [(6, 32, 48, 4, 2, (None, None)), (5, 64, 96, 4, 2, ((32, 32), (7, 32))),
                                  (2, 32, 32, 8, 3, ((128, 128), (128, 128)))],
                         ids=lambda c: "T{}-D{}-I{}-E{}-K{}-{}".format(*c[:5], c[5][0]))
def test_interpreter_w8a8_matches_its_reference(case, monkeypatch):
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    _check_w8a8(*case[:5], torch.float16, case[5], tol=3e-3)


def _w8a8_tail_ids(monkeypatch, m_class, config, counts):
    """Shuffled routing ids [sum(counts), 1] with counts[e] rows for expert e; the row tiles of m_class
    pinned to `config`, autotuning and the pair kernels off."""
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    monkeypatch.setitem(tiles.DEFAULT_ROW, m_class, config)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(3))][:, None]


@pytest.mark.skipif(CUDA, reason="test_gpu_w8a8_last_tile_takes_a_tail covers this on the compiled kernels")
def test_interpreter_w8a8_last_tile_takes_a_tail(monkeypatch):
    """Tails of rows (as test_interpreter_fp8_last_tile_takes_a_tail): their row scales too."""
    counts = [70, 96, 97, 20, 0, 150, 10, 1]
    ids = _w8a8_tail_ids(monkeypatch, 64, tiles.row_cfg(64, 32, 32, 4, 1, tail=True, group=1), counts)
    assert tiles.m_key(len(ids), len(counts))[0] == 64
    _check_w8a8(len(ids), 32, 64, len(counts), 1, torch.float16, ((32, 32), None), 3e-3, ids=ids)


def test_w8a8_refuses_mixed_weights_and_narrow_blocks():
    x, w_gu, w_d, ids, weights = _fp8_case(2, 64, 64, 4, 2, torch.bfloat16, 0, (None, (1, 16)))
    with torch.no_grad(), pytest.raises(InputError, match=r"must agree on whether the products run in FP8"):
        routed_moe_mlp(x, w_gu.with_w8a8(), w_d, ids, weights)
    with torch.no_grad(), pytest.raises(InputError, match="FP8 products \\(w8a8\\) take blocks of a multiple of 32"):
        routed_moe_mlp(x, w_gu.with_w8a8(), w_d.with_w8a8(), ids, weights)


@pytest.mark.gpu
def test_gpu_quantize_rows_pass_equals_the_reference_bit_for_bit():
    """passes.quantize_rows on a GPU against fp8.quantize_rows on the CPU: rows wider than one chunk,
    an all-zero row, and values at rounding ties' scale."""
    x = torch.randn(67, 5000, generator=torch.Generator().manual_seed(4)) * torch.logspace(-4, 3, 67)[:, None]
    x[3] = 0.0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dtype)
        q, scale = sorted_mlp.quantize_rows(xd.cuda())
        q_ref, scale_ref = quantize_rows(xd)
        assert torch.equal(scale.cpu(), scale_ref)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), dtype


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("T", [64, 512])
@pytest.mark.parametrize("blocks", ["row", "128x128"])
def test_gpu_w8a8_model_shapes(shape, T, blocks, monkeypatch):
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    D, I, E, K = MODEL_SHAPES[shape]
    _check_w8a8(T, D, I, E, K, torch.bfloat16, (None, None) if blocks == "row" else ((128, 128), (128, 128)),
                tol=2e-2, seed=T)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["row", "128x128"])
def test_gpu_w8a8_last_tile_takes_a_tail(blocks, monkeypatch):
    counts = [134, 192, 193, 40, 0, 300, 100, 150]
    ids = _w8a8_tail_ids(monkeypatch, 128, tiles.row_cfg(128, 128, 64, 8, 3, tail=True, group=1), counts)
    _check_w8a8(len(ids), 1024, 512, len(counts), 1, torch.bfloat16,
                (None, None) if blocks == "row" else ((128, 128), (128, 128)), 2e-2, ids=ids.to(DEVICE))
