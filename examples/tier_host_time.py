"""Host time of the expert tiers' bookkeeping per layer call (`ExpertTiers.sorted`), the experts stubbed.

    python examples/tier_host_time.py [--slots 128] [--rows 8] [--calls 3000] [--path sorted|partial] [--pairs]

One rank's layer of --slots local slots, a quarter hot, decode-like calls: --rows rows a call, each on a
different slot, drawn at random. The experts function and the host function return their rows as they
are, so what is timed is the tiers' own work per call: the counting, the path choice, splitting the rows
per slot, gathering the hot rows, the re-choice every 32 calls. With --path partial, the same calls as one
token's --rows pairs through `ExpertTiers.partial` (a decode step from its token row: the weighting and the
sum per token included); --pairs: the hot share through a stand-in for the decode pair kernels (zeros, as
where ThunderEP's kernels run: the hot slots' two products and their per-pair adds are then not the
tiers'). Prints microseconds per call (the mean over the calls after 100 untimed ones)."""

from __future__ import annotations

import argparse
import time

import torch

from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=128, help="local slots (default 128)")
    parser.add_argument("--rows", type=int, default=8, help="rows a call, on as many slots (default 8)")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls (default 3000)")
    parser.add_argument("--path", choices=("sorted", "partial"), default="sorted")
    parser.add_argument("--pairs", action="store_true", help="the hot share through stand-in pair kernels")
    args = parser.parse_args()
    S, D = args.slots, 64
    host = {"gate_up_proj": torch.zeros(S, 64, D), "down_proj": torch.zeros(S, D, 32)}
    costs = OffloadCosts(host_flops=1e11, device_flops=1e12, h2d_Bps=1e10, host_call_s=2e-4, host_row_s=4e-6)
    tiers = ExpertTiers(host, S // 4, torch.device("cpu"), lambda weights, x, slot_M: x.clone(), costs,
                        Staging(host, torch.device("cpu")), TierConfig(cold_path="host"),
                        host_fn=lambda h, slots, x, counts, out=None: x.clone(),
                        pairs=(lambda hot, x_TD, entries_TK, w_TK: x_TD.new_zeros(x_TD.shape)) if args.pairs else None)
    gen = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(args.calls + 100):
        counts = torch.zeros(S, dtype=torch.int64)
        counts[torch.randperm(S, generator=gen)[:args.rows]] = 1
        calls.append(counts)
    x = torch.randn(args.rows, D)
    if args.path == "partial":  # one token whose pairs are the call's slots
        x_1D, w_1K = torch.randn(1, D), torch.rand(1, args.rows)
        calls = [counts.nonzero().reshape(1, -1) for counts in calls]

        def call(ids_1K):
            tiers.partial(x_1D, ids_1K, w_1K)
    else:
        def call(counts):
            tiers.sorted(x, counts)
    for one in calls[:100]:
        call(one)
    started = time.perf_counter()
    for one in calls[100:]:
        call(one)
    seconds = (time.perf_counter() - started) / args.calls
    print(f"{args.path}: {S} slots, {S // 4} hot, {args.rows} rows a call: {seconds * 1e6:.1f} us of host time per layer call "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
