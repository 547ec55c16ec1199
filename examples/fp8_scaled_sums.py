"""What scaling each chunk's FP8 products costs a GEMM on the FP8 tensor cores, apart from everything else.

    python examples/fp8_scaled_sums.py [--dense M,N,K ...] [--gate-up M,N,K ...]

With FP8 inputs and weights whose scales change every 128 columns along k (DeepSeek-V3's 128 x 128
blocks), each chunk's products must be summed apart and multiplied by its scales before they join the
float32 sum; with one scale per row they chain into one accumulator and the scales multiply once at the
end. Plain Triton GEMMs, A [M, K] and B [N, K] (k contiguous, as the experts' weights) in e4m3, scales
per 128 columns of B and per 128 along k:
- dense: C = A @ B.T; modes chain (no per-chunk scaling), scaled (acc += dot * s), deferred (chunk i
  scaled after chunk i + 1's product is issued);
- gate-up: two B matrices against one A and the activation, as the up kernel; modes chain, scaled, and
  issued (both products before either is scaled).
Each mode's best of a few tiles is printed, in TFLOP/s, with its time over chain's. The modes that
scale give the same output (checked between scaled and deferred).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def dense_kernel(a_ptr, b_ptr, s_ptr, c_ptr, M, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rn[None, :] * K + rk[:, None]
    s_ptrs = s_ptr + rn // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if MODE == 0:  # chain
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        elif MODE == 1:  # scaled
            s = tl.load(s_ptrs + (k0 // 128) * (N // 128))
            acc += tl.dot(a, b) * s[None, :]
        else:  # deferred
            s = tl.load(s_ptrs + (k0 // 128) * (N // 128))
            cur = tl.dot(a, b)
            acc += prev * prev_s[None, :]
            prev = cur
            prev_s = s
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MODE == 2:
        acc += prev * prev_s[None, :]
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def gate_up_kernel(a_ptr, g_ptr, u_ptr, s_ptr, c_ptr, M, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]
    g_ptrs = g_ptr + rn[None, :] * K + rk[:, None]
    u_ptrs = u_ptr + rn[None, :] * K + rk[:, None]
    s_ptrs = s_ptr + rn // 128
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs)
        bg = tl.load(g_ptrs)
        bu = tl.load(u_ptrs)
        if MODE == 0:  # chain
            acc_g = tl.dot(a, bg, acc_g, max_num_imprecise_acc=BLOCK_K)
            acc_u = tl.dot(a, bu, acc_u, max_num_imprecise_acc=BLOCK_K)
        elif MODE == 1:  # scaled
            s = tl.load(s_ptrs + (k0 // 128) * (N // 128))[None, :]
            acc_g += tl.dot(a, bg) * s
            acc_u += tl.dot(a, bu) * s
        else:  # issued
            s = tl.load(s_ptrs + (k0 // 128) * (N // 128))[None, :]
            dg = tl.dot(a, bg)
            du = tl.dot(a, bu)
            acc_g += dg * s
            acc_u += du * s
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], h.to(tl.bfloat16))


DENSE_TILES = ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 128, 4, 4), (64, 256, 128, 4, 4),
               (128, 256, 128, 8, 4))
GATE_UP_TILES = ((128, 128, 128, 8, 3), (128, 64, 128, 4, 4), (128, 128, 128, 8, 4), (64, 128, 128, 4, 4),
                 (128, 128, 64, 8, 4))


def _fp8(*shape):
    return torch.randn(*shape, device="cuda").to(torch.float8_e4m3fn)


def _best(launch, tiles, M, N):
    best = None
    for bm, bn, bk, warps, stages in tiles:
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)

        def f():
            launch(grid, c, bm, bn, bk, warps, stages)
        try:
            f()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(f, warmup=50, rep=200)
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported and skipped
            print(f"  tile {(bm, bn, bk, warps, stages)} failed: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        if best is None or ms < best[0]:
            best = (ms, (bm, bn, bk, warps, stages), c)
    return best


def run(kind, M, N, K):
    torch.manual_seed(0)
    a = _fp8(M, K)
    s = torch.rand(K // 128, N // 128, device="cuda") + 0.5
    if kind == "dense":
        b = _fp8(N, K)
        modes, tiles, flops = ("chain", "scaled", "deferred"), DENSE_TILES, 2 * M * N * K

        def launcher(mode):
            return lambda grid, c, bm, bn, bk, w, st: dense_kernel[grid](a, b, s, c, M, N, K, mode, bm, bn, bk, 8,
                                                                         num_warps=w, num_stages=st)
    else:
        g, u = _fp8(N, K), _fp8(N, K)
        modes, tiles, flops = ("chain", "scaled", "issued"), GATE_UP_TILES, 4 * M * N * K

        def launcher(mode):
            return lambda grid, c, bm, bn, bk, w, st: gate_up_kernel[grid](a, g, u, s, c, M, N, K, mode, bm, bn, bk,
                                                                           8, num_warps=w, num_stages=st)
    ms, outs = {}, {}
    for mode, name in enumerate(modes):
        best = _best(launcher(mode), tiles, M, N)
        ms[name], outs[name] = best[0], best[2].float()
        print(f"{kind} M={M} N={N} K={K} {name:8s} {best[0]:.3f} ms {flops / best[0] / 1e9:6.0f} TFLOP/s  "
              f"tile {best[1]}", flush=True)
    ref, other = outs[modes[1]], outs[modes[2]]
    print(f"  {modes[2]} vs {modes[1]}: relative difference {((other - ref).norm() / ref.norm()).item():.2e}; "
          + ", ".join(f"{m} / chain {ms[m] / ms['chain']:.2f}x" for m in modes[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense", nargs="*", default=["8192,8192,8192", "16384,4096,7168", "16384,7168,2048"])
    ap.add_argument("--gate-up", nargs="*", default=["16384,2048,7168", "8192,14336,4096"])
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for kind, shapes in (("dense", args.dense), ("gate-up", args.gate_up)):
        for shape in shapes:
            run(kind, *map(int, shape.split(",")))


if __name__ == "__main__":
    main()
