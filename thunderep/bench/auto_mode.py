"""Benchmark: where mode "auto" lands against the faster measured mode, ep vs all-gather, across T.

    from thunderep.bench.auto_mode import AutoModeBench, report
    print(report(AutoModeBench(ranks=(2, 4))))

For each shape (a Qwen3-shaped layer, E = 128, top-8, and a Mixtral-shaped one, E = 8, top-2, both with a
reduced hidden size) and each T tokens per rank, every rank times its layer pinned to ep mode and to
all-gather mode, alternating step by step so that drift hits both alike: forward + backward (a training
step's layer) and forward alone under `torch.no_grad` (inference). Per (T, pass): the median over
iterations of the slowest rank. Beside them, what `mode_seconds` (the rule of mode "auto") estimates
and chooses with the runtime's constants for this backend, and whether that choice is the faster
measured mode. `link()` measures the gloo collectives the constants come from, and `local()` the
float32 pair-row work. On CPU ranks (gloo, fp32, one thread per rank); the runtime's own timing is off.

Shape legend: T tokens per rank, D hidden, I expert intermediate size, E experts, K top-k, R ranks.
"""

from __future__ import annotations

import os
import platform
import queue as queue_module
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..balance.placement import Placement
from ..comm.launch import free_port
from ..comm.runtime import ExpertParallel
from ..config import EPConfig, LayerConfig
from ..errors import ThunderError
from ..moe.ep import COSTS, ModeCosts, mode_seconds, reach_per_rank
from ..moe.layer import ThunderMoELayer
from .link import fit_alpha_beta

__all__ = ["SHAPES", "AutoModeBench", "fit_costs", "link", "local", "report", "run"]

SHAPES = {  # name: (family, E, K, D, I)
    "qwen3": ("qwen3_moe", 128, 8, 256, 128),
    "mixtral": ("mixtral", 8, 2, 256, 256),
}


@dataclass(frozen=True)
class AutoModeBench:
    """What `report` runs: rank counts, shapes (keys of SHAPES), tokens per rank, timed and untimed
    iterations per point."""

    ranks: tuple[int, ...] = (2, 4)
    shapes: tuple[str, ...] = ("qwen3", "mixtral")
    tokens: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)
    iters: int = 5
    warmup: int = 2
    device: str = "cpu"  # cpu: gloo, fp32, one thread per rank; cuda: NCCL, bf16, one GPU per rank
    shapes_override: tuple = ()  # (name, family, E, K, D, I) rows used instead of SHAPES


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(fn, iters: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + iters):
        _sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync()
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
LINK_BYTES = tuple(1 << p for p in range(10, 23, 2))  # per-rank buffer sizes of `link`, 1 KiB .. 4 MiB


def link(world: int, iters: int, warmup: int, device: torch.device | None = None) -> dict:
    """In an initialised process group: {(op, bytes per rank): seconds} for all_to_all, all_gather and
    reduce_scatter of float32 buffers (this rank's median; each sends bytes * (R - 1) / R to its peers)."""
    out = {}
    for n in LINK_BYTES:
        x, y = torch.ones(n // 4, device=device), torch.empty(n // 4, device=device)
        ops = {"all_to_all": partial(dist.all_to_all_single, y, x),
               "all_gather": partial(dist.all_gather_into_tensor, y, x[:n // 4 // world]),
               "reduce_scatter": partial(_reduce_scatter, y[:n // 4 // world], x)}
        for op, fn in ops.items():
            out[op, n] = statistics.median(_time(fn, iters, warmup))
    return out


def local(rows: int = 4096, K: int = 8, D: int = 256, iters: int = 5, device: torch.device | None = None) -> float:
    """Bytes per second of the float32 pair-row work both modes do (one thread on CPU): [rows * K, D]
    zeros filled by index_copy, then summed over K (`combine_async`, `local_partial`)."""
    y_ND, index_N = torch.randn(rows * K, D, device=device), torch.randperm(rows * K, device=device)
    seconds = []
    for _ in range(iters + 1):
        _sync()
        start = time.perf_counter()
        y_ND.new_zeros(rows * K, D).index_copy(0, index_N, y_ND).view(rows, K, D).sum(dim=1)
        _sync()
        seconds.append(time.perf_counter() - start)
    seconds = seconds[1:]
    return rows * K * D * 4 / statistics.median(seconds)


def _shapes(args: AutoModeBench) -> dict:
    """name -> (family, E, K, D, I) of the shapes to run."""
    if args.shapes_override:
        return {row[0]: tuple(row[1:]) for row in args.shapes_override}
    return {name: SHAPES[name] for name in args.shapes}


def _step(layer, x, g, mode: str) -> None:
    layer(x, mode=mode).backward(g)


def _forward(layer, x, mode: str) -> None:
    with torch.no_grad():
        layer(x, mode=mode)


def _bench_rank(rank: int, world: int, args: AutoModeBench, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    ep = ExpertParallel.init(config=EPConfig(control="auto"), backend="nccl" if cuda else "gloo")
    device, dtype = ep.groups.device, (torch.bfloat16 if cuda else torch.float32)
    times = {("link",) + key: [t] for key, t in link(world, 2 * args.iters, args.warmup, device).items()}
    times["local"] = [local(device=device)]
    for shape, (family, E, K, D, I) in _shapes(args).items():
        config = LayerConfig.build(family=family, hidden_size=D, intermediate_size=I, num_experts=E, top_k=K)
        torch.manual_seed(0)
        layer = ThunderMoELayer(config, ep=ep, dtype=dtype)
        for T in args.tokens:
            torch.manual_seed(100 + rank)
            x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn(T, D, device=device, dtype=dtype)
            for mode in ("ep", "allgather"):  # alternating per point: drift hits both modes alike
                times[shape, T, mode, "step"] = _time(partial(_step, layer, x, g, mode), args.iters, args.warmup)
                times[shape, T, mode, "forward"] = _time(partial(_forward, layer, x, mode), args.iters, args.warmup)
    ep.close()
    queue.put((rank, times))
    dist.destroy_process_group()


def run(world: int, args: AutoModeBench) -> dict:
    """{(shape, T, mode, pass): seconds} on `world` spawned gloo ranks: per point the median over
    iterations of the slowest rank."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_bench_rank, args=(r, world, args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 3600
    try:
        while len(results) < world:  # a rank that dies is reported at once, not after the deadline
            try:
                results.append(queue.get(timeout=0.5)[1])
                continue
            except queue_module.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise ThunderError(f"auto-mode bench: rank {dead[0][0]} exited with code {dead[0][1]} (its error "
                                   "is printed above)" if dead else "the ranks gave no result within 3600 s")
    finally:
        for p in procs:
            p.join(30 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
    return {key: statistics.median(max(r[key][i] for r in results) for i in range(len(results[0][key])))
            for key in results[0]}


def fit_costs(measured: dict, world: int, shapes: dict | None = None, element_bytes: int = 4) -> ModeCosts:
    """The rule's constants from one run at `world` ranks: per-message latency and bandwidth of the
    collectives (`fit_alpha_beta`, a collective over R ranks costing (R - 1) messages), the pair-row
    bandwidth, and ep mode's extra: the median over T <= 16 of the measured forward difference (ep
    minus all-gather) less what the rest of the rule already gives (never below 0)."""
    fits = {}
    for op in ("all_to_all", "all_gather", "reduce_scatter"):
        points = sorted((k[2], v) for k, v in measured.items() if k[:2] == ("link", op))
        latency, beta = fit_alpha_beta([n * (world - 1) / world for n, _ in points], [t for _, t in points])
        fits[op] = (latency / (world - 1) * 1e6, beta / 1e9)
    costs = ModeCosts(a2a_us=fits["all_to_all"][0], ring_us=(fits["all_gather"][0] + fits["reduce_scatter"][0]) / 2,
                      link_GBps=min(beta for _, beta in fits.values()), local_GBps=measured["local"] / 1e9,
                      ep_extra_us=0.0)
    extra = []
    for key in measured:
        if len(key) == 4 and key[2:] == ("ep", "forward") and key[1] <= 16:
            shape, T = key[:2]
            _, E, K, D, _ = (shapes or SHAPES)[shape]
            est = mode_seconds(T, reach_per_rank(Placement.contiguous(E, world), K), K, D, element_bytes * D,
                               element_bytes, costs)
            gap = measured[shape, T, "ep", "forward"] - measured[shape, T, "allgather", "forward"]
            extra.append(gap - (est["ep"] - est["allgather"]))
    return replace(costs, ep_extra_us=max(0.0, statistics.median(extra) * 1e6) if extra else 0.0)


def report(args: AutoModeBench, costs: ModeCosts | None = None) -> str:
    """Run every rank count and return the markdown: per shape, pass and T the measured ep and
    all-gather times side by side, the rule's estimates with `costs` (default: the runtime's gloo
    constants), its choice, and whether that is the faster measured mode; then the constants this run's
    own measurements give (`fit_costs`)."""
    cuda = args.device == "cuda"
    costs = costs or COSTS["nccl" if cuda else "gloo"]
    element, shapes = (2 if cuda else 4), _shapes(args)
    if cuda:
        hardware = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
                    f"(NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '0')}), bf16")
    else:
        hardware = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                    "gloo on CPU, fp32, 1 thread per rank")
    lines = [(f"hardware: {hardware}; {args.iters} timed iterations after {args.warmup}, median of the slowest "
              "rank"), f"rule constants: {costs}"]
    for world in args.ranks:
        measured = run(world, args)
        right = total = 0
        for shape, (family, E, K, D, I) in shapes.items():
            reach = reach_per_rank(Placement.contiguous(E, world), K)
            for kind in ("step", "forward"):
                title = (f"**{world} ranks, {shape} ({family}, E={E}, K={K}, D={D}, I={I}), "
                         f"{'forward + backward' if kind == 'step' else 'forward (no_grad)'}**")
                header = ("| T | ep ms | allgather ms | allgather / ep | rule: ep ms | rule: allgather ms | auto | "
                          "faster | auto's choice |")
                lines += ["", title, "", header, "|---|---|---|---|---|---|---|---|---|"]
                for T in args.tokens:
                    ep, ag = measured[shape, T, "ep", kind], measured[shape, T, "allgather", kind]
                    est = mode_seconds(T, reach, K, D, element * D, element, costs, backward=kind == "step")
                    auto = min(est, key=est.get)
                    faster = "ep" if ep <= ag else "allgather"
                    verdict = "right" if auto == faster else f"wrong, {max(ep, ag) / min(ep, ag):.2f}x slower"
                    right, total = right + (auto == faster), total + 1
                    lines.append(f"| {T} | {ep * 1e3:.2f} | {ag * 1e3:.2f} | {ag / ep:.2f}x | {est['ep'] * 1e3:.2f} | "
                                 f"{est['allgather'] * 1e3:.2f} | {auto} | {faster} | {verdict} |")
        lines += ["", (f"{world} ranks: auto's choice is the faster measured mode in {right} of {total} points; "
                       f"constants from this run's own measurements: {fit_costs(measured, world, shapes, element)}")]
    return "\n".join(lines)
