"""The one-pass 4-bit dequantization kernel (thunderep/kernels/dequant4.py) and `Int4Weight.dequantize`
against the exact values, bit for bit: compiled on a CUDA GPU where one is present, else in Triton's CPU
interpreter (and `dequantize` on its torch path).

The reference is the format's definition in float64 (exact: a small integer or an e2m1 value times a
float32 scale or a power of two), rounded once to float32, then cast: what one float32 product does.
The interpreter rounds float32 to bfloat16 by truncation (compiled kernels and torch: to nearest even)
and flushes float32 subnormals: the kernel's bfloat16 there is checked against the float32 reference
truncated, where that is normal or zero.
"""

from __future__ import annotations

import os

import pytest
import torch

from thunderep.kernels.int4 import Int4Weight

triton = pytest.importorskip("triton")

from test_moe_triton import DEVICE  # noqa: E402

from thunderep.kernels.dequant4 import dequantize4  # noqa: E402

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     dtype=torch.float64)
_POW2 = torch.tensor([2.0 ** (s - 127) for s in range(256)], dtype=torch.float64)  # e8m0: 255 is 2 ** 128 here
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def _reference(packed, scale, zero, group, fmt, dtype):
    """W [E, R, C] in dtype from the definition (int4.py's docstring): the exact values (float64), or
    those rounded once to float32, then cast."""
    packed, scale = packed.cpu().to(torch.int64), scale.cpu()
    n = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
    g = torch.arange(n.shape[-1]) // group
    if fmt == "mxfp4":
        exact = _E2M1[n] * _POW2[scale.to(torch.int64)[..., g]]
    else:
        z = zero.cpu().to(torch.int64)[..., g] if zero is not None else 0
        exact = (n - 8 - z).double() * scale.double()[..., g]
    return exact if dtype == torch.float64 else exact.float().to(dtype)


def _kernel_cast_is(out, ref_f32):
    """Whether out (the kernel's, in its dtype) is the float32 reference cast as the kernel casts: in the
    interpreter, to bfloat16 by truncation where the reference is a float32 normal or zero. Compiled for
    CUDA, float32 subnormals flush to zero (MXFP4's exponent code 0, 2 ** -127, times small values): where
    the reference is one, any zero is right, and zeros compare without their sign."""
    if out.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        normal = (ref_f32.abs() >= torch.finfo(torch.float32).tiny) | (ref_f32 == 0)
        truncated = (ref_f32.view(torch.int32) >> 16).to(torch.int16)
        return torch.equal(out.cpu().view(torch.int16)[normal], truncated[normal])
    if out.is_cuda:
        flushed = ref_f32.abs() < torch.finfo(torch.float32).tiny
        return _same_bits(out, torch.where(flushed, 0.0, ref_f32).to(out.dtype))
    return _same_bits(out, ref_f32.to(out.dtype))


def _same_bits(a, b):
    """Bit equality; on CUDA a zero equals a zero of either sign (flushed subnormals keep no sign)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point and (a.is_cuda or b.is_cuda or torch.cuda.is_available()):
        zeros = (a == 0) & (b == 0)
        a, b = torch.where(zeros, 0.0, a).to(a.dtype), torch.where(zeros, 0.0, b).to(b.dtype)
    return torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _case(E, R, C, group, fmt, scale_dtype=torch.float32, zero=False, seed=0):
    """Random bytes, scales (int4: spread over six decades, some negative; mxfp4: exponents 0..250,
    2 ** -127 to 2 ** 123) and zero points in [-8, 7]."""
    gen = torch.Generator().manual_seed(seed)
    nG = -(-C // group)
    packed = torch.randint(0, 256, (E, R, C // 2), generator=gen, dtype=torch.uint8)
    if fmt == "mxfp4":
        scale = torch.randint(0, 251, (E, R, nG), generator=gen, dtype=torch.uint8)
        scale[0, 0, 0], scale[-1, -1, -1] = 0, 250
    else:
        scale = (torch.randn(E, R, nG, generator=gen) * 10.0 ** torch.randint(-4, 2, (E, R, nG), generator=gen))
        scale = scale.to(scale_dtype)
    z = torch.randint(-8, 8, (E, R, nG), generator=gen, dtype=torch.int8) if zero else None
    return packed, scale, z


INT4 = [  # E, R, C, group, scale dtype, zero points
    (3, 5, 200, 32, torch.float32, False),  # C = 200: a partial group of 8 at the end of each row
    (2, 7, 44, 8, torch.bfloat16, True),  # a partial group of 4
    (2, 3, 300, 128, torch.float16, True),  # a partial group of 44
    (2, 4, 256, 128, torch.float32, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", INT4, ids=lambda c: "E{}-R{}-C{}-g{}-{}{}".format(*c[:5], "-zero" if c[5] else ""))
def test_int4_kernel_equals_the_definition(case, dtype):
    E, R, C, group, scale_dtype, zero = case
    packed, scale, z = _case(E, R, C, group, "int4", scale_dtype, zero)
    out = dequantize4(packed.to(DEVICE), scale.to(DEVICE), None if z is None else z.to(DEVICE), group, False, dtype)
    assert out.is_contiguous() and out.dtype == dtype
    assert _kernel_cast_is(out, _reference(packed, scale, z, group, "int4", torch.float32))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # float16's inf, in the interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_mxfp4_kernel_equals_the_definition(dtype):
    """Exponents 0 (2 ** -127, a float32 subnormal) to 250; float16 saturates to inf and flushes to 0
    exactly where the cast of the float32 value does."""
    packed, scale, _ = _case(4, 6, 96, 32, "mxfp4", seed=1)
    out = dequantize4(packed.to(DEVICE), scale.to(DEVICE), None, 32, True, dtype)
    assert _kernel_cast_is(out, _reference(packed, scale, None, 32, "mxfp4", torch.float32))


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_strided_inputs_small_tiles_and_a_slice_of_experts(fmt):
    """Inputs read by their strides: a slice of experts, every other row, bytes a column apart, scales
    stored transposed (zero points not); tiles of 4 rows by 16 columns, so rows and columns both end in
    partial tiles."""
    group, zero = (32, False) if fmt == "mxfp4" else (16, True)
    packed, scale, z = _case(5, 10, 2 * 70, group, fmt, zero=zero, seed=2)
    big = torch.zeros(5, 10, 2 * 70, dtype=torch.uint8)
    big[..., ::2] = packed
    packed_v = big.to(DEVICE)[1:4, ::2, ::2]  # [3, 5, 70], strides (1400, 280, 2)
    scale_v = scale.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2)[1:4, ::2]
    z_v = z.to(DEVICE)[1:4, ::2] if zero else None
    assert not packed_v.is_contiguous() and not scale_v.is_contiguous()
    want = _reference(packed[1:4, ::2], scale[1:4, ::2], None if z is None else z[1:4, ::2], group, fmt,
                      torch.float32)
    for block_c, block_r in ((16, 4), (None, None)):
        out = dequantize4(packed_v, scale_v, z_v, group, fmt == "mxfp4", torch.bfloat16, block_c, block_r)
        assert _kernel_cast_is(out, want)


@pytest.mark.parametrize("fmt,group,zero", [("int4", 32, True), ("int4", 8, False), ("mxfp4", 32, False)])
def test_dequantize_equals_the_definition_whole_and_sliced(fmt, group, zero):
    """`Int4Weight.dequantize` (the kernel on CUDA, torch ops elsewhere), in the products' dtype, float32
    and float64 (torch ops everywhere, exact), whole and for a slice of experts."""
    packed, scale, z = _case(4, 6, 72, group, fmt, torch.bfloat16, zero, seed=3)
    w = Int4Weight(packed, scale, group, torch.float16, fmt, z).to(DEVICE)
    for dtype in (None, torch.float32, torch.bfloat16, torch.float64):
        want = _reference(packed, scale, z, group, fmt, dtype or torch.float16)
        assert _same_bits(w.dequantize(dtype=dtype), want)
        assert _same_bits(w.dequantize(slice(1, 3), dtype), want[1:3])


def test_dequantize_reads_no_host_memory(monkeypatch):
    """The torch path's e2m1 values come from the bits: nothing is copied from the host per call (inside
    CUDA-graph capture such a copy is refused). Checked here as: no tensor is built from a Python list."""
    packed, scale, _ = _case(2, 3, 64, 32, "mxfp4", seed=4)
    w = Int4Weight(packed, scale, 32, torch.bfloat16, "mxfp4")

    def refuse(*args, **kwargs):
        raise AssertionError("dequantize built a tensor from host data")

    with monkeypatch.context() as patched:
        patched.setattr(torch, "tensor", refuse)
        out = w.dequantize(dtype=torch.float32)
    assert _same_bits(out, _reference(packed, scale, None, 32, "mxfp4", torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["kernel", "torch-ops"])
def test_gpu_dequantize_is_captured_in_a_cuda_graph(dtype):
    """Both paths on CUDA (the kernel; float64: torch ops) capture, and the replay gives the eager values."""
    packed, scale, _ = _case(3, 64, 256, 32, "mxfp4", seed=5)
    w = Int4Weight(packed, scale, 32, torch.bfloat16, "mxfp4").to("cuda")
    eager = w.dequantize(dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w.dequantize(dtype=dtype)
    graph.replay()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_gpu_model_shape_equals_the_torch_path():
    """Qwen3-30B-A3B's gate_up shape (8 of its 128 experts), int4 group 128 with zero points, bf16 scales:
    the kernel against the torch path's float32 products on the CPU, bit for bit."""
    packed, scale, z = _case(8, 1536, 2048, 128, "int4", torch.bfloat16, True, seed=6)
    w = Int4Weight(packed, scale, 128, torch.bfloat16, "int4", z)
    assert _same_bits(w.to("cuda").dequantize(), w.dequantize())
