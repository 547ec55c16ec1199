"""Does an OpenMP team owned by another thread slow this thread's host products? (no GPU needed)

    python examples/openmp_teams_probe.py [--large]

torch runs its host products on OpenMP (GNU libgomp in its Linux wheels). Each thread that runs a parallel
product owns a team of its own, for as long as it lives; once libgomp has more threads than CPUs, its
threads spin only briefly before they sleep (`GOMP_SPINCOUNT`), and every parallel region waits for them to
wake. This times this thread's products, median of 5 passes, in three states: alone; beside an idle thread
that has run one parallel product (owning a team); after torch's inter-op threads ran 64 forked TorchScript
jobs (they may own teams too). With the process's thread count.

    default   a loop of 200 small float32 products with an activation ([32, 512] x [512, 256]): many
              parallel regions, each paying a wake-up where the spin is short
    --large   one [2048, 2048] x [2048, 768] bfloat16 product a pass: one region, which does not show it
              (seconds a product on a CPU without 16-bit matrix instructions)
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import psutil
import torch
import torch.nn.functional as F


@torch.jit.script
def _job(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="one large bfloat16 product instead of small ones")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.large:
        x, w, calls = torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(2048, 768, dtype=torch.bfloat16), 1
    else:
        x, w, calls = torch.randn(32, 512), torch.randn(512, 256), 200
    big = torch.randn(2048, x.shape[1], dtype=x.dtype)

    def step():
        return torch.mm(x, w) if args.large else F.silu(torch.mm(x, w)) * 2

    proc = psutil.Process()

    def bench(state: str) -> None:
        for _ in range(5):
            torch.mm(x, w)
        passes = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                step()
            passes.append((time.perf_counter() - started) / calls)
        print(f"{state:55s} {statistics.median(passes) * 1e3:8.3f} ms a product (median of 5), "
              f"threads {proc.num_threads()}", flush=True)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.get_num_interop_threads()} "
          f"inter-op threads, {psutil.cpu_count()} CPUs", flush=True)
    bench("alone")
    started, stop = threading.Event(), threading.Event()

    def owner() -> None:
        torch.mm(big, w)  # one parallel product: this thread now owns a team
        started.set()
        stop.wait()

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    started.wait()
    bench("beside an idle thread that owns a team")
    for future in [torch.jit.fork(_job, big, w) for _ in range(64)]:
        torch.jit.wait(future)
    bench("after 64 forked jobs on the inter-op threads")
    stop.set()
    thread.join()


if __name__ == "__main__":
    main()
