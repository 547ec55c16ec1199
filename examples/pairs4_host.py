"""The one-token 4-bit pair end to end three ways, with h's float16-pair copy on and off (`decode.PAIRED_H`):
the device's time (`tuning.timed_ms`, L2 flushed before each call, as the kernel benchmark times it), the
host's time to launch one call, and calls back to back (host and device together, no flush).

    python examples/pairs4_host.py [--shape mixtral] [--formats mxfp4,int4]

One process, one GPU. Random weights, one token routed to experts 0..K-1, every kernel autotuned first. Each
setting runs twice, alternating, so drift shows. Also lists the CUDA kernels one call runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from thunderep.bench.kernels import SHAPES
from thunderep.kernels import decode, tuning
from thunderep.kernels.int4 import Int4Weight


def _host_us(fn, calls: int = 50) -> float:
    """Median microseconds the host spends in one `fn()` (the device not waited for)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _back_to_back_us(fn, calls: int = 200) -> float:
    """Microseconds per call of `calls` calls in a row, host and device together."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _kernels(fn) -> list:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:40] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    parser.add_argument("--formats", default="mxfp4,int4")
    args = parser.parse_args()
    device = torch.device("cuda")
    D, I, E, K = SHAPES[args.shape][:4]
    torch.manual_seed(0)
    w_gu = (torch.randn(E, 2 * I, D, device=device) / D ** 0.5).bfloat16()
    w_d = (torch.randn(E, D, I, device=device) / I ** 0.5).bfloat16()
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    ids = torch.arange(K, device=device, dtype=torch.int32)
    weights = torch.full((K,), 1.0 / K, device=device)
    print(f"{args.shape}, one token, K {K}")
    print("| format | h in pairs | device us (timed_ms) | host us a call | back to back us a call | kernels |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        q_gu, q_d = Int4Weight.quantize(w_gu, fmt), Int4Weight.quantize(w_d, fmt)
        for paired in (True, False, True, False):
            decode.PAIRED_H = paired

            def fn():
                return decode.pairs4_forward(x, q_gu, q_d, ids, weights, "silu", False)

            fn()
            torch.cuda.synchronize()
            device_us = tuning.timed_ms(fn, 150.0, 25.0) * 1e3
            print(f"| {fmt} | {paired} | {device_us:.1f} | {_host_us(fn):.1f} | {_back_to_back_us(fn):.1f} | "
                  f"{', '.join(_kernels(fn))} |", flush=True)


if __name__ == "__main__":
    main()
