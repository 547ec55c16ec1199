"""Why host experts on a second thread were slow, on any CPU: Python's lock, taken back after each torch call.

    python examples/host_lock_probe.py [--between 100,400,2000] [--threads 1] [--repeats 5]

Twenty bfloat16 experts of Qwen3-30B-A3B's shape (hidden 2048, intermediate 768) on one token, computed on a
second thread, alone and beside this thread running a loop of N Python iterations between two small torch
calls (as a launching thread spends its time in Python between launches), for each N of --between:

    one by one   the products called from Python, one torch call each (each return takes the lock back)
    scripted     the same products and their weighted sum in one TorchScript call (`HostExperts.summed`)

Milliseconds per call, each of --repeats calls. Then the launching thread's cost of handing a decode call to
a host job (`thunderep.moe.host_summed`'s launcher: its arguments converted, its tensors aliased, the job
forked), microseconds per hand-off, the jobs held back behind a first one so that none runs meanwhile."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from thunderep.moe.host_experts import HostExperts
from thunderep.moe.host_summed import done_job_fn, pairs_job_fn

S, D, I = 20, 2048, 768


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--between", default="100,400,2000", help="Python iterations between the busy thread's "
                        "torch calls, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="the second thread's product threads")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    host = {"gate_up_proj": (torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5).bfloat16(),
            "down_proj": (torch.randn(S, D, I, generator=gen) * I ** -0.5).bfloat16()}
    lean, x = HostExperts(F.silu), torch.randn(1, D, generator=gen).bfloat16()
    slots, weights = list(range(S)), [1.0 / S] * S

    def one_by_one() -> None:
        out = torch.zeros(1, D)
        out.addmm_(torch.tensor([weights]), lean(host, slots, x.expand(S, -1), [1] * S).float())

    def scripted() -> None:
        lean.summed(host, slots, [1] * S, [0] * S, weights, x, torch.empty(1, D))

    pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(args.threads,))
    small = torch.zeros(4)

    def timed(call, between: int) -> list[float]:
        times = []
        for _ in range(args.repeats + 1):  # the first: warm-up
            started = time.perf_counter()
            future = pool.submit(call)
            while between and not future.done():
                n = 0
                for _ in range(between):
                    n += 1
                small.add_(1)
            future.result()
            times.append((time.perf_counter() - started) * 1e3)
        return times[1:]

    print(f"{S} experts of hidden {D}, intermediate {I}, bfloat16, one token; the second thread's products on "
          f"{args.threads} thread(s); ms per call, {args.repeats} calls", flush=True)
    for between in [0] + [int(b) for b in args.between.split(",")]:
        beside = "alone" if not between else f"beside {between} Python iterations between torch calls"
        for name, call in (("one by one", one_by_one), ("scripted", scripted)):
            print(f"  {name:10s} {beside}: {' '.join(f'{t:.1f}' for t in timed(call, between))}", flush=True)

    fn, flag = pairs_job_fn(), torch.zeros(1, dtype=torch.int32)
    job_args = (torch.tensor([[1, 2, 3]]), torch.tensor([[0.3, 0.3, 0.4]]), x, torch.ones(S, dtype=torch.bool),
                *lean.job_args(host), torch.empty(1, D))
    for _ in range(args.repeats):
        gate = torch.zeros(1, dtype=torch.int32)
        prev = fn(done_job_fn()(0), gate, 1, flag, 1, 1 << 40, *job_args)  # waits for the gate; the rest behind it
        started = time.perf_counter()
        for n in range(300):
            prev = fn(prev, gate, 1, flag, n + 2, 1 << 40, *job_args)
        print(f"  a hand-off to a host job: {(time.perf_counter() - started) / 300 * 1e6:.1f} us", flush=True)
        gate.fill_(1)
        prev.wait()


if __name__ == "__main__":
    main()
