"""What a CUDA-graph replay costs besides its kernels: the decode step at T = 1 captured in graphs of 1, 2,
4 and 8 rounds of the kernel benchmark's four routings, beside a copy of the same bytes and a one-element
add (a kernel that does next to nothing).

    python examples/graph_cost.py [--shapes qwen3,deepseek,mixtral]

For each: the replay time by rounds, the time per call (replay / calls), and the marginal time per call,
(8 rounds - 1 round) / the calls between them: what one more call adds to a graph, the replay's own
fixed cost left out. The marginal HBM fraction is the step's expert-weight bytes over that time, over
the copy bandwidth of a 2 GiB copy (the benchmark's definition). Timed as the benchmark's graph rows
(`bench._bench`: median, L2 flushed clean before each replay). Rounds past the first re-run the same
routings four calls apart.
"""

from __future__ import annotations

import argparse
import sys

import torch

from thunderep.bench import kernels as B
from thunderep.cli.bench import parse_shapes
from thunderep.kernels.ops import routed_moe_mlp

ROUNDS = (1, 2, 4, 8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,deepseek,mixtral")
    args = ap.parse_args(argv)
    shapes = parse_shapes(ap, args.shapes)
    if not torch.cuda.is_available():
        print("graph_cost needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bw = B.copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    for name in shapes:
        D, I, E, K = B.SHAPES[name]
        gen = torch.Generator(device=device).manual_seed(0)
        wgu = torch.randn(E, 2 * I, D, device=device, dtype=torch.bfloat16, generator=gen) * D**-0.5
        wd = torch.randn(E, D, I, device=device, dtype=torch.bfloat16, generator=gen) * I**-0.5
        sets = []
        for _ in range(B.ROTATE):
            x = torch.randn(1, D, device=device, dtype=torch.bfloat16, generator=gen)
            ids = torch.rand(1, E, device=device, generator=gen).topk(K, dim=-1).indices
            w = torch.softmax(torch.randn(1, K, device=device, generator=gen), -1).to(torch.bfloat16)
            sets.append((x, ids, w))
        n_bytes = K * 3 * D * I * 2
        one = torch.zeros(1, device=device)
        fns = {"thunderep": lambda x, ids, w: routed_moe_mlp(x, wgu, wd, ids, w),
               "copy": B._copy_of(n_bytes, device),
               "one-element add": lambda *_: one.add_(1)}
        for impl, fn in fns.items():
            replay = {r: B.graph_ms(fn, sets, r) * r * len(sets) * 1e3 for r in ROUNDS}  # us per replay
            marginal = (replay[ROUNDS[-1]] - replay[1]) / ((ROUNDS[-1] - 1) * len(sets))
            frac = "" if impl == "one-element add" else f"; marginal HBM {n_bytes / (marginal * 1e-6) / bw:.1%}"
            print(f"{name} {impl}: replay us by rounds " + ", ".join(f"{r}: {t:.2f}" for r, t in replay.items())
                  + "; per call " + ", ".join(f"{r}: {t / (r * len(sets)):.2f}" for r, t in replay.items())
                  + f"; marginal {marginal:.2f} us{frac}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
