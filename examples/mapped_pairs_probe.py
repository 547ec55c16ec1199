"""Cold experts read by the GPU straight from pinned host memory: the decode pair kernels on a mapped view
(`thunderep.moe.staging.mapped`) against the same kernels on device memory, a staged copy of the same
experts, the native host engine, and the host engine and the mapped kernels at once (one token, experts of
Qwen3-30B-A3B's shape: hidden 2048, intermediate 768, bfloat16; 9.4 MB an expert).

    python examples/mapped_pairs_probe.py [--experts 48] [--pairs 1,2,4,6,8] [--threads 8]

Each row is the best of --repeats timed calls (wall time, the GPU waited for), each call on experts that the
calls before it did not read (so that no cache holds them). CUDA only."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from thunderep.kernels.decode import pairs_forward
from thunderep.moe import host_native
from thunderep.moe.host_experts import HostExperts
from thunderep.moe.staging import mapped

HIDDEN, INTER = 2048, 768


def best_of(fn, repeats: int) -> float:
    fn(0)
    best = float("inf")
    for r in range(1, repeats + 1):
        started = time.perf_counter()
        fn(r)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--pairs", default="1,2,4,6,8")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dev, E = torch.device("cuda"), args.experts
    torch.manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16).pin_memory()
    down = (torch.randn(E, HIDDEN, INTER, dtype=torch.bfloat16) * 0.05).pin_memory()
    gu_map, d_map = mapped(gate_up, dev), mapped(down, dev)
    gu_dev, d_dev = gate_up.to(dev), down.to(dev)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device=dev)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    staged = [torch.empty_like(gu_dev[:1]), torch.empty_like(d_dev[:1])]
    engine = host_native.NativeEngine(threads=args.threads) if host_native.available() else None
    job_args = HostExperts(F.silu).job_args({"gate_up_proj": gate_up, "down_proj": down})
    x_h = x.cpu()
    number = [0]

    def ids_of(r: int, k: int, offset: int = 0) -> list[int]:
        return [(offset + r * k + j) % E for j in range(k)]

    def kernels(weights, k, offset=0):
        def run(r):
            ids = torch.tensor(ids_of(r, k, offset), device=dev)
            pairs_forward(x, *weights, ids, torch.full((k,), 1.0 / k, device=dev, dtype=torch.bfloat16), "silu",
                          False)
            torch.cuda.synchronize()
        return run

    def copies(k):
        def run(r):
            for e in ids_of(r, k):
                staged[0].copy_(gate_up[e:e + 1], non_blocking=True)
                staged[1].copy_(down[e:e + 1], non_blocking=True)
            torch.cuda.synchronize()
        return run

    def host_job(k, offset=0):
        ready, flag, out = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, HIDDEN)
        hot = torch.zeros(E, dtype=torch.bool)

        def start(r):
            number[0] += 1
            ids = torch.tensor([ids_of(r, k, offset)])
            return engine.launch(None, ready, 1, flag, number[0], 1 << 26, ids, torch.full((1, k), 1.0 / k), x_h, hot,
                                 *job_args, out)
        return start

    ids = torch.tensor([0, 5, 9], device=dev)
    w3 = torch.full((3,), 1.0 / 3, device=dev, dtype=torch.bfloat16)
    same = torch.equal(pairs_forward(x, gu_map, d_map, ids, w3, "silu", False),
                       pairs_forward(x, gu_dev, d_dev, ids, w3, "silu", False))
    print(f"mapped pair kernels equal the device ones bit for bit: {same}", flush=True)
    for k in (int(p) for p in args.pairs.split(",")):
        rows = {"device memory": kernels((gu_dev, d_dev), k), "mapped host memory": kernels((gu_map, d_map), k),
                "staged copy alone": copies(k)}
        if engine is not None:
            start = host_job(k)
            rows[f"host engine, {args.threads} threads"] = lambda r: start(r).wait()
        for name, fn in rows.items():
            s = best_of(fn, args.repeats)
            print(f"{k} experts: {name:28s} {s * 1e3:7.3f} ms, {k * expert_bytes / s / 1e9:6.1f} GB/s of weights",
                  flush=True)
        if engine is not None and k >= 2:
            for on_host in range(1, k):
                start, gpu = host_job(on_host, offset=E // 2), kernels((gu_map, d_map), k - on_host)

                def both(r):
                    job = start(r)
                    gpu(r)
                    job.wait()
                s = best_of(both, args.repeats)
                print(f"{k} experts: {on_host} host + {k - on_host} mapped at once {s * 1e3:7.3f} ms, "
                      f"{k * expert_bytes / s / 1e9:6.1f} GB/s of weights", flush=True)


if __name__ == "__main__":
    main()
