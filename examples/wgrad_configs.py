"""The portable weight-gradient kernel over a wide set of tile configs, against the GPU's write rate.

At a few rows per expert the weight gradients are bound by writing dW (a product over 16 rows per
value is short), so the measure beside each config is the rate it writes dW at, and the reference is
what a plain fill of a tensor of dW's size writes at (torch's `fill_`, no reads).

    python examples/wgrad_configs.py mixtral [--tokens 64] [--top 8]

One process, one GPU. Rows and routing as the kernel benchmark makes them (uniform random top-K, bf16);
for each of the two weight gradients (dW_gate_up: [E, 2I, D], dW_down: [E, D, I]) every config of the
candidate set is launched directly (the autotuner's own set is marked *), timed as the autotuner times
(`tuning.timed_ms`, L2 flushed clean), and the `--top` fastest are printed with ms and write TB/s,
beside the fill.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.runtime.errors import OutOfResources

from thunderep.kernels import moe_triton as K
from thunderep.kernels import sorted_mlp, tiles
from thunderep.bench.kernels import SHAPES
from thunderep.kernels.tuning import precision, timed_ms


def candidates() -> list[triton.Config]:
    """Tiles of 64 to 256 by 64 to 256, 16 or 32 rows a step, 4 or 8 warps, 2 to 4 stages."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128, 256), (64, 128, 256), (16, 32), (4, 8), (2, 3, 4)):
        if bm * bn > 128 * 256 or (bm * bn == 128 * 256 and warps == 4):
            continue  # accumulators that spill
        out.append(tiles.cfg(bm, bn, bk, warps, stages))
    return out


def _name(cfg: triton.Config) -> str:
    k = cfg.kwargs
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"


def _key(cfg: triton.Config) -> tuple:
    k = cfg.kwargs
    return k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], cfg.num_warps, cfg.num_stages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    D, I, E, top_k = SHAPES[args.shape]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    n_rows = args.tokens * top_k
    ids = torch.rand(args.tokens, E, device=device, generator=gen).topk(top_k, dim=1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=E).to(torch.int32)
    bm_class, fill = tiles.m_key(n_rows, E)
    own = {_key(c) for c in tiles.WGRAD_CONFIGS}
    print(f"# {torch.cuda.get_device_name()}, {args.shape} T={args.tokens}: {n_rows} rows, "
          f"{n_rows / E:.1f} per expert, key m_class={bm_class} m_fill={fill}; * = in the autotuner's set")
    for what, M, N in (("dW_gate_up", 2 * I, D), ("dW_down", D, I)):
        a = torch.randn(n_rows, M, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n_rows, N, device=device, dtype=torch.bfloat16, generator=gen)
        out = torch.empty(E, M, N, device=device, dtype=torch.bfloat16)
        gbytes = out.numel() * out.element_size() / 1e9
        fill_ms = timed_ms(lambda: out.fill_(1.0))
        reference = torch.empty_like(out)
        sorted_mlp.wgrad(a, b, counts, reference)
        rows = []
        for cfg in candidates():
            def call(cfg=cfg):
                grid = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]), E)
                K.wgrad_kernel[grid](a, b, out, counts, M, N, E, n_rows, a.stride(0), b.stride(0), out.stride(0),
                                      out.stride(1), bm_class, fill, PRECISION=precision(a.dtype),
                                      BLOCK_E=sorted_mlp.block_e(E), **cfg.kwargs, num_warps=cfg.num_warps,
                                      num_stages=cfg.num_stages)
            try:
                call()
            except OutOfResources:
                continue
            torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
            rows.append((timed_ms(call), cfg))
        rows.sort(key=lambda r: r[0])
        print(f"\n## {what} [E={E}, {M}, {N}], {gbytes:.2f} GB: fill {fill_ms:.3f} ms ({gbytes / fill_ms:.2f} TB/s); "
              f"{len(rows)} configs ran")
        print("| config | ms | write TB/s | / fill |")
        print("|---|---|---|---|")
        best_own = next(r for r in rows if _key(r[1]) in own)
        for ms, cfg in rows[:args.top] + ([best_own] if best_own not in rows[:args.top] else []):
            star = "*" if _key(cfg) in own else ""
            print(f"| {_name(cfg)}{star} | {ms:.3f} | {gbytes / ms:.2f} | {fill_ms / ms:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
