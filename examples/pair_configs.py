"""The decode pair kernels at T = 1 as a pair: graph-replay time of every (gate/up config, down config)
combination, beside the autotuned choice. The autotuner times each kernel alone, but under programmatic
dependent launch the two overlap: the down pass's programs start in the room the gate/up programs
leave. This measures whether the fastest kernels alone make the fastest pair.

    python examples/pair_configs.py qwen3 [--pdl 1] [--top 12] [--down-kind any|all_slots|split|loop]

One process, one GPU. Weights are random bf16 of the shape's size; up to eight routings of one token
rotate inside each captured graph, on disjoint sets of experts (so L2 holds no expert's weights from
the call before; as many routings as the shape has disjoint sets, four for Mixtral). Prints the
autotuned pair's time and configs, then the `--top` fastest fixed pairs, then the fastest fixed pair
for each gate/up config. Times: microseconds per call, median replay time as the benchmark takes it.
"""

from __future__ import annotations

import argparse
import os

import torch

from thunderep.kernels import paths, tiles, tuning
from thunderep.bench.kernels import SHAPES, graph_ms
from thunderep.kernels.ops import routed_moe_mlp

ROUTINGS = 8


def graph_us(x, wgu, wd, routings, w) -> float:
    """Microseconds per call of the pair kernels, one call per routing captured in one CUDA graph and
    replayed, timed as the kernel benchmark's fwd-graph rows (`bench.graph_ms`)."""
    return graph_ms(lambda x_, ids, w_: routed_moe_mlp(x_, wgu, wd, ids, w_), [(x, ids, w) for ids in routings]) * 1e3


def _name(cfg) -> str:
    return f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"


def _kind(cfg) -> str:
    """A down config's way of summing over the slots: all_slots, split or loop."""
    return "all_slots" if cfg.kwargs.get("ALL_SLOTS") else "split" if cfg.kwargs["SPLIT"] else "loop"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--pdl", choices=("0", "1"), default="1", help="THUNDEREP_PDL (1: on where the GPU has it)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--down-kind", choices=("any", "all_slots", "split", "loop"), default="any",
                    help="time only the down configs of this kind (fewer pairs)")
    args = ap.parse_args(argv)
    os.environ["THUNDEREP_PDL"] = args.pdl
    os.environ["THUNDEREP_PAIRS_MAX_TOKENS"] = "1"
    D, I, E, K = SHAPES[args.shape]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    wgu = torch.randn(E, 2 * I, D, device=device, dtype=torch.bfloat16, generator=gen) / D ** 0.5
    wd = torch.randn(E, D, I, device=device, dtype=torch.bfloat16, generator=gen) / I ** 0.5
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16, generator=gen)
    cpu_gen = torch.Generator().manual_seed(0)
    order = torch.randperm(E, generator=cpu_gen)  # disjoint expert sets: no routing re-reads another's weights
    routings = [order[r * K:(r + 1) * K].view(1, K).to(device) for r in range(min(ROUTINGS, E // K))]
    w = torch.softmax(torch.randn(1, K, device=device, generator=gen), -1).to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, {args.shape} (D={D}, I={I}, E={E}, K={K}), T = 1, "
          f"PDL {'on' if paths.pdl_applies(device) else 'off'}", flush=True)

    os.environ.pop("THUNDEREP_TRITON_AUTOTUNE", None)
    tuned_us = graph_us(x, wgu, wd, routings, w)
    chosen = {name: list(keys.values()) for name, keys in tuning.kernel_configs().items()
              if name in ("up_pairs", "down_pairs") and keys}
    print(f"autotuned: {tuned_us:.1f} us; configs {chosen}", flush=True)

    os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "0"  # fixed configs: pairs' defaults, overridden below
    results = []
    downs = [cfg for cfg in tiles.DOWN_PAIR_CONFIGS if args.down_kind in ("any", _kind(cfg))]
    for up in tiles.UP_PAIR_CONFIGS:
        for down in downs:
            tiles.DEFAULT_UP_PAIR, tiles.DEFAULT_DOWN_PAIR = up, down
            try:
                us = graph_us(x, wgu, wd, routings, w)
            except Exception as exc:  # noqa: BLE001 - a config this GPU cannot run: reported, skipped
                print(f"skipped up {_name(up)} / down {_name(down)}: {exc!r}"[:200], flush=True)
                continue
            results.append((us, _name(up), _name(down)))
    results.sort()
    print(f"\nfastest {args.top} of {len(results)} fixed pairs (us; autotuned {tuned_us:.1f}):")
    for us, up, down in results[:args.top]:
        print(f"  {us:6.1f}  up {up} | down {down}")
    print("\nfastest pair per gate/up config:")
    for up in dict.fromkeys(r[1] for r in results):
        us, _, down = min(r for r in results if r[1] == up)
        print(f"  {us:6.1f}  up {up} | down {down}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
