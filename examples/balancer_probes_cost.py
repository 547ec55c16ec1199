"""Host time of one layer's balancer per step on one rank, each rank's own probe against every rank's probe
replicated (`BalancerConfig.probes` "own" / "all"), side by side in one process.

    python examples/balancer_probes_cost.py [--experts 256] [--steps 400]

For R = 2, 4 and 8 ranks, R `LayerBalancer`s see the same drifting Poisson counts; rank 0's host work is
timed: "own" = `record(counts_E)` in the forward plus `step()` at the boundary; "all" = `words()` plus
`step()`, which runs the R probes. Prints microseconds per step, and of it the forward's and the step
boundary's (medians over the steps, one thread), and checks that both ways make the same decisions."""

from __future__ import annotations

import argparse
import time

import torch

from thunderep.balance import BalancerConfig, plan_placement
from thunderep.balance.layer_balancer import LayerBalancer


def run(R: int, E: int, steps: int, probes: str) -> tuple[list[tuple[float, float]], list]:
    placement = plan_placement(torch.ones(E), R, E // R)
    config = BalancerConfig(measure=False, probes=probes)
    ranks = [LayerBalancer(placement, config) for _ in range(R)]
    if probes == "all":
        for r, b in enumerate(ranks):
            b.replicate(r)
    gen = torch.Generator().manual_seed(0)
    times, decisions = [], []
    for t in range(steps):
        rate = torch.ones(E) * 40 + 30 * torch.sin(torch.arange(E) / 7 + t / 50)
        counts_RE = torch.poisson(rate.expand(R, E), generator=gen).to(torch.int64)
        load_R = counts_RE.sum(dim=1).tolist()
        started = time.perf_counter()
        mine = ranks[0].words() if probes == "all" else ranks[0].record(counts_RE[0])
        forward = time.perf_counter() - started  # rank 0's forward share; the other ranks' words untimed
        others = [b.words() if probes == "all" else b.record(c) for b, c in zip(ranks[1:], counts_RE[1:])]
        rows_RW = torch.stack([mine] + others)
        started = time.perf_counter()
        ranks[0].received(rows_RW, load_R, counts_RE)
        decision = ranks[0].step()
        times.append((forward, time.perf_counter() - started))
        for b in ranks[1:]:
            b.received(rows_RW, load_R, counts_RE)
            b.step()
        decisions.append((decision.state, decision.alarm, decision.traded, decision.migrated))
    return times, decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.experts} experts, {args.steps} steps, torch {torch.__version__}, one thread")
    for R in (2, 4, 8):
        (own, d_own), (rep, d_rep) = run(R, args.experts, args.steps, "own"), run(R, args.experts, args.steps, "all")
        assert d_own == d_rep, "replicated probes must decide as each rank's own"
        def median(times, part):
            values = sorted(t[part] if part is not None else sum(t) for t in times)
            return values[len(values) // 2] * 1e6

        negotiations = sum(d[0] == "negotiate" for d in d_own)
        print(f"R={R}: own {median(own, None):.1f} us per step (forward {median(own, 0):.1f}, boundary "
              f"{median(own, 1):.1f}); all {median(rep, None):.1f} us (forward {median(rep, 0):.1f}, boundary "
              f"{median(rep, 1):.1f}); same decisions ({negotiations} negotiations)")


if __name__ == "__main__":
    main()
