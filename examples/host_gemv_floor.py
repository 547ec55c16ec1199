"""The host path's floor: one expert of Qwen3-30B-A3B's shape (hidden 2048, intermediate 768, bfloat16) on one
token, by the form of its products, against the host's copy bandwidth.

    python examples/host_gemv_floor.py [--experts 64] [--threads 16,8,4]

For each torch thread count: a 1 GiB copy (read plus write bytes over its time), then milliseconds per expert
(the best of three passes over --experts different experts, so that the weights come from memory, not
cache) and the weight bytes read per second, for three forms of the same gated expert:

    as held      x @ W.t() with W [out, in], as the host path holds it (`thunderep.moe.host_experts`)
    transposed   x @ W with W held [in, out]
    mv           torch.mv on the held weights
    native       ThunderEP's native host engine (`thunderep.moe.host_native`) with that many threads of its
                 own: all --experts experts as one job, the time per expert (where the extension is built)

An expert is 9.4 MB of weights at this shape: at batch 1 its time is the time to read them."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from thunderep.moe import host_native
from thunderep.moe.host_experts import HostExperts

HIDDEN, INTER = 2048, 768


def per_expert(fn, experts: int) -> float:
    """Seconds per expert: fn(e) for every e, the best of three passes after one warm-up call."""
    fn(0)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for e in range(experts):
            fn(e)
        best = min(best, (time.perf_counter() - started) / experts)
    return best


def native_job(engine, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, experts: int):
    """A function timing one job of every expert on one token on `engine` (its stamp already written)."""
    args = HostExperts(F.silu).job_args({"gate_up_proj": gate_up, "down_proj": down})
    ids, w = torch.arange(experts)[None], torch.full((1, experts), 1.0 / experts)
    ready, flag, out = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, HIDDEN)
    hot, number = torch.zeros(experts, dtype=torch.bool), [0]

    def run() -> float:
        number[0] += 1
        started = time.perf_counter()
        engine.launch(None, ready, 1, flag, number[0], 1 << 26, ids, w, x, hot, *args, out).wait()
        return time.perf_counter() - started

    run()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--threads", default="16,8,4")
    args = parser.parse_args()
    torch.manual_seed(0)
    E = args.experts
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16)
    down = torch.randn(E, HIDDEN, INTER, dtype=torch.bfloat16)
    gate_up_t, down_t = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2

    def as_held(e):
        h = torch.mm(x, gate_up[e].t())
        return torch.mm(F.silu(h[:, :INTER]) * h[:, INTER:], down[e].t())

    def transposed(e):
        h = torch.mm(x, gate_up_t[e])
        return torch.mm(F.silu(h[:, :INTER]) * h[:, INTER:], down_t[e])

    def mv(e):
        h = torch.mv(gate_up[e], x[0])
        return torch.mv(down[e], F.silu(h[:INTER]) * h[INTER:])

    native = host_native.available()
    if not native:
        print(f"the native engine is unavailable: {host_native.unavailable_reason()}")
    src = torch.empty(1 << 30, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for n in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(n)
        dst.copy_(src)
        started = time.perf_counter()
        dst.copy_(src)
        print(f"threads {n}: copy 1 GiB {2 * src.numel() / (time.perf_counter() - started) / 1e9:.1f} GB/s "
              "(read + write)", flush=True)
        forms = [("as held", as_held), ("transposed", transposed), ("mv", mv)]
        if native:
            forms.append(("native", native_job(host_native.NativeEngine(threads=n), gate_up, down, x, E)))
        for name, fn in forms:
            s = per_expert(fn, E) if name != "native" else min(fn() for _ in range(3)) / E
            print(f"threads {n}: {name:10s} {s * 1e3:7.3f} ms an expert, {expert_bytes / s / 1e9:6.1f} GB/s of weights",
                  flush=True)


if __name__ == "__main__":
    main()
