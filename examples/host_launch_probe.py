"""Host time per small step on a GPU, this version against the earlier form of two pieces, alternating in
one process (the kernels run for real, in bfloat16, on shapes so small that the GPU waits for the host):

- launch: `tuning.launch` reusing a tuned config as it did before: a tuning key with dtype names, the
  config's arguments rebuilt on every launch, and the kernel called through its heuristics wrapper,
  which computes EVEN_K again each time;
- sort: a training batch sorted by torch's argsort and counted by a scatter (ROUTE_MAX_PAIRS = 0), as
  before training took the one-program sort. (For inference that row is not an earlier form: inference
  took the one-program sort before too.)

Four variants (this version, earlier launch, earlier sort, earlier both), 9 rounds of 200 calls each,
every round ending in a synchronize; medians per call, and the earlier-both median over each.

    python examples/host_launch_probe.py
"""

import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "examples")
import host_grid_probe as H  # noqa: E402

from thunderep.kernels import ops, paths, tuning  # noqa: E402

NEW_LAUNCH = tuning.launch
_EARLIER: dict = {}


def earlier_launch(autotuner, plain, default, grid, device, **args):
    """The earlier reuse of a tuned config (the config chosen by this version's tuning)."""
    key = (id(autotuner), *(args[k] for k in autotuner.keys),
           *(str(v.dtype) for v in args.values() if isinstance(v, torch.Tensor)))
    config = _EARLIER.get(key)
    if config is None:
        new_key = (id(autotuner), *(args[k] for k in autotuner.keys),
                   *(v.dtype for v in args.values() if isinstance(v, torch.Tensor)))
        if new_key not in tuning._TUNED:
            return NEW_LAUNCH(autotuner, plain, default, grid, device, **args)
        _, meta = tuning._TUNED[new_key]
        special = ("num_warps", "num_stages", "num_ctas", "maxnreg")
        rules = set(plain.values) if isinstance(plain, triton.runtime.autotuner.Heuristics) else set()
        config = _EARLIER[key] = triton.Config({k: v for k, v in meta.items() if k not in special and k not in rules},
                                               **{k: meta[k] for k in special if k in meta})
    plain[grid](**args, **config.all_kwargs())


def set_launch(fn):
    tuning.launch = fn
    tuning.launch = fn


def main():
    if not torch.cuda.is_available():
        sys.exit("host_launch_probe.py needs a CUDA GPU: it measures the host time of real launches")
    torch.set_num_threads(1)
    T, D, I, E, K = 64, 64, 64, 16, 4
    case = tuple(t.to("cuda", torch.bfloat16 if t.is_floating_point() else None) for t in H.make_case(T, D, I, E, K, 1))
    x, w_gu, w_d, ids, wt = case
    leaves = [t.clone().requires_grad_() for t in (x, w_gu, w_d, wt)]

    def train():
        y = ops.routed_moe_mlp(*leaves[:3], ids, leaves[3])
        torch.autograd.grad(y, leaves, torch.ones_like(y))

    def infer():
        with torch.no_grad():
            ops.routed_moe_mlp(x, w_gu, w_d, ids, wt)

    bound = paths.ROUTE_MAX_PAIRS
    variants = {"this commit": (NEW_LAUNCH, bound), "earlier launch": (earlier_launch, bound),
                "earlier sort (argsort)": (NEW_LAUNCH, 0), "earlier both": (earlier_launch, 0)}
    for fn_name, fn in (("train", train), ("infer", infer)):
        res = {v: [] for v in variants}
        for launch, route in variants.values():
            set_launch(launch)
            paths.ROUTE_MAX_PAIRS = route
            for _ in range(30):
                fn()
        torch.cuda.synchronize()
        for _ in range(9):
            for v, (launch, route) in variants.items():
                set_launch(launch)
                paths.ROUTE_MAX_PAIRS = route
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                res[v].append((t1 - t0) / 200 * 1e6)
        base = statistics.median(res["earlier both"])
        for v in variants:
            m = statistics.median(res[v])
            print(f"{fn_name} {v}: {m:.1f} us/call (rounds {min(res[v]):.0f}-{max(res[v]):.0f}), "
                  f"earlier both / this: {base / m:.3f}")


if __name__ == "__main__":
    main()
