"""The hot set's re-choice at decode with and without its counting test (`TierConfig.confidence`).

    python examples/rechoice_noise.py [--calls 600]

One rank's layer of 128 slots, 32 hot, one token a call routed top-8: uniformly, and by Zipf weights
(exponent 0.8, in a random slot order). Host expert 0.26 ms, a slot's copy 0.2 ms (what one H200 measured
at Qwen3-30B-A3B's expert shape). Only the rule runs (`ExpertTiers._observe` and `rechoose`, no compute);
printed per routing and confidence: the slots moved into the hot set, and the share of rows served hot
after the first 100 calls."""

from __future__ import annotations

import argparse

import torch

from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig


def moves(confidence: float, weights_E: torch.Tensor, calls: int = 600) -> tuple[int, float]:
    """(slots moved into the hot set, hot share of the rows after the first 100 calls) over `calls` calls."""
    E, K, H = weights_E.numel(), 8, 32
    host = {"w": torch.zeros(E, 2, 2)}
    slot_bytes = 2 * 2 * 4
    costs = OffloadCosts(host_flops=1e12, device_flops=4e14, h2d_Bps=slot_bytes / 2e-4, host_call_s=0.26e-3,
                         host_row_s=4e-6)
    tiers = ExpertTiers(host, H, torch.device("cpu"), None, costs, Staging(host, torch.device("cpu")),
                        TierConfig(cold_path="host", confidence=confidence))
    gen = torch.Generator().manual_seed(0)
    hot = rows = 0
    for call in range(calls):
        counts = torch.bincount(torch.multinomial(weights_E, K, generator=gen), minlength=E)
        if call >= 100:
            hot, rows = hot + int(counts[tiers.hot_slots].sum()), rows + K
        tiers._observe(counts)
        tiers.rechoose(4096)
    return tiers.stats.bytes_promoted // tiers.slot_bytes, hot / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=600, help="layer calls (default 600)")
    args = parser.parse_args()
    E = 128
    zipf = (1.0 / torch.arange(1, E + 1).float() ** 0.8)[torch.randperm(E, generator=torch.Generator().manual_seed(1))]
    print("| routing | confidence | slots moved | hot share |\n|---|---|---|---|")
    for name, weights in (("uniform", torch.ones(E)), ("Zipf 0.8", zipf)):
        for confidence in (0.0, 2.0):
            moved, share = moves(confidence, weights, args.calls)
            print(f"| {name} | {confidence:g} | {moved} | {share:.0%} |")


if __name__ == "__main__":
    main()
