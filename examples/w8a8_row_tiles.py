"""W8A8 FP8 experts at fixed row tiles: the layer's time and the up kernel's registers and spills.

    python examples/w8a8_row_tiles.py [--tiles 128,64,64,8,3:128,128,64,8,3] [--experts 64] [--tokens 4096]

DeepSeek-V3's D = 7168 and I = 2048 (fewer experts, so the weights fit beside their quantized copies),
top-8 uniform routing, `ops.routed_moe_mlp` on W8A8 `Fp8Weight`s with autotuning off and the row-tile
config of every size class pinned to each tile in turn (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages;
W8A8 doubles BLOCK_K, tuning.fit_scale_blocks), in three scale layouts:
- row: one weight scale per row (`--experts-dtype fp8-w8a8` on a bfloat16 checkpoint);
- block: 128 x 128 scale blocks (DeepSeek-V3's FP8 checkpoints, as `thunderep bench kernels` makes them);
- block-rows: the same block scales repeated for each row (how `from_pretrained` holds a checkpoint's
  blocks: gate and up rows never share a scale).
The up kernel's registers and spilled bytes come from the compiled kernels (n_regs, n_spills).
"""

from __future__ import annotations

import argparse
import os

os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "0"
os.environ["THUNDEREP_PAIRS_MAX_TOKENS"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

from thunderep.kernels import moe_triton as K  # noqa: E402
from thunderep.kernels import ops, tiles  # noqa: E402
from thunderep.kernels.fp8 import Fp8Weight  # noqa: E402


def _by_rows(fw: Fp8Weight) -> Fp8Weight:
    scale = fw.scale.repeat_interleave(fw.block[0], dim=1)[:, :fw.q.shape[1]].contiguous()
    return Fp8Weight(fw.q, scale, (1, fw.block[1]), fw.dtype, True)


def _compiled(fn):
    for cache in fn.device_caches.values():
        for kernel in (cache[0] if isinstance(cache, tuple) else cache).values():
            kernel._init_handles()
            yield kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="128,64,64,8,3:128,128,64,8,3")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    D, I, E, k, T = 7168, 2048, args.experts, 8, args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16, generator=g) * D**-0.5
    w_d = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16, generator=g) * I**-0.5
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1).to(torch.bfloat16)
    weights = {name: (Fp8Weight.quantize(w_gu, block, w8a8=True), Fp8Weight.quantize(w_d, block, w8a8=True))
               for name, block in (("row", None), ("block", (128, 128)))}
    weights["block-rows"] = tuple(_by_rows(fw) for fw in weights["block"])
    del w_gu, w_d
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"D={D} I={I} E={E} top-{k} T={T}")
    for tile in args.tiles.split(":"):
        config = tiles.row_cfg(*map(int, tile.split(",")))
        for m_class in tiles.DEFAULT_ROW:
            tiles.DEFAULT_ROW[m_class] = config
        for name, (wg, wd) in weights.items():
            K.up_kernel.device_caches.clear()
            with torch.no_grad():
                def layer():
                    return ops.routed_moe_mlp(x, wg, wd, ids, w)
                layer()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(layer, warmup=10, rep=100)
            ups = [f"regs {kern.n_regs} spills {kern.n_spills}" for kern in _compiled(K.up_kernel)]
            print(f"tile {tile} {name:10s}: {ms:.3f} ms; up kernel {', '.join(ups)}", flush=True)


if __name__ == "__main__":
    main()
