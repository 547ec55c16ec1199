"""The launching thread's cost of a handed-off decode call (`ExpertTiers.partial` with host jobs on the native
engine), on a machine without a GPU: the CUDA stream's two memory operations are stood in for (the stamp
written at once, the wait a no-op) and pinned buffers are plain ones, so what is timed is this thread's own
work per call: the copies into the layer's buffers, the stamp, the job's submission, the settling of the
layer's previous job and its counting, the hot pairs (here a stub) and the sums' add.

    python examples/handoff_cost_probe.py [--calls 3000] [--layers 8]

Eight layers of 128 slots (32 hot, the Qwen3-30B-A3B layout scaled down to hidden 64) are called in turn,
one token of 8 pairs each, as a decode step calls them; each layer's previous job has long ended when it is
settled. Prints microseconds per call, the best of 5 passes, for calls with cold pairs and for calls whose
pairs are all hot (no host compute: the hand-off alone)."""

from __future__ import annotations

import argparse
import ctypes
import time

import torch
import torch.nn.functional as F

from thunderep.moe.host_experts import HostExperts
from thunderep.moe.host_jobs import HostJobs
from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig

S, D, I, K, HOT = 128, 64, 32, 8, 32


class StandInDriver:
    """The stream's memory operations as the launching thread sees them: the stamp lands at once."""

    def address(self, host: torch.Tensor) -> int:
        return host.data_ptr()

    def enqueue_wait(self, stream, address: int, value: int) -> None:
        pass

    def enqueue_write(self, stream, address: int, value: int) -> None:
        ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF


def layers(count: int) -> list[ExpertTiers]:
    gen = torch.Generator().manual_seed(0)
    host = {"gate_up_proj": (torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5).bfloat16(),
            "down_proj": (torch.randn(S, D, I, generator=gen) * I ** -0.5).bfloat16()}
    jobs = HostJobs(torch.device("cpu"), engine="native")
    jobs.driver = StandInDriver()
    jobs._ready_address, jobs._address = jobs.ready.data_ptr(), jobs.flag.data_ptr()
    costs = OffloadCosts(host_flops=1e12, device_flops=1.0, h2d_Bps=1e15)  # cold rows on the host
    out = []
    for n in range(count):
        tiers = ExpertTiers(host, HOT, torch.device("cpu"), lambda *a: None, costs, Staging(host, torch.device("cpu")),
                            TierConfig(host_thread="off", host_engine="native"), host_fn=HostExperts(F.silu),
                            pairs=lambda weights, x_TD, entry_TK, w_TK: torch.zeros(x_TD.shape), name=f"layer {n}")
        tiers.jobs = jobs
        out.append(tiers)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    real_stream, real_empty = torch.cuda.current_stream, torch.empty
    torch.cuda.current_stream = lambda device=None: None
    torch.empty = lambda *a, pin_memory=False, **k: real_empty(*a, **k)
    try:
        tiers = layers(args.layers)
        gen = torch.Generator().manual_seed(1)
        calls = [(torch.randn(1, D, generator=gen).bfloat16(), torch.randperm(S, generator=gen)[:K][None],
                  torch.rand(1, K, generator=gen).bfloat16()) for _ in range(64)]
        hot = torch.tensor(tiers[0].hot_slots[:K])[None]
        for kind, batch in (("cold pairs", calls), ("all hot", [(x, hot, w) for x, _, w in calls])):
            for i in range(16 * args.layers):
                tiers[i % args.layers].partial(*batch[i % 64])
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for i in range(args.calls):
                    tiers[i % args.layers].partial(*batch[i % 64])
                best = min(best, (time.perf_counter() - started) / args.calls)
            print(f"{kind}: {best * 1e6:.1f} us a call (the launching thread, best of 5)")
        for t in tiers:
            t.settle()
    finally:
        torch.cuda.current_stream, torch.empty = real_stream, real_empty


if __name__ == "__main__":
    main()
