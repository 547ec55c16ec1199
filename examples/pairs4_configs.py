"""The 4-bit pair kernels at one token, config by config: each gate/up and each down launch config, beyond
the autotuner's list, timed as the pair's time with the other pass autotuned (L2 flushed before each call,
as the autotuner times), beside the autotuned pair and the packed bytes' time at copy bandwidth.

    python examples/pairs4_configs.py [--shape mixtral] [--fmt int4] [--top 8] [--block-n 4,8,16,32]
        [--block-k 512,1024,2048] [--warps 2,4,8] [--parts 1] [--passes up,down] [--depth 1,2]
        [--maxnreg 0,112,96]

One process, one GPU. Random weights of the shape quantized by groups of 32; one token routed to experts
0..K-1. Prints the `--top` fastest configs of each pass with microseconds per call (the pair's time,
the other pass autotuned): every tile, the down pass's also with SPLIT (one program per slot) and with I cut
into each of --parts (PARTS, pairs4.down_pairs4_kernel); --passes up (or down) sweeps that pass alone.
--depth: each tile with its words loaded that many chunks ahead (DEPTH, pairs4.packed_dot); --maxnreg: and
with each cap on a thread's registers (0: the compiler's choice; a lower cap can fit more programs on an SM).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from thunderep.bench.kernels import SHAPES, copy_bandwidth
from thunderep.kernels import decode, tuning
from thunderep.kernels.int4 import Int4Weight



def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral")
    parser.add_argument("--fmt", default="int4", choices=("int4", "mxfp4"))
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--block-n", type=_ints, default=(4, 8, 16, 32))
    parser.add_argument("--block-k", type=_ints, default=(512, 1024, 2048))
    parser.add_argument("--warps", type=_ints, default=(2, 4, 8))
    parser.add_argument("--parts", type=_ints, default=(1,))
    parser.add_argument("--passes", default="up,down", help="the passes to sweep: up, down or both")
    parser.add_argument("--depth", type=_ints, default=(1,), help="chunks of words loaded ahead (DEPTH)")
    parser.add_argument("--maxnreg", type=_ints, default=(0,), help="register caps a thread (0: none)")
    args = parser.parse_args()
    D, I, E, K = SHAPES[args.shape][:4]
    device = torch.device("cuda")
    torch.manual_seed(0)
    w_gu = Int4Weight.quantize((torch.randn(E, 2 * I, D, device=device) / D ** 0.5).bfloat16(), args.fmt)
    w_d = Int4Weight.quantize((torch.randn(E, D, I, device=device) / I ** 0.5).bfloat16(), args.fmt)
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    ids = torch.arange(K, device=device, dtype=torch.int32)
    weights = torch.full((K,), 1.0 / K, device=device)
    bandwidth = copy_bandwidth(device)  # read + write bytes a second of a copy: the kernel benchmark's HBM yardstick
    per_expert = {"up": w_gu.nbytes() / E, "down": w_d.nbytes() / E}

    def call():
        decode.pairs4_forward(x, w_gu, w_d, ids, weights, "silu", False)

    decode.PAIRS4_UP = decode.PAIRS4_DOWN = None
    tuned = tuning.timed_ms(call, 150.0, 25.0) * 1e3
    floor = K * sum(per_expert.values()) / bandwidth * 1e6
    print(f"{args.shape} {args.fmt}, one token, K {K}: autotuned pair {tuned:.1f} us; packed bytes at copy "
          f"bandwidth {floor:.1f} us ({floor / tuned:.0%}, the kernel benchmark's HBM fraction)")
    for which in args.passes.split(","):
        results = []
        splits = (False, True) if which == "down" else (False,)
        parts = args.parts if which == "down" else (1,)
        for bn, bk, warps, split, n, depth, regs in itertools.product(args.block_n, args.block_k, args.warps, splits,
                                                                      parts, args.depth, args.maxnreg):
            if bn * bk > 32768 or bn * bk < 32 * warps * 8:
                continue
            config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, **({"SPLIT": split} if split else {}),
                      **({"PARTS": n} if n > 1 else {}), **({"DEPTH": depth} if depth > 1 else {}),
                      **({"maxnreg": regs} if regs else {})}
            setattr(decode, "PAIRS4_UP" if which == "up" else "PAIRS4_DOWN", config)
            try:
                pair = tuning.timed_ms(call, 60.0, 10.0) * 1e3
            except Exception as exc:  # a config the compiler refuses (registers, shared memory)
                print(f"  {which} {config}: {type(exc).__name__}")
                continue
            results.append((pair, config))
        setattr(decode, "PAIRS4_UP" if which == "up" else "PAIRS4_DOWN", None)
        results.sort(key=lambda r: r[0])
        print(f"{which} pass, the other autotuned: the fastest {args.top} of {len(results)} configs (pair us)")
        for pair, config in results[:args.top]:
            print(f"  {pair:7.1f} us  {config}", flush=True)


if __name__ == "__main__":
    main()
