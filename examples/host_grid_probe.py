"""Host time per call of `routed_moe_mlp` with every Triton launch stubbed out (grids still evaluated),
the current host code against an older form of one piece of it, alternating in one process:
  --swap grid: ThunderEP's grid arithmetic (`tuning.cdiv`, `tuning.next_power_of_2`) against Triton's
               `triton.cdiv` / `triton.next_power_of_2`;
  --swap key:  the row kernels' tuning key in one call (`tiles.m_key`) against the earlier form, class
               and fill computed in two calls through a generator over the classes.
Runs on a CPU; the launches being stubs, it measures only the host's Python and torch work around them.
With --device cuda the kernels run for real, in bfloat16, on shapes small enough that the GPU waits for
the host: each round's calls end in a synchronize, so a call's time is what the host takes to launch it.

    python examples/host_grid_probe.py [--swap grid|key] [--rounds 10] [--count] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton

from thunderep.kernels import grouped_gemm as G
from thunderep.kernels import checks, decode, ops, passes, sorted_mlp, tiles, tuning

PLAIN = (tuning.cdiv, tuning.next_power_of_2)
TRITONS = (triton.cdiv, triton.next_power_of_2)
M_KEY = tiles.m_key
CLASSES = (16, 32, 64, 128)


def _m_key_two_calls(n_rows: int, E: int) -> tuple[int, int]:
    """The earlier form of `tiles.m_key`: the class through a generator, computed again for the fill."""
    def m_class(n, e):
        mean = G.mean_rows(n, e)
        return next((m for m in CLASSES if mean <= m), CLASSES[-1])

    mean, bm = G.mean_rows(n_rows, E), m_class(n_rows, E)
    return m_class(n_rows, E), 0 if mean <= bm / 2 else 2 if mean > 2 * bm else 1


def stub_launches() -> None:
    def launch(autotuner, plain, default, grid, device, **args):
        if callable(grid):
            grid({**default.kwargs, **args})

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    tuning.launch = launch  # sorted_mlp and decode launch through it
    checks.check_rows = lambda *args: None  # it reads counts and order, which stubbed kernels leave unwritten;
    # on a GPU it does not run (a sync)
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


def use(swap: str, old: bool) -> None:
    """The current host code, or with the older form of the `swap` piece."""
    cdiv, next_power_of_2 = TRITONS if old and swap == "grid" else PLAIN
    sorted_mlp.cdiv = decode.cdiv = G.cdiv = tuning.cdiv = cdiv
    sorted_mlp.next_power_of_2 = decode.next_power_of_2 = tuning.next_power_of_2 = next_power_of_2
    tiles.m_key = _m_key_two_calls if old and swap == "key" else M_KEY


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--swap", choices=("grid", "key"), default="grid")
    ap.add_argument("--count", action="store_true", help="count the grid-arithmetic calls per case, and stop")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: launches stubbed; cuda: the kernels run, in bfloat16")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU, and this torch sees none")
    torch.set_num_threads(1)
    if args.device == "cpu":
        stub_launches()
        sync = lambda: None  # noqa: E731
    else:
        sync = torch.cuda.synchronize

    def on_device(case):
        return tuple(t.to(args.device, torch.bfloat16 if t.is_floating_point() and args.device == "cuda" else None)
                     for t in case)

    x, w_gu, w_d, ids, weights = on_device(make_case(64, 64, 64, 16, 4, 1))
    xg, wg, wdg, wtg = (t.clone().requires_grad_() for t in (x, w_gu, w_d, weights))
    x1, w1, wd1, ids1, wt1 = on_device(make_case(1, 64, 64, 16, 4, 1))

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
    sync()
    if args.count:
        calls = [0]

        def counted(f):
            def g(*a):
                calls[0] += 1
                return f(*a)
            return g

        use(args.swap, old=False)
        sorted_mlp.cdiv = decode.cdiv = G.cdiv = tuning.cdiv = counted(PLAIN[0])
        sorted_mlp.next_power_of_2 = decode.next_power_of_2 = tuning.next_power_of_2 = counted(PLAIN[1])
        for case, fn in cases.items():
            calls[0] = 0
            fn()
            print(f"{case}: {calls[0]} calls of cdiv / next_power_of_2")
        use(args.swap, old=False)
        return 0
    us = {}
    for r in range(args.rounds):
        for name in ("old", "new")[:: 1 if r % 2 == 0 else -1]:
            use(args.swap, old=name == "old")
            for case, fn in cases.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                sync()
                us.setdefault((case, name), []).append((time.perf_counter() - start) / args.calls * 1e6)
    use(args.swap, old=False)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "launches stubbed"
    print(f"# --swap {args.swap}; {where}; torch {torch.__version__}, triton {triton.__version__}; us per call, "
          f"median (min) of {args.rounds} rounds")
    print("| case | older form | current | saved, medians (minima) |")
    print("|---|---|---|---|")
    for case in cases:
        old, new = us[(case, "old")], us[(case, "new")]
        print(f"| {case} | {statistics.median(old):.1f} ({min(old):.1f}) | {statistics.median(new):.1f} "
              f"({min(new):.1f}) | {statistics.median(old) - statistics.median(new):.1f} "
              f"({min(old) - min(new):.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
