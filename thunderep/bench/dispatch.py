"""Benchmark: ThunderEP's all-to-all dispatch vs the all-gather + reduce-scatter baseline.

The baseline is what frameworks fall back to without an EP kernel library (vLLM's
`allgather_reducescatter` backend; transformers' EP sums partial outputs the same way): every rank
gathers every rank's tokens and routing, computes its own experts on all of them, and a
reduce-scatter returns each rank its tokens' sums. Both run the same layer (same weights, same local
experts), forward + backward, side by side in one run.

    thunderep bench dispatch --ranks 2 4

Bytes: ThunderEP's are counted by the runtime (`CommStats`, rows actually sent to other ranks);
the baseline's are the payload each rank must send to its peers, (R - 1) * T * D * bytes per
all-gather and per reduce-scatter (ring algorithms send exactly this), in both directions.
Shape legend: T tokens per rank, D hidden, K top-k, R ranks.
"""

from __future__ import annotations

import os
import platform
import queue as queue_module
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from ..comm.runtime import ExpertParallel
from ..config import EPConfig, LayerConfig
from ..errors import ThunderError
from ..moe.layer import ThunderMoELayer

__all__ = ["DispatchBench", "report", "run"]


@dataclass(frozen=True)
class DispatchBench:
    """One run's settings (`thunderep bench dispatch`'s options): the Mixtral-shaped layer, the runtime's
    waves and control plane, timed and warm-up steps, the rendezvous port, where rank 0 writes operator
    tables (None: no profile) and the device (cpu: gloo, fp32; cuda: NCCL, bf16)."""

    tokens: int = 512  # per rank
    hidden: int = 512
    intermediate: int = 256
    experts: int = 8
    top_k: int = 2
    waves: int = 1
    control: str = "auto"
    iters: int = 20
    warmup: int = 3
    port: int = 29611
    profile: str | None = None
    device: str = "cpu"


def _bench_rank(rank: int, world: int, args: DispatchBench, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    ep = ExpertParallel.init(config=EPConfig(control=args.control, waves=args.waves),
                             backend="nccl" if cuda else "gloo")
    device, dtype = ep.groups.device, (torch.bfloat16 if cuda else torch.float32)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    config = LayerConfig.build(family="mixtral", hidden_size=args.hidden, intermediate_size=args.intermediate,
                               num_experts=args.experts, top_k=args.top_k)
    torch.manual_seed(0)
    layer = ThunderMoELayer(config, ep=ep, dtype=dtype)
    torch.manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)  # hidden states
    g = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    # The same layer with its split sizes through collectives instead of the runtime's control plane.
    ep_collective = ExpertParallel(ep.groups, EPConfig(control="collective", waves=args.waves))
    layer_collective = ThunderMoELayer(config, ep=ep_collective, dtype=dtype)
    layer_collective.load_state_dict(layer.state_dict())
    # ep mode pinned: mode "auto" would run small equal batches (the default --tokens too) in all-gather mode.
    methods = {"thunderep_a2a": lambda: layer(x, mode="ep"), "allgather_rs": lambda: layer(x, mode="allgather"),
               "a2a_collective_control": lambda: layer_collective(x, mode="ep")}
    times = {name: [] for name in methods}
    for it in range(args.warmup + args.iters):
        for name, fn in methods.items():  # interleaved, so drift hits both alike
            sync()
            dist.barrier()
            ep.stats.reset()
            start = time.perf_counter()
            fn().backward(g)
            sync()
            elapsed = time.perf_counter() - start
            if it >= args.warmup:
                times[name].append(elapsed)
    if args.profile:  # one more step per method; rank 0 writes where its time went
        _profile(methods, g, sync, rank, world, args.profile)
    ep.stats.reset()
    x_exact = x.detach().clone().requires_grad_(True)
    y_exact = layer(x_exact, mode="ep")
    y_exact.backward(g)
    a2a_bytes = {"none": ep.stats.remote_bytes()}
    errors = {}
    for codec in ("bf16", "fp8"):  # payload compression: error and bytes against the exact run
        lossy = ExpertParallel(ep.groups, EPConfig(control="collective", compression=codec))
        layer.core.ep = lossy  # the same layer and weights over the compressing runtime
        x_lossy = x.detach().clone().requires_grad_(True)
        y_lossy = layer(x_lossy, mode="ep")
        y_lossy.backward(g)
        errors[codec] = [((a - b).abs().max() / b.abs().max()).item()
                         for a, b in ((y_lossy, y_exact), (x_lossy.grad, x_exact.grad))]
        a2a_bytes[codec] = lossy.stats.remote_bytes()
        lossy.close()
    layer.core.ep = ep
    ep.close()
    kind = ep.control.kind
    ep_collective.close()
    queue.put((rank, times, a2a_bytes, errors, kind))
    dist.destroy_process_group()


def _profile(methods: dict, g: torch.Tensor, sync, rank: int, world: int, directory: str) -> None:
    """Every rank runs each method once more; rank 0 under torch.profiler, writing its operator table
    (sorted by device time where there is a device, else by CPU time) to
    DIR/dispatch-<world>ranks-<method>.txt."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if g.is_cuda else [])
    for name, fn in methods.items():
        sync()
        dist.barrier()
        if rank != 0:
            fn().backward(g)
            sync()
            continue
        with profile(activities=activities) as prof:
            fn().backward(g)
            sync()
        key = "self_cuda_time_total" if g.is_cuda else "self_cpu_time_total"
        path = Path(directory) / f"dispatch-{world}ranks-{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.key_averages().table(sort_by=key, row_limit=-1, max_name_column_width=60))


def run(world: int, args: DispatchBench) -> dict:
    """Every method on `world` spawned ranks; the step times (the slowest rank's, median), bytes and the
    compressed payloads' errors."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_bench_rank, args=(r, world, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 600
    try:
        while len(results) < world:  # a rank that dies is reported at once, not after the timeout
            try:
                results.append(queue.get(timeout=0.5))
                continue
            except queue_module.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise ThunderError(f"rank {dead[0][0]} exited with code {dead[0][1]} (its error is printed above)"
                                   if dead else "the ranks gave no result within 600 s")
    finally:
        for p in procs:
            p.join(30 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
    results.sort()
    iters = len(results[0][1]["thunderep_a2a"])
    step = {name: statistics.median(max(r[1][name][i] for r in results) for i in range(iters))
            for name in ("thunderep_a2a", "allgather_rs", "a2a_collective_control")}
    element = 2 if args.device == "cuda" else 4
    baseline_bytes = 4 * (world - 1) * args.tokens * args.hidden * element  # x gather + RS, fwd and bwd
    baseline_bytes += 2 * (world - 1) * args.tokens * args.top_k * (element + 8)  # weights + ids gathers
    codec_error = {c: [max(r[3][c][i] for r in results) for i in range(2)] for c in ("bf16", "fp8")}
    return {"ranks": world, "a2a_ms": step["thunderep_a2a"] * 1e3, "ag_ms": step["allgather_rs"] * 1e3,
            "a2a_coll_ms": step["a2a_collective_control"] * 1e3, "control": results[0][4],
            "a2a_bytes": statistics.mean(r[2]["none"] for r in results), "ag_bytes": baseline_bytes,
            "codec_bytes": {c: statistics.mean(r[2][c] for r in results) for c in ("bf16", "fp8")},
            "codec_error": codec_error}


def report(ranks: list[int], args: DispatchBench) -> int:
    """Run every rank count in `ranks` and print the tables: time and bytes against the baseline, split sizes
    through the control plane against collectives, and the compressed payloads."""
    if args.device == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        p2p = os.environ.get("NCCL_P2P_DISABLE", "0")
        print(f"hardware: {torch.cuda.device_count()} x {', '.join(names)}, torch {torch.__version__}, NCCL "
              f"(NCCL_P2P_DISABLE={p2p})")
    else:
        print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
              f"{torch.__version__}, gloo on CPU, 1 thread per rank")
    dtype = "bf16" if args.device == "cuda" else "fp32"
    print(f"layer: Mixtral-shaped, D={args.hidden}, I={args.intermediate}, E={args.experts}, "
          f"top-{args.top_k}, {args.tokens} tokens per rank, {dtype}, waves={args.waves}, forward+backward")
    print(f"{'ranks':>5} | {'a2a ms':>8} | {'allgather ms':>12} | {'time ratio':>10} | "
          f"{'a2a MB/rank':>11} | {'allgather MB/rank':>17} | {'bytes ratio':>11}")
    rows = []
    for world in ranks:
        r = run(world, args)
        rows.append(r)
        print(f"{world:>5} | {r['a2a_ms']:8.2f} | {r['ag_ms']:12.2f} | {r['ag_ms'] / r['a2a_ms']:9.2f}x | "
              f"{r['a2a_bytes'] / 1e6:11.3f} | {r['ag_bytes'] / 1e6:17.3f} | "
              f"{r['ag_bytes'] / r['a2a_bytes']:10.2f}x")
    print("\nsplit sizes through the runtime's control plane vs through collectives (same layer, same run):")
    print(f"{'ranks':>5} | {'control plane':>13} | {'step ms':>8} | {'collective ms':>13} | {'ratio':>6}")
    for r in rows:
        print(f"{r['ranks']:>5} | {r['control']:>13} | {r['a2a_ms']:8.2f} | {r['a2a_coll_ms']:13.2f} | "
              f"{r['a2a_coll_ms'] / r['a2a_ms']:5.2f}x")
    print("\npayload compression (dispatch, combine and their gradients), against the uncompressed run:")
    print(f"{'ranks':>5} | {'codec':>5} | {'MB/rank':>8} | {'bytes ratio':>11} | {'max rel err y':>13} | "
          f"{'max rel err dx':>14}")
    for r in rows:
        for codec in ("bf16", "fp8"):
            err_y, err_dx = r["codec_error"][codec]
            b = r["codec_bytes"][codec]
            print(f"{r['ranks']:>5} | {codec:>5} | {b / 1e6:8.3f} | {r['a2a_bytes'] / b:10.2f}x | "
                  f"{err_y:13.2e} | {err_dx:14.2e}")
    return 0
