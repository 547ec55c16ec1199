"""The one-token pair kernels pass by pass: each kernel's device time (torch's profiler, L2 flushed before
every call) for bfloat16, per-row FP8, int4 and MXFP4 weights of one expert shape, beside the bytes each
pass reads and those bytes' time at copy bandwidth.

    python examples/pairs4_profile.py [--shape mixtral] [--calls 30] [--no-split] [--no-words4]
                                      [--loads-only words|scales|convert] [--strided-vector]
                                      [--half-products]
    ncu --profile-from-start off --clock-control none --set full -o pairs4 \
        python examples/pairs4_profile.py --ncu        # one call of each format under Nsight Compute

One process, one GPU. Random weights, one token routed to experts 0..K-1, every kernel autotuned first.
Prints per format and kernel: microseconds per call (median), the bytes it reads (weights and scales of
the K experts), and the fraction of copy bandwidth those bytes' time is (the kernel benchmark's HBM
fraction, per pass); and per format the pair's time end to end (CUDA events, L2 flushed: where the down
pass launches early, PDL, the two kernels' own times overlap). --no-split leaves the 4-bit down pass's
one-program-per-slot configs out of its autotuning; --no-words4 launches the 4-bit kernels with 8-byte
word loads (WORDS4 off, pairs4.load_words); THUNDEREP_PDL=0 launches the down pass plainly. Together they
are the 4-bit kernels as they were before those three. --loads-only runs the 4-bit kernels with each
chunk's conversion, products and vector taken out (a probe, its outputs meaningless): `words` sums each
row's words as integers; `scales` also loads the group scales and sums per group times them, as the real
chunk does; `convert` also converts every code to float32 and sums the values per group times the
scales (no vector, no products). Their time against the real kernels' is what the loads alone cost at the
same tiles, and what the conversion adds.
--strided-vector loads the vector's 8 planes of each chunk straight from memory (8 loads of every 8th
element, in the layout the products use) instead of one wide load split in registers, which the compiler
routes through shared memory with 8 barriers an iteration (examples/pairs4_sass.py counts them): same
outputs, no barriers, more load instructions. --half-products runs the int4 words' products in float16,
two per packed instruction, each half's four products summed before widening to float32 (MXFP4 as
before): fewer instructions per weight; the vector is not scaled, so an element past about 2000 in
magnitude would overflow (random inputs stay far below; a probe, not a launch option).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from thunderep.bench.kernels import SHAPES, copy_bandwidth
from thunderep.kernels import decode, pairs4, tiles, tuning
from thunderep.kernels.codes4 import E2M1_UNIT, e2m1_halves, int4_halves, int4_halves16
from thunderep.kernels.fp8 import Fp8Weight
from thunderep.kernels.int4 import Int4Weight

FLUSH_BYTES = 256 << 20


@triton.jit
def _words_only(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """Probe in place of pairs4.word_chunk: the chunk's words summed as integers (loads kept, nothing else)."""
    return tl.sum((w ^ opaque).to(tl.int32, bitcast=True).to(tl.float32), 1)


@triton.jit
def _words_and_scales(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                      MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """Probe in place of pairs4.word_chunk: the words as integers, summed per group times the group scales
    (the scale loads kept; no conversion, no vector)."""
    prod = (w ^ opaque).to(tl.int32, bitcast=True).to(tl.float32)
    vsum = tl.zeros((w.shape[1],), dtype=tl.float32)
    return pairs4._grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO, 1.0)


@triton.jit
def _strided_planes(v_ptr, k0, C, HW: tl.constexpr):
    """In place of pairs4.planes: plane j (columns k0 + 8 q + j) loaded directly, in pairs4.planes' order."""
    c = k0 + 8 * tl.arange(0, HW)
    x0 = tl.load(v_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    x1 = tl.load(v_ptr + c + 1, mask=c + 1 < C, other=0.0).to(tl.float32)
    x2 = tl.load(v_ptr + c + 2, mask=c + 2 < C, other=0.0).to(tl.float32)
    x3 = tl.load(v_ptr + c + 3, mask=c + 3 < C, other=0.0).to(tl.float32)
    x4 = tl.load(v_ptr + c + 4, mask=c + 4 < C, other=0.0).to(tl.float32)
    x5 = tl.load(v_ptr + c + 5, mask=c + 5 < C, other=0.0).to(tl.float32)
    x6 = tl.load(v_ptr + c + 6, mask=c + 6 < C, other=0.0).to(tl.float32)
    x7 = tl.load(v_ptr + c + 7, mask=c + 7 < C, other=0.0).to(tl.float32)
    return x0, x4, x1, x5, x2, x6, x3, x7


@triton.jit
def _converted(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
               MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """Probe in place of pairs4.word_chunk: every code converted as the real chunk converts it and the values
    summed per group times the scales (no vector, no products)."""
    if MXFP4:
        lo, hi = e2m1_halves(w, 0, opaque)
        vals = lo + hi
        lo, hi = e2m1_halves(w, 4, opaque)
        vals += lo + hi
        lo, hi = e2m1_halves(w, 8, opaque)
        vals += lo + hi
        lo, hi = e2m1_halves(w, 12, opaque)
        vals += lo + hi
    else:
        w8 = w >> 8
        lo, hi = int4_halves(w, 0, opaque)
        vals = lo + hi
        lo, hi = int4_halves(w, 4, opaque)
        vals += lo + hi
        lo, hi = int4_halves(w8, 0, opaque)
        vals += lo + hi
        lo, hi = int4_halves(w8, 4, opaque)
        vals += lo + hi
    vsum = tl.zeros((w.shape[1],), dtype=tl.float32)
    return pairs4._grouped(vals, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO, 1.0)


@triton.jit
def _half_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """In place of pairs4.word_chunk: int4 products in float16 (each half's four summed, then widened)."""
    x0, x4, x1, x5, x2, x6, x3, x7 = pairs4.planes(v_ptr, k0, C, w.shape[1])
    vsum = pairs4.word_sums(x0, x4, x1, x5, x2, x6, x3, x7)
    if MXFP4:
        prod, vsum = pairs4._word_products(w, v_ptr, k0, C, opaque, MXFP4, w.shape[1])
        unit: tl.constexpr = E2M1_UNIT
    else:
        w8 = w >> 8
        lo, hi = int4_halves16(w, 0, opaque)
        p_lo = lo * x0.to(tl.float16)[None, :]
        p_hi = hi * x4.to(tl.float16)[None, :]
        lo, hi = int4_halves16(w, 4, opaque)
        p_lo += lo * x1.to(tl.float16)[None, :]
        p_hi += hi * x5.to(tl.float16)[None, :]
        lo, hi = int4_halves16(w8, 0, opaque)
        p_lo += lo * x2.to(tl.float16)[None, :]
        p_hi += hi * x6.to(tl.float16)[None, :]
        lo, hi = int4_halves16(w8, 4, opaque)
        p_lo += lo * x3.to(tl.float16)[None, :]
        p_hi += hi * x7.to(tl.float16)[None, :]
        prod = p_lo.to(tl.float32) + p_hi.to(tl.float32)
        unit: tl.constexpr = 1.0
    return pairs4._grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO, unit)


_PRODUCTS_ASM = tl.constexpr("""{
.reg .b32 c, k, a, t0, t1, t2, t3, w8, p;
.reg .f16 plo, phi;
.reg .f32 flo, fhi;
mov.b32 c, 0x64086408;
mov.b32 k, 0x2C002C00;
mov.b32 a, 0xD480D480;
shr.b32 w8, $1, 8;
lop3.b32 t0, $1, 0x000F000F, 0x64006400, 0xea;
lop3.b32 t1, $1, 0x00F000F0, 0x64006400, 0xea;
lop3.b32 t2, w8, 0x000F000F, 0x64006400, 0xea;
lop3.b32 t3, w8, 0x00F000F0, 0x64006400, 0xea;
sub.f16x2 t0, t0, c;
fma.rn.f16x2 t1, t1, k, a;
sub.f16x2 t2, t2, c;
fma.rn.f16x2 t3, t3, k, a;
mul.f16x2 p, t0, $2;
fma.rn.f16x2 p, t1, $3, p;
fma.rn.f16x2 p, t2, $4, p;
fma.rn.f16x2 p, t3, $5, p;
mov.b32 {plo, phi}, p;
cvt.f32.f16 flo, plo;
cvt.f32.f16 fhi, phi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _pack16(lo, hi):
    """[HW] float32 pairs as float16x2 words (lo in the low half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _asm_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
               MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """In place of pairs4.word_chunk: int4 conversion and products in inline PTX, float16x2 (each half's four
    products summed, then widened); the vector packed to float16 pairs unscaled."""
    x0, x4, x1, x5, x2, x6, x3, x7 = pairs4.planes(v_ptr, k0, C, w.shape[1])
    vsum = pairs4.word_sums(x0, x4, x1, x5, x2, x6, x3, x7)
    if MXFP4:
        prod, vsum = pairs4._word_products(w, v_ptr, k0, C, opaque, MXFP4, w.shape[1])
        unit: tl.constexpr = E2M1_UNIT
    else:
        p04, p15, p26, p37 = _pack16(x0, x4), _pack16(x1, x5), _pack16(x2, x6), _pack16(x3, x7)
        prod = tl.inline_asm_elementwise(_PRODUCTS_ASM, "=r,r,r,r,r,r",
                                         [w.to(tl.uint32, bitcast=True) ^ opaque, p04[None, :], p15[None, :],
                                          p26[None, :], p37[None, :]], dtype=tl.float32, is_pure=True, pack=1)
        unit: tl.constexpr = 1.0
    return pairs4._grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO, unit)


@triton.jit
def _prepacked_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                     MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """In place of pairs4.word_chunk: `_asm_chunk` with the vector read as if a step before had packed it into
    4 planes of float16 pairs ([4, C / 8] 32-bit words, plane i holding columns 8 q + i and 8 q + i + 4):
    4 loads a chunk, no split in shared memory, no conversion. A timing probe: the vector's bytes are read
    as they are, so the outputs are meaningless."""
    HW: tl.constexpr = w.shape[1]
    q_W = k0 // 8 + tl.arange(0, HW)
    ok = q_W < C // 8
    vp = v_ptr.to(tl.pointer_type(tl.uint32))
    p04 = tl.load(vp + q_W, mask=ok, other=0)
    p15 = tl.load(vp + C // 8 + q_W, mask=ok, other=0)
    p26 = tl.load(vp + C // 4 + q_W, mask=ok, other=0)
    p37 = tl.load(vp + 3 * (C // 8) + q_W, mask=ok, other=0)
    prod = tl.inline_asm_elementwise(_PRODUCTS_ASM, "=r,r,r,r,r,r",
                                     [w.to(tl.uint32, bitcast=True) ^ opaque, p04[None, :], p15[None, :],
                                      p26[None, :], p37[None, :]], dtype=tl.float32, is_pure=True, pack=1)
    vsum = tl.zeros((HW,), dtype=tl.float32)
    return pairs4._grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO, 1.0)


def _weights(shape: str, device):
    D, I, E, K = SHAPES[shape][:4]
    torch.manual_seed(0)
    w_gu = (torch.randn(E, 2 * I, D, device=device) / D ** 0.5).bfloat16()
    w_d = (torch.randn(E, D, I, device=device) / I ** 0.5).bfloat16()
    formats = {"bf16": (w_gu, w_d), "fp8row": (Fp8Weight.quantize(w_gu, None), Fp8Weight.quantize(w_d, None))}
    for fmt in ("int4", "mxfp4"):
        formats[fmt] = (Int4Weight.quantize(w_gu, fmt), Int4Weight.quantize(w_d, fmt))
    return formats, D, E, K


def _nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def _call(fmt: str, x, w_gu, w_d, ids, weights):
    forward = decode.pairs4_forward if fmt in ("int4", "mxfp4") else decode.pairs_forward
    return forward(x, w_gu, w_d, ids, weights, "silu", False)


def _error(x, w_gu, w_d, ids, weights, K: int) -> float:
    """The pair's largest output error over the largest output, against float32 on the dequantized weights."""
    y = _call("int4", x, w_gu, w_d, ids, weights).float()
    g, u = (x.float() @ w_gu.dequantize(slice(0, K), torch.float32).transpose(1, 2)).chunk(2, dim=-1)
    h = torch.nn.functional.silu(g) * u  # [K, 1, I]
    ref = (h @ w_d.dequantize(slice(0, K), torch.float32).transpose(1, 2)).squeeze(1)  # [K, D]
    ref = (ref * weights[:, None]).sum(0, keepdim=True)
    return ((y - ref).abs().max() / ref.abs().max()).item()


def _kernel_times(fn, calls: int, flush: torch.Tensor) -> dict:
    """kernel name -> [microseconds per call], the flush's own kernels left out."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "pairs" in event.name:
            times.setdefault(event.name, []).append(event.device_time)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--ncu", action="store_true", help="one call of each format between profiler start/stop")
    parser.add_argument("--no-split", action="store_true", help="no SPLIT configs in the 4-bit down pass's tuning")
    parser.add_argument("--no-words4", action="store_true", help="the 4-bit kernels' word loads 8 bytes wide")
    parser.add_argument("--loads-only", choices=("words", "scales", "convert"),
                        help="probe: the 4-bit kernels with each chunk's conversion and products taken out")
    parser.add_argument("--strided-vector", action="store_true",
                        help="the 4-bit kernels load the vector's planes directly (no shared memory, no barriers)")
    parser.add_argument("--half-products", action="store_true", help="int4 products in float16 (a probe)")
    parser.add_argument("--asm-products", action="store_true",
                        help="int4 conversion and products in inline PTX, float16x2 (a probe)")
    args = parser.parse_args()
    if args.half_products:
        pairs4.word_chunk = _half_chunk
        print("the int4 kernels' products run in float16 (--half-products)")
    if args.asm_products:
        pairs4.word_chunk = _asm_chunk
        print("the int4 kernels' conversion and products run in inline PTX, float16x2 (--asm-products)")
    if args.strided_vector:
        pairs4.planes = _strided_planes
        print("the 4-bit kernels load the vector's planes directly (--strided-vector)")
    if args.loads_only:  # before the first build: Triton reads pairs4's globals when it compiles
        pairs4.word_chunk = {"words": _words_only, "scales": _words_and_scales, "convert": _converted}[args.loads_only]
        print(f"probe: the 4-bit kernels' chunks replaced ({args.loads_only}); their outputs are meaningless")
    if args.no_words4:
        launch = decode._launch4
        decode._launch4 = lambda *a, **kw: launch(*a, **{**kw, "WORDS4": False})
    if args.no_split:
        tiles.DOWN_PAIRS4.configs = [c for c in tiles.DOWN_PAIRS4.configs if not c.kwargs.get("SPLIT")]
    device = torch.device("cuda")
    formats, D, E, K = _weights(args.shape, device)
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    ids = torch.arange(K, device=device, dtype=torch.int32)
    weights = torch.full((K,), 1.0 / K, device=device)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    bandwidth = copy_bandwidth(device)
    for fmt, (w_gu, w_d) in formats.items():  # autotune every kernel before anything is timed
        _call(fmt, x, w_gu, w_d, ids, weights)
    torch.cuda.synchronize()
    for fmt in ("int4", "mxfp4"):  # the probes' outputs against the dequantized weights' (meaningless for --loads-only)
        w_gu, w_d = formats[fmt]
        print(f"{fmt}: output error {_error(x, w_gu, w_d, ids, weights, K):.2e} of the largest output "
              f"(float32 reference on the dequantized weights)")
    if args.ncu:
        torch.cuda.cudart().cudaProfilerStart()
        for fmt, (w_gu, w_d) in formats.items():
            _call(fmt, x, w_gu, w_d, ids, weights)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    print(f"{args.shape}, one token, K {K}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print("| format | kernel | us (median) | MB read | bytes at copy bandwidth us | HBM fraction |")
    print("|---|---|---|---|---|---|")
    for fmt, (w_gu, w_d) in formats.items():
        times = _kernel_times(lambda: _call(fmt, x, w_gu, w_d, ids, weights), args.calls, flush)
        total = 0.0
        for name, us in sorted(times.items()):
            which = w_gu if "up" in name else w_d
            read = _nbytes(which) / E * K
            med = statistics.median(us)
            total += med
            floor = read / bandwidth * 1e6
            print(f"| {fmt} | {name[:40]} | {med:.1f} | {read / 1e6:.1f} | {floor:.1f} | {floor / med:.0%} |")
        read = (_nbytes(w_gu) + _nbytes(w_d)) / E * K
        pair = tuning.timed_ms(lambda: _call(fmt, x, w_gu, w_d, ids, weights), 150.0, 25.0) * 1e3
        print(f"| {fmt} | sum of both | {total:.1f} | {read / 1e6:.1f} | {read / bandwidth * 1e6:.1f} | "
              f"{read / bandwidth * 1e6 / total:.0%} |")
        print(f"| {fmt} | pair, end to end | {pair:.1f} | {read / 1e6:.1f} | {read / bandwidth * 1e6:.1f} | "
              f"{read / bandwidth * 1e6 / pair:.0%} |", flush=True)


if __name__ == "__main__":
    main()
