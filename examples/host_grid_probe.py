"""Host time per call of `routed_moe_mlp` with every Triton launch stubbed out (grids still evaluated):
ThunderEP's own grid arithmetic (`tuning.cdiv`, `tuning.next_power_of_2`) against Triton's
`triton.cdiv` / `triton.next_power_of_2`, alternating in one process. Runs on a CPU; the launches being
stubs, it measures only the host's Python and torch work around them.

    python examples/host_grid_probe.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton

from thunderep.kernels import grouped_gemm as G
from thunderep.kernels import ops, passes, tuning

PLAIN = (tuning.cdiv, tuning.next_power_of_2)
TRITONS = (triton.cdiv, triton.next_power_of_2)


def stub_launches() -> None:
    def launch(autotuner, plain, default, grid, device, **args):
        if callable(grid):
            grid({**default.kwargs, **args})

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    ops._launch = tuning.launch = launch
    for name in dir(passes):
        if name.endswith("_kernel"):
            setattr(passes, name, Kernel())


def make_case(T: int, D: int, I: int, E: int, K: int, seed: int):
    """x [T, D], w_gate_up [E, 2I, D], w_down [E, D, I], ids [T, K] (K distinct experts per token) and
    routing weights [T, K], float32, drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return (torch.randn(T, D, generator=gen), torch.randn(E, 2 * I, D, generator=gen) / D**0.5,
            torch.randn(E, D, I, generator=gen) / I**0.5, ids, torch.softmax(torch.randn(T, K, generator=gen), -1))


def use(helpers) -> None:
    cdiv, next_power_of_2 = helpers
    ops.cdiv = G.cdiv = tuning.cdiv = cdiv
    ops.next_power_of_2 = tuning.next_power_of_2 = next_power_of_2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    stub_launches()
    x, w_gu, w_d, ids, weights = make_case(64, 64, 64, 16, 4, 1)
    xg, wg, wdg, wtg = (t.clone().requires_grad_() for t in (x, w_gu, w_d, weights))
    x1, w1, wd1, ids1, wt1 = make_case(1, 64, 64, 16, 4, 1)

    def train():
        ops.routed_moe_mlp(xg, wg, wdg, ids, wtg).sum().backward()

    def infer():
        with torch.no_grad():
            ops.routed_moe_mlp(x, w_gu, w_d, ids, weights)

    def pair():
        with torch.no_grad():
            ops.routed_moe_mlp(x1, w1, wd1, ids1, wt1)

    cases = {"T = 64 forward+backward": train, "T = 64 inference (sorted)": infer, "T = 1 inference (pairs)": pair}
    for fn in cases.values():
        for _ in range(50):
            fn()
    us = {}
    for r in range(args.rounds):
        for name, helpers in (("triton", TRITONS), ("plain", PLAIN))[:: 1 if r % 2 == 0 else -1]:
            use(helpers)
            for case, fn in cases.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                us.setdefault((case, name), []).append((time.perf_counter() - start) / args.calls * 1e6)
    use(PLAIN)
    print(f"# torch {torch.__version__}, triton {triton.__version__}; us per call, median (min) of {args.rounds}")
    print("| case | triton.cdiv etc. | ThunderEP's arithmetic | saved |")
    print("|---|---|---|---|")
    for case in cases:
        old, new = us[(case, "triton")], us[(case, "plain")]
        print(f"| {case} | {statistics.median(old):.1f} ({min(old):.1f}) | {statistics.median(new):.1f} "
              f"({min(new):.1f}) | {statistics.median(old) - statistics.median(new):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
