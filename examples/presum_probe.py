"""Probe: the combine's pre-sum kernel (thunderep/kernels/presum.py) against the torch formula it replaces
(a zeroed [M * K, D] float32 buffer, an index copy, a sum over K), forward only, on one GPU.

    python examples/presum_probe.py

Rows as rank 0 receives them in ep mode: R ranks of T tokens, top-K of E experts uniformly at random, E / R
experts per rank; bfloat16 outputs. Prints both times (median of triton.testing.do_bench), the ratio and
the bytes each moves over the measured time.
"""

from __future__ import annotations

import torch
import triton.testing

from thunderep.kernels.presum import presum


def _rows(T, R, E, K, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(R * T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]
    local = ids < E // R  # rank 0 holds experts 0 .. E / R - 1
    received = local.any(dim=1)
    positions = (torch.arange(R * T, device="cuda").view(-1, 1) * K + torch.arange(K, device="cuda"))[local]
    rows_of = torch.cumsum(received.long(), 0) - 1  # received row of each token
    pairs = rows_of.repeat_interleave(K).view(-1, K)[local] * K + positions % K
    order = torch.argsort(ids[local], stable=True)  # the experts' order
    M, Q = int(received.sum()), int(local.sum())
    y = torch.randn(Q, D, device="cuda", generator=gen).to(torch.bfloat16)
    return y, torch.rand(Q, device="cuda", generator=gen), pairs[order], M


def _torch(y, w, pairs, M, K):
    weighted = y.float() * w.float().unsqueeze(-1)
    full = weighted.new_zeros(M * K, y.shape[-1]).index_copy(0, pairs, weighted)
    return full.view(M, K, -1).sum(dim=1).to(y.dtype)


def main() -> None:
    print("| shape | R | T | M rows | Q pairs | torch ms | kernel ms | ratio | kernel GB/s | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, E, K, D in (("qwen3", 128, 8, 2048), ("mixtral", 8, 2, 4096)):
        for R in (2, 4):
            for T in (64, 512, 4096):
                y, w, pairs, M = _rows(T, R, E, K, D)
                a, b = _torch(y, w, pairs, M, K), presum(y, w, pairs, M, K)
                err = ((a.double() - b.double()).norm() / a.double().norm()).item()
                t_torch = triton.testing.do_bench(lambda: _torch(y, w, pairs, M, K), return_mode="median")
                t_kernel = triton.testing.do_bench(lambda: presum(y, w, pairs, M, K), return_mode="median")
                moved = (y.numel() + M * D) * 2 + w.numel() * 4
                print(f"| {name} | {R} | {T} | {M} | {y.shape[0]} | {t_torch:.4f} | {t_kernel:.4f} | "
                      f"{t_torch / t_kernel:.2f}x | {moved / t_kernel / 1e6:.0f} | {err:.1e} |")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
