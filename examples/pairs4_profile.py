"""The one-token pair kernels pass by pass: each kernel's device time (torch's profiler, L2 flushed before
every call) for bfloat16, per-row FP8, int4 and MXFP4 weights of one expert shape, beside the bytes each
pass reads and those bytes' time at copy bandwidth.

    python examples/pairs4_profile.py [--shape mixtral] [--calls 30] [--formats bf16,fp8row,int4,mxfp4]
                                      [--no-split] [--no-parts] [--no-words4]
                                      [--loads-only words|scales|convert] [--strided-vector]
                                      [--assume-fits] [--paired-vector] [--plane-vector]
                                      [--no-paired-h]
    ncu --profile-from-start off --clock-control none --set full -o pairs4 \
        python examples/pairs4_profile.py --ncu        # one call of each format under Nsight Compute

One process, one GPU. Random weights, one token routed to experts 0..K-1, every kernel autotuned first.
Prints per format and kernel: microseconds per call (median), the bytes it reads (weights and scales of
the K experts), and the fraction of copy bandwidth those bytes' time is (the kernel benchmark's HBM
fraction, per pass); and per format the pair's time end to end (CUDA events, L2 flushed: where the down
pass launches early, PDL, the two kernels' own times overlap). --no-split leaves the 4-bit down pass's
one-program-per-slot configs out of its autotuning, --no-parts its configs that cut I into ranges (PARTS);
--no-words4 launches the 4-bit kernels with 8-byte word loads (WORDS4 off, words4.load_words);
THUNDEREP_PDL=0 launches the down pass plainly. Together (PARTS aside) they are the 4-bit kernels as they
were before those three. THUNDEREP_HALF_PRODUCTS=0 runs the 4-bit products in float32, as before the float16
pairs (kernels/half4.py). --loads-only runs the 4-bit
kernels with each chunk's conversion, products and vector taken out (a probe, its outputs meaningless):
`words` sums each row's words as integers; `scales` also loads the group scales and sums per group times them,
as the real chunk does; `convert` also converts every code to float32 and sums the values per group times the
scales (no vector, no products). Their time against the real kernels' is what the loads alone cost at the same
tiles, and what the conversion adds.
--strided-vector loads the vector's 8 planes of each chunk straight from memory (8 loads of every 8th
element, in the layout the products use) instead of one wide load split in registers, which the compiler
routes through shared memory with 8 barriers an iteration (examples/pairs4_sass.py counts them): same
outputs, no barriers, more load instructions. Both probes replace the float32 chunk: they set
THUNDEREP_HALF_PRODUCTS=0. Each format's
output error against float32 on its dequantized weights is printed first (meaningless under the
--loads-only probes). --assume-fits takes every vector as in HALF's range without measuring it (a probe: the
measurement's own cost, each program's read of its vector before its loop; the random vectors here fit).
--paired-vector (with --assume-fits) reads int4's vector in the float16 pairs the products take, one 16-byte
load a word position, as a vector written once a token in that layout would be: no split through shared
memory, no barriers, no conversion (a probe: outputs meaningless; what such a layout could save).
--plane-vector runs HALF's products on a 16-bit vector through its float32 planes (`pairs4.half_chunk_planes`),
as before its words were read as float16 pairs in place (`half4.vector_pairs`, the default): same outputs.
--no-paired-h has the down pass convert h to float16 pairs itself, as before the gate/up pass wrote h's
float16-pair copy (`decode.PAIRED_H`).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
import triton.language as tl

from thunderep.bench.kernels import SHAPES, copy_bandwidth
from thunderep.kernels import decode, pairs4, tiles, tuning, vector4
from thunderep.kernels.codes4 import e2m1_halves, int4_halves
from thunderep.kernels.fp8 import Fp8Weight
from thunderep.kernels.half4 import pair_products
from thunderep.kernels.int4 import Int4Weight

FLUSH_BYTES = 256 << 20


@triton.jit
def _words_only(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                MXFP4: tl.constexpr, ZERO: tl.constexpr):
    """Probe in place of pairs4.word_chunk: the chunk's words summed as integers (loads kept, nothing else)."""
    return tl.sum((w ^ opaque).to(tl.int32, bitcast=True).to(tl.float32), 1, keep_dims=True)  # added to each partial


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
def _assumed_largest(v_ptr, C, BLOCK_K: tl.constexpr):
    """In place of pairs4.largest: 1.0, no read of the vector (every vector taken as in HALF's range)."""
    return tl.full((), 1.0, tl.float32)


@triton.jit
def _paired_chunk(w, s_ptrs_N, z_ptrs_N, k0, C, ok_N, v_ptr, opaque, stride_sk, GROUP: tl.constexpr,
                  MXFP4: tl.constexpr, ZERO: tl.constexpr, MODE: tl.constexpr, vp_ptr=0, PAIRED: tl.constexpr = False):
    """Probe in place of pairs4.half_chunk: the vector's 16 bytes at each word position read as the word's 4
    float16 pairs, as a vector written once a token in that layout would be (one 16-byte load a word position;
    no split, no conversion, no shared memory). Its outputs are meaningless (bfloat16 bits read as float16)."""
    HW: tl.constexpr = w.shape[1]
    p04, p15, p26, p37 = vector4.vector_words(v_ptr, k0, C, HW)  # the 4 words of a position, taken as the pairs
    prod = pair_products(w, p04, p15, p26, p37, opaque, MODE)
    vsum = tl.zeros((HW,), dtype=tl.float32)
    return pairs4._grouped(prod, vsum, s_ptrs_N, z_ptrs_N, k0, C, ok_N, stride_sk, GROUP, 8, MXFP4, ZERO, 1.0)


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
    parser.add_argument("--formats", default="bf16,fp8row,int4,mxfp4",
                        help="comma-separated formats to time (of bf16, fp8row, int4, mxfp4)")
    parser.add_argument("--ncu", action="store_true", help="one call of each format between profiler start/stop")
    parser.add_argument("--no-split", action="store_true", help="no SPLIT configs in the 4-bit down pass's tuning")
    parser.add_argument("--no-parts", action="store_true", help="no PARTS configs in the 4-bit down pass's tuning")
    parser.add_argument("--no-words4", action="store_true", help="the 4-bit kernels' word loads 8 bytes wide")
    parser.add_argument("--loads-only", choices=("words", "scales", "convert"),
                        help="probe: the 4-bit kernels with each chunk's conversion and products taken out")
    parser.add_argument("--strided-vector", action="store_true",
                        help="the 4-bit kernels load the vector's planes directly (no shared memory, no barriers)")
    parser.add_argument("--assume-fits", action="store_true",
                        help="HALF's range check without reading the vector (every vector taken as fitting)")
    parser.add_argument("--paired-vector", action="store_true",
                        help="probe: int4's float16-pair chunk reads the vector as if stored as float16 pairs "
                             "(implies --assume-fits; outputs meaningless)")
    parser.add_argument("--plane-vector", action="store_true",
                        help="HALF reads a 16-bit vector through its float32 planes (pairs4.half_chunk_planes), as "
                             "before half4.vector_pairs")
    parser.add_argument("--no-paired-h", action="store_true",
                        help="the down pass converts h to float16 pairs itself (decode.PAIRED_H off)")
    args = parser.parse_args()
    if args.strided_vector or args.loads_only:  # the probes replace the float32 chunk: int4 runs it
        os.environ["THUNDEREP_HALF_PRODUCTS"] = "0"
    if args.strided_vector:
        pairs4.planes = _strided_planes
        print("the 4-bit kernels load the vector's planes directly (--strided-vector)")
    if args.no_paired_h:
        decode.PAIRED_H = False
        print("the down pass converts h itself (--no-paired-h)")
    if args.plane_vector:
        pairs4.half_chunk = pairs4.half_chunk_planes
        print("HALF reads the vector through its float32 planes (--plane-vector)")
    if args.paired_vector:
        pairs4.half_chunk = _paired_chunk
        args.assume_fits = True
        print("probe: int4's float16-pair chunk reads the vector as stored float16 pairs (--paired-vector)")
    if args.assume_fits:
        pairs4.largest = _assumed_largest
        print("probe: HALF takes every vector as in range without reading it (--assume-fits)")
    if args.loads_only:  # before the first build: Triton reads pairs4's globals when it compiles
        pairs4.word_chunk = {"words": _words_only, "scales": _words_and_scales, "convert": _converted}[args.loads_only]
        print(f"probe: the 4-bit kernels' chunks replaced ({args.loads_only}); their outputs are meaningless")
    if args.no_words4:
        launch = decode._launch4
        decode._launch4 = lambda *a, **kw: launch(*a, **{**kw, "WORDS4": False})
    if args.no_split:
        tiles.DOWN_PAIRS4.configs = [c for c in tiles.DOWN_PAIRS4.configs if not c.kwargs.get("SPLIT")]
    if args.no_parts:
        tiles.DOWN_PAIRS4.configs = [c for c in tiles.DOWN_PAIRS4.configs if c.kwargs.get("PARTS", 1) == 1]
    device = torch.device("cuda")
    formats, D, E, K = _weights(args.shape, device)
    unknown = set(args.formats.split(",")) - set(formats)
    if unknown:
        parser.error(f"--formats: unknown {sorted(unknown)}; use some of {sorted(formats)}")
    formats = {fmt: w for fmt, w in formats.items() if fmt in args.formats.split(",")}
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    ids = torch.arange(K, device=device, dtype=torch.int32)
    weights = torch.full((K,), 1.0 / K, device=device)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    bandwidth = copy_bandwidth(device)
    for fmt, (w_gu, w_d) in formats.items():  # autotune every kernel before anything is timed
        _call(fmt, x, w_gu, w_d, ids, weights)
    torch.cuda.synchronize()
    for name in ("up_pairs4", "down_pairs4"):
        for key, config in tuning.kernel_configs().get(name, {}).items():
            print(f"{name} chose {config} for key {key}")
    for fmt in sorted({"int4", "mxfp4"} & set(formats)):  # against the dequantized weights (--loads-only: meaningless)
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
