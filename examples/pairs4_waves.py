"""The 4-bit gate/up pass alone at one token, over several intermediate sizes I: whether its bandwidth
depends on how its programs fill the GPU's waves (a last, partial wave of programs leaves SMs idle or with few
loads in flight), and what deeper loads (DEPTH) or a register cap (more programs an SM) change.

    python examples/pairs4_waves.py [--fmt mxfp4] [--D 4096] [--K 2] [--I 12672,14336,16896]
        [--configs 8x512x2,8x512x2:d2,8x512x2:r112,8x512x2:h1]

One process, one GPU. Random weights [K, 2I, D] quantized by groups of 32, one token routed to experts 0..K-1;
each launch config pinned (BLOCK_N x BLOCK_K x warps, ":d2" loads two chunks ahead, ":rN" caps a thread's
registers at N, ":hN" runs HALF N: ":h1" one word a float16 chain (MXFP4: the byte lookup), ":h3" two (MXFP4:
the FP8 conversion), half4.py). Prints per config and I: the programs, the registers a thread, the programs an
SM holds (registers, warps and the 32-block limit; shared memory not counted), the waves (programs over the GPU's
resident programs), microseconds per call (L2 flushed before each, as the autotuner times), the packed bytes
read and their fraction of copy bandwidth. At Mixtral's D = 4096, K = 2 and 8 rows a program, I = 12672 is 3
waves of 8 programs an SM on 132 SMs, 14336 (Mixtral's) 3.39 and 16896 4.
"""

from __future__ import annotations

import argparse

import torch

from thunderep.bench.kernels import copy_bandwidth
from thunderep.kernels import decode, paths, tiles, tuning
from thunderep.kernels.int4 import Int4Weight
from thunderep.kernels.tuning import cdiv


def _config(text: str) -> dict:
    """'8x512x2:d2:r112:h1' as a pinned config (HALF, where given, is the kernel's, not the config's)."""
    tile, *flags = text.split(":")
    bn, bk, warps = (int(v) for v in tile.split("x"))
    config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
    for flag in flags:
        config[{"d": "DEPTH", "r": "maxnreg", "h": "HALF"}[flag[0]]] = int(flag[1:])
    return config


def _resident(kernel, warps: int) -> int:
    """Programs an SM holds by registers, warps and the 32-block limit (65536 registers, 64 warps)."""
    regs = max(kernel.n_regs, 1) * 32 * warps
    return min(32, 64 // warps, 65536 // regs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fmt", default="mxfp4", choices=("int4", "mxfp4"))
    parser.add_argument("--D", type=int, default=4096)
    parser.add_argument("--K", type=int, default=2)
    parser.add_argument("--I", default="12672,14336,16896")
    parser.add_argument("--configs", default="8x512x2,8x512x2:d2,8x512x2:r112")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    D, K = args.D, args.K
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = copy_bandwidth(device)
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    ids = torch.arange(K, device=device, dtype=torch.int32)
    half = paths.half_mode(device, args.fmt)
    print(f"{args.fmt} gate/up pass, one token, D {D}, K {K}, {sms} SMs; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| config | I | programs | registers | programs an SM | waves | us | MB read | fraction of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for I in (int(v) for v in args.I.split(",")):
        w_gu = Int4Weight.quantize((torch.randn(K, 2 * I, D, device=device) / D ** 0.5).bfloat16(), args.fmt)
        h = x.new_empty(K, I)
        h_pairs = torch.empty(h.shape, dtype=torch.float16, device=device) if half else None
        buffers = decode.down4_buffers(x, 1, K, D)
        launch = decode.up4_args(x, w_gu, ids, h, h_pairs, buffers, False, half, "silu", False)
        for text in args.configs.split(","):
            config = _config(text)
            kernel_args = {**launch, "HALF": config.pop("HALF", launch["HALF"])}

            def call():
                return decode.launch_pinned(tiles.UP_PAIRS4_PLAIN, config, lambda meta: (K, cdiv(I, meta["BLOCK_N"])),
                                            **kernel_args)

            kernel = call()
            us = tuning.timed_ms(call, 60.0, 10.0) * 1e3
            programs = K * cdiv(I, config["BLOCK_N"])
            resident = _resident(kernel, config["num_warps"])
            read = w_gu.nbytes()
            print(f"| {text} | {I} | {programs} | {kernel.n_regs} | {resident} | {programs / (resident * sms):.2f} | "
                  f"{us:.1f} | {read / 1e6:.1f} | {read / bandwidth / (us * 1e-6):.1%} |", flush=True)


if __name__ == "__main__":
    main()
