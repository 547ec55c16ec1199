"""torch.profiler tables of one rank's local compute in ep mode, the fused path against the old one
(`thunderep.bench.local_compute`'s `before` and `fused`), at the Qwen3 shape.

    THUNDEREP_TRITON_AUTOTUNE=0 python examples/local_compute_profile.py [--ranks 2] [--tokens 1,4096]

Needs a CUDA GPU. For each token count: the median milliseconds of the whole fused call and of its parts
(the arrival's slot sort, the experts' summed call, the experts' sorted call on expanded rows, the old
path's pre-sum), then for the fused and the old path the operators of 10 calls by host time and by
device time."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from thunderep.bench import local_compute as lc
from thunderep.config import ExpertsConfig
from thunderep.moe.ep import LocalExperts
from thunderep.moe.experts import FusedExperts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks R (default 2)")
    parser.add_argument("--tokens", default="1,4096", help="tokens per rank, comma-separated (default 1,4096)")
    args = parser.parse_args()
    device, (D, I, E, K), R = torch.device("cuda"), lc.SHAPES["qwen3"], args.ranks
    torch.manual_seed(0)
    experts = FusedExperts(ExpertsConfig(E // R, D, I), device=device, dtype=torch.bfloat16)
    local = LocalExperts(experts.compute_sorted, summed=experts.compute_summed)
    for T in (int(t) for t in args.tokens.split(",")):
        arr = lc.arrival(D, E, K, R, T, device, torch.bfloat16, seed=1000 * R + T)
        transport = lc.LocalTransport()
        arrived = transport.dispatch_async(arr.x_MD, arr.meta, expand=False)
        expanded = transport.dispatch_async(arr.x_MD, arr.meta)
        x_QD = expanded.wait()
        x_MD = arrived.wait()
        rec = arrived.received

        def fused():
            x = arrived.wait()
            y_MD = local.summed(x, arr.counts_S, rec.pairs_Q, rec.weights_MK, K, rec.positions_N)
            return transport.combine_async(y_MD, rec, summed=True)

        def before():
            return local.sorted(arr.pairs_QD[arr.order_Q], arr.counts_S)[arr.inverse_Q]

        parts = {"fused": fused, "before": before, "slot sort (arrival)": arrived.wait,
                 "summed experts": lambda: local.summed(x_MD, arr.counts_S, rec.pairs_Q, rec.weights_MK, K,
                                                         rec.positions_N),
                 "sorted experts": lambda: local.sorted(x_QD, arr.counts_S),
                 "pre-sum (expanded path)": lambda: transport.combine_async(x_QD, expanded.received)}
        with torch.no_grad():
            for name, fn in parts.items():
                print(f"R {R} T {T} {name}: {do_bench(fn, warmup=25, rep=100, return_mode='median'):.4f} ms")
            for name in ("fused", "before"):
                for _ in range(5):
                    parts[name]()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        parts[name]()
                    torch.cuda.synchronize()
                print(f"==== R {R} T {T} {name} (10 calls)")
                table = prof.key_averages()
                print(table.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
                print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
