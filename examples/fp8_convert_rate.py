"""What converting FP8 weights costs a decode matrix-vector product, apart from everything else.

    python examples/fp8_convert_rate.py [--rows 57344] [--cols 4096]

y[n] = sum over k of W[n, k] * x[k] for a [rows, cols] weight (default: two Mixtral experts' gate/up
rows), in the pair kernels' elementwise way ([BLOCK_N, BLOCK_K] float32 tiles summed at the end), with
W read as:
- bf16: bfloat16 weights, each converted to float32 (a shift);
- fp8: float8_e4m3fn weights converted by Triton's `.to(tl.float32)` (the pair kernels' way);
- fp8-bits: the same bytes read as uint8 and placed into a float32's bits by integer operations,
  sign to bit 31 and exponent and mantissa to bits 26..20: the value times 2^-120, exact (e4m3's
  subnormals become float32 subnormals), the 2^120 folded into the row's scale;
- fp8-words: as fp8-bits, four bytes per 32-bit load, each byte lane shifted into place (x read in
  four strided lanes to match);
- bf16-reduce, fp8-reduce: as bf16 and fp8, but each chunk summed over k at once into a [BLOCK_N]
  float32 vector, so the chunk's width no longer sets the accumulator's registers and wider chunks
  (more bytes in flight per program) fit.
Every variant's y is checked against a float64 product of the same values. Four weight sets rotate, so
L2 holds none of them; each variant's best of a few tiles is printed as bytes read per second over the
copy bandwidth of a 2 GiB copy in the same run.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from thunderep.bench.kernels import copy_bandwidth
from thunderep.kernels.tuning import timed_ms

TILES = [(16, 256, 4), (16, 512, 4), (32, 256, 8), (8, 512, 4), (32, 512, 8), (64, 256, 8)]
WIDE_TILES = [(16, 1024, 4), (8, 1024, 4), (16, 2048, 8), (32, 1024, 8), (4, 2048, 4)]  # reduce modes only
TWO_POW_120 = 2.0**120


@triton.jit
def _bits_to_f32(b):
    """uint8/int32 e4m3 bits (low byte) -> float32 holding the value times 2^-120."""
    i = b.to(tl.int32)
    return (((i & 0x80) << 24) | ((i & 0x7F) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    if MODE == 3:  # four bytes per load
        W4: tl.constexpr = BLOCK_K // 4
        c = tl.arange(0, W4)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * (K // 4) + c[None, :]
        acc = tl.zeros((BLOCK_N, W4), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs)  # rows: a multiple of every BLOCK_N (main checks)
            x0 = tl.load(x_ptr + k0 + 4 * c).to(tl.float32)
            x1 = tl.load(x_ptr + k0 + 4 * c + 1).to(tl.float32)
            x2 = tl.load(x_ptr + k0 + 4 * c + 2).to(tl.float32)
            x3 = tl.load(x_ptr + k0 + 4 * c + 3).to(tl.float32)
            f0 = (((w & 0x80) << 24) | ((w & 0x7F) << 20)).to(tl.float32, bitcast=True)
            f1 = (((w & 0x8000) << 16) | ((w & 0x7F00) << 12)).to(tl.float32, bitcast=True)
            f2 = (((w & 0x800000) << 8) | ((w & 0x7F0000) << 4)).to(tl.float32, bitcast=True)
            f3 = ((w & -0x80000000) | ((w >> 4) & 0x07F00000)).to(tl.float32, bitcast=True)
            acc += f0 * x0[None, :] + f1 * x1[None, :] + f2 * x2[None, :] + f3 * x3[None, :]
            w_ptrs += W4
        y = tl.sum(acc, 1)
    elif MODE >= 4:  # a [BLOCK_N] sum, each chunk reduced over k at once
        k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs)  # rows: a multiple of every BLOCK_N (main checks)
            xv = tl.load(x_ptr + k0 + k).to(tl.float32)
            y += tl.sum(w.to(tl.float32) * xv[None, :], 1)
            w_ptrs += BLOCK_K
    else:
        k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs)  # rows: a multiple of every BLOCK_N (main checks)
            xv = tl.load(x_ptr + k0 + k).to(tl.float32)
            if MODE == 2:
                wf = _bits_to_f32(w)
            else:
                wf = w.to(tl.float32)
            acc += wf * xv[None, :]
            w_ptrs += BLOCK_K
        y = tl.sum(acc, 1)
    tl.store(y_ptr + rows, y, mask=ok)


MODES = {"bf16": 0, "fp8": 1, "fp8-bits": 2, "fp8-words": 3, "bf16-reduce": 4, "fp8-reduce": 5}


def _operand(mode: str, w_fp8: torch.Tensor) -> torch.Tensor:
    if mode.startswith("bf16"):
        return w_fp8.to(torch.bfloat16)
    if mode == "fp8-bits":
        return w_fp8.view(torch.uint8)
    if mode == "fp8-words":
        return w_fp8.view(torch.int32)
    return w_fp8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=57344)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--check-only", action="store_true", help="check every variant's result, time nothing")
    args = ap.parse_args()
    N, K = args.rows, args.cols
    if N % 64 or K % 2048:
        raise SystemExit(f"--rows ({N}) must be a multiple of 64 and --cols ({K}) of 2048")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [(torch.randn(N, K, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            for _ in range(4)]
    x = torch.randn(K, device=device, generator=gen).to(torch.bfloat16)
    bw = None if args.check_only else copy_bandwidth(torch.device(device))
    if bw:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s; W [{N}, {K}]")
    rows = []
    for mode, code in MODES.items():
        ops = [_operand(mode, w) for w in sets]
        want = (sets[0].double() @ x.double())
        y = torch.empty(N, device=device, dtype=torch.float32)
        best = None
        for bn, bk, warps in TILES + (WIDE_TILES if code >= 4 else []):
            if bk > K:
                continue
            grid = (triton.cdiv(N, bn),)
            _gemv_kernel[grid](ops[0], x, y, N, K, MODE=code, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
            got = y.double() * (TWO_POW_120 if mode in ("fp8-bits", "fp8-words") else 1.0)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, f"{mode} {bn}x{bk}: relative error {err:.2e}"
            if args.check_only:
                continue
            turn = [0]

            def step():
                turn[0] = (turn[0] + 1) % 4
                _gemv_kernel[grid](ops[turn[0]], x, y, N, K, MODE=code, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)

            ms = timed_ms(step, ms_budget=60.0, warmup_ms=10.0)
            nbytes = ops[0].numel() * ops[0].element_size()
            frac = nbytes / (ms * 1e-3) / bw
            print(f"{mode:10s} {bn:3d}x{bk:3d} w{warps}: {ms * 1e3:8.1f} us  {frac:6.1%}")
            if best is None or ms < best[0]:
                best = (ms, frac, (bn, bk, warps))
        if best is not None:
            rows.append((mode, *best))
    if args.check_only:
        print("every variant equals the float64 product")
        return
    print("| W read as | best tile | us | bytes/s over copy bandwidth |\n|---|---|---|---|")
    for mode, ms, frac, tile in rows:
        print(f"| {mode} | {tile[0]}x{tile[1]}, {tile[2]} warps | {ms * 1e3:.1f} | {frac:.0%} |")


if __name__ == "__main__":
    main()
