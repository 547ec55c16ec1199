"""A rank's share of a small batch under expert parallelism (latency mode, 2 to 16 tokens): the pair
kernels, which skip the other ranks' pairs, against the two routes the share takes otherwise.

    python examples/ep_share_paths.py [--shapes qwen3,mixtral] [--ranks 2,4] [--tokens 2,4,8,16]

One GPU stands in for rank 0 of R: its E / R experts (bf16), and routings drawn uniformly over all E
experts, the other ranks' pairs marked -1 (`Placement.local_slots`). Routes:
- pairs: `moe_mlp_pairs` on all T * K pairs; a pair marked -1 reads no weights;
- every pair, masked: what a capturable decode step runs (thunderep/hf/experts.py): all T * K pairs
  through `routed_moe_mlp` with one expert each, the other ranks' as local expert 0, then masked;
- local pairs, sorted: what every other call runs: the local pairs found with `nonzero` (a host sync),
  through `routed_moe_mlp`, put back in place. Eager only (the sync cannot be captured).
Each is timed eagerly with the benchmark's timer (median, L2 flushed clean before each call) over the
benchmark's four routing sets, and the first two also in a CUDA graph of the four calls (time per
call). The ratios compare what `pairs_win` compares: for a capturable decode step the masked route
against the pairs, both in graphs; for any other call the sorted local pairs against the pairs, eager.
Last, what `pairs_win` itself chooses for a capturable step at that shape and T, from scratch (timed
as graph replays on the first routing set and three random ones), beside which route the graph
times above found faster.
"""

from __future__ import annotations

import argparse
import sys

import torch

from thunderep.balance.placement import Placement
from thunderep.kernels.graphs import graph_steps
from thunderep.bench import kernels as B
from thunderep.cli.bench import parse_shapes
from thunderep.kernels import paths
from thunderep.kernels.ops import moe_mlp_pairs, routed_moe_mlp


def _routes(wgu, wd, K):
    def pairs(x, local, w):
        return moe_mlp_pairs(x, wgu, wd, local, w, "silu", False)

    def every_pair(x, local, w):
        T, D = x.shape
        here = local.reshape(-1, 1) >= 0
        y = routed_moe_mlp(x.repeat_interleave(K, dim=0), wgu, wd, local.reshape(-1, 1).clamp(min=0))
        return torch.where(here, y * w.reshape(-1, 1), 0).view(T, K, D).float().sum(dim=1)

    def local_sorted(x, local, w):
        T, D = x.shape
        pairs_M, slots_M = Placement.sorted_local_pairs(local)
        y = routed_moe_mlp(x[pairs_M // K], wgu, wd, slots_M.view(-1, 1)) * w.reshape(-1, 1)[pairs_M]
        return y.new_zeros(T * K, D).index_copy(0, pairs_M, y).view(T, K, D).float().sum(dim=1)

    return {"pairs": pairs, "every pair, masked": every_pair, "local pairs, sorted": local_sorted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,mixtral")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--tokens", default="2,4,8,16")
    args = ap.parse_args(argv)
    shapes = parse_shapes(ap, args.shapes)
    if not torch.cuda.is_available():
        print("ep_share_paths needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; us per call: eager / CUDA graph")
    for name in shapes:
        D, I, E, K = B.SHAPES[name]
        for R in map(int, args.ranks.split(",")):
            S = E // R
            gen = torch.Generator(device=device).manual_seed(R)
            wgu = torch.randn(S, 2 * I, D, device=device, dtype=torch.bfloat16, generator=gen) * D**-0.5
            wd = torch.randn(S, D, I, device=device, dtype=torch.bfloat16, generator=gen) * I**-0.5
            routes = _routes(wgu, wd, K)
            for T in map(int, args.tokens.split(",")):
                sets = []
                for _ in range(B.ROTATE):
                    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=gen)
                    ids = torch.rand(T, E, device=device, generator=gen).topk(K, dim=-1).indices
                    local = torch.where(ids < S, ids, -1)  # rank 0 holds experts 0 .. S - 1
                    w = torch.softmax(torch.randn(T, K, device=device, generator=gen), -1).to(torch.bfloat16)
                    sets.append((x, local, w))
                want = routes["local pairs, sorted"](*sets[0]).float()
                times = {}
                with torch.no_grad():
                    for route, fn in routes.items():
                        got = fn(*sets[0]).float()
                        err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
                        eager = sum(B._bench(lambda s=s: fn(*s), 40.0, 10.0) for s in sets) / len(sets) * 1e3
                        graph = B.graph_ms(fn, sets) * 1e3 if route != "local pairs, sorted" else float("nan")
                        times[route] = (eager, graph, err)
                    # What `pairs_win` chooses for a capturable step (timed as graph replays), from scratch
                    x0, local0, w0 = sets[0]
                    paths._PATHS.clear()
                    with graph_steps():
                        won = paths.pairs_win(x0, wgu, wd, local0, w0, "silu", False,
                                          lambda ids: routes["every pair, masked"](x0, ids, w0), moe_mlp_pairs, E,
                                              "every pair")
                pairs_eager, pairs_graph, _ = times["pairs"]
                faster = "pairs" if pairs_graph < times["every pair, masked"][1] else "masked"
                chose = f"; step choice {'pairs' if won else 'masked'} (graph times: {faster} faster)"
                print(f"{name} R={R} (local {S} of {E}) T={T}: "
                      + "; ".join(f"{r} {e:.1f} / {g:.1f} (rel err {x:.1e})" for r, (e, g, x) in times.items())
                      + f"; decode step (graphs): masked / pairs {times['every pair, masked'][1] / pairs_graph:.2f}x"
                      f"; other calls (eager): sorted / pairs {times['local pairs, sorted'][0] / pairs_eager:.2f}x"
                      + chose, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
