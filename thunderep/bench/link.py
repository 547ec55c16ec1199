"""Benchmark: the GPU link as NCCL sees it, fitted to the alpha-beta model of `thunderep project`, and
per GPU pair the direct peer copy vs the host-staged copy.

    thunderep bench link --worlds 2 4 --json link.json
    thunderep project RUN_DIR --link link.json --link-setting p2p_disabled

For every world R (one process per GPU, GPUs 0 .. R-1) and every NCCL setting

    default        NCCL as configured: direct GPU-to-GPU paths (P2P over PCIe or NVLink) where it can
    p2p_disabled   NCCL_P2P_DISABLE=1: NCCL stages every byte through host memory, as it must on a
                   consumer box whose GPUs have no peer access

the ranks time `all_to_all_single` for per-rank buffers of S bytes, S log-spaced (powers of 2) from
--min-bytes to --max-bytes; each rank sends S / R bytes to every rank, itself included. Every
(setting, world) runs in freshly started processes: NCCL reads its environment when a communicator is
created.

`--ops` adds the ring collectives of all-gather mode at the same bytes per rank: `all_gather`
(`all_gather_into_tensor`, S / R bytes in, S out) and `reduce_scatter` (S bytes of bf16 in, S / R
out, summed). Each sends S (R - 1) / R bytes to its peers, as the all-to-all does, so the three
columns compare NCCL's point-to-point path (which carries the all-to-all) with its ring path on the
same link. `all_reduce` sums S bytes of bf16 in place on every rank: latency mode's cost per MoE layer
(a decode step's hidden states are S = rows * hidden * 2 bytes). A ring all-reduce sends twice the
bytes of the others, 2 S (R - 1) / R; its fit still counts S (R - 1) / R, so its beta reads as half
the link's. Only the all-to-all fit feeds `thunderep project`.

Timing: every iteration is a barrier, a device synchronize, then one collective and a device
synchronize, timed on the host: the exposed time of one collective, launch included, as the projection
charges it (no overlap). Per size: the median over iterations on each rank, then the largest over ranks.
`--graph N` times every op a second time inside CUDA graphs, as a server's captured decode steps run
it: N collectives back to back captured in one graph, each iteration one replay, its time divided by
N (rows "OP in graph"; the host's launch is gone, NCCL's own latency is not).

Fit: t = latency + x / beta, with x = S (R - 1) / R the bytes this rank sends to its peers. Weighted
least squares on the relative error (each point weighted by 1 / t), so an 8-byte point counts as much
as a 256-MiB one; a negative latency is clamped to 0 and beta refitted. `alpha_us` = latency / (R - 1),
the per-message alpha of the projection (a collective over R GPUs costs (R - 1) alpha + x / beta).
Printed next to the fit: the time of the smallest size and x / t of the largest, the two ends the fit
should agree with, and the fit's largest relative error over all sizes.

Pairs: peer copy vs explicit host-staged copy for every ordered GPU pair, measured by
`thunderep.doctor.gpu.measure_pair` (the doctor's measurement) in this process.

Every wait is bounded: NCCL collectives and the rendezvous by --timeout (init_process_group's
timeout), each (setting, world) run by --timeout as a whole; ranks still running then are killed and
the run fails with the ranks' last output lines (each rank logs one line per size as it captures and
times it). A rank that fails ends its run at once. A failed run does not end the command: the other
runs still print (and go to --json, which lists the failures), then the command ends with an error
naming each failed run. Times that admit no fit (flat over the sizes) keep their row, marked
`no fit` with the reason.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm.launch import free_port
from ..doctor import gpu as doctor_gpu
from ..errors import CommError, ConfigError, PeerTimeout, ThunderError
from ..kernels.graphs import capture

__all__ = ["OPS", "SETTINGS", "LinkBench", "fit_alpha_beta", "measure_world", "report", "sizes"]

# setting -> NCCL environment on top of this process's; "default" also removes NCCL_P2P_DISABLE.
SETTINGS = {"default": {}, "p2p_disabled": {"NCCL_P2P_DISABLE": "1"}}
# The collectives a run can time, each at S bytes per rank with S (R - 1) / R of them sent to peers.
OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class LinkBench:
    """What `report` runs (`thunderep bench link`'s options): GPUs per run, NCCL settings, collectives,
    collectives per CUDA graph (0: no graph rows), the per-rank buffer sizes' range, timed and untimed
    iterations per size, the pair copies' buffer in MiB, the bound on one run and where the JSON goes."""

    worlds: tuple[int, ...] = (2, 4)
    settings: tuple[str, ...] = tuple(SETTINGS)
    ops: tuple[str, ...] = ("all_to_all",)
    graph: int = 0
    min_bytes: int = 8
    max_bytes: int = 256 << 20
    iters: int = 20
    warmup: int = 3
    pair_mib: int = 64
    timeout: float = 180.0
    json: str | None = None


def sizes(min_bytes: int, max_bytes: int, world: int) -> list[int]:
    """Powers of 2 from `min_bytes` to `max_bytes`, each rounded down to a multiple of `world` (at least
    `world`): per-rank buffer sizes in bytes for `all_to_all_single`."""
    if not 1 <= min_bytes <= max_bytes:
        raise ConfigError(f"sizes: need 1 <= min_bytes ({min_bytes}) <= max_bytes ({max_bytes})")
    out, s = [], 1 << max(0, math.ceil(math.log2(min_bytes)))
    while s <= max_bytes:
        out.append(max(world, s // world * world))
        s *= 2
    return sorted(set(out))


def fit_alpha_beta(bytes_sent: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit t = latency + x / beta to points (x bytes sent, t seconds), minimising the relative error
    sum(((latency + x / beta) - t) / t)^2. Returns (latency in s, beta in bytes/s). A negative
    latency is clamped to 0 and beta refitted with it."""
    if len(bytes_sent) != len(seconds) or len(seconds) < 2:
        raise ConfigError(f"fit_alpha_beta: need 2 or more (bytes, seconds) pairs, got {len(bytes_sent)} "
                          f"bytes and {len(seconds)} times")
    if any(not (t > 0 and math.isfinite(t)) for t in seconds) or any(x < 0 for x in bytes_sent):
        raise ConfigError("fit_alpha_beta: times must be positive and finite, byte counts >= 0")
    # Residual_i = latency * p_i + c * q_i - 1 with p_i = 1 / t_i, q_i = x_i / t_i, c = 1 / beta.
    p = [1.0 / t for t in seconds]
    q = [x / t for x, t in zip(bytes_sent, seconds)]
    spp, sqq = sum(v * v for v in p), sum(v * v for v in q)
    spq = sum(a * b for a, b in zip(p, q))
    sp, sq = sum(p), sum(q)
    det = spp * sqq - spq * spq
    if det <= 1e-12 * spp * sqq:
        raise ConfigError("fit_alpha_beta: the sizes do not vary enough to separate latency from bandwidth")
    latency = (sp * sqq - sq * spq) / det
    c = (spp * sq - spq * sp) / det
    if latency < 0:
        latency, c = 0.0, sq / sqq
    if c <= 0:
        raise ThunderError(f"fit_alpha_beta: time does not grow with size (largest {max(bytes_sent):.0f} "
                           "bytes): raise --max-bytes so that bandwidth shows")
    return latency, 1.0 / c


def _collective(op: str, size: int, world: int, send: torch.Tensor, recv: torch.Tensor, send_bf16: torch.Tensor,
                recv_bf16: torch.Tensor):
    """A function that runs `op` (one of OPS) once for a per-rank buffer of `size` bytes."""
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(recv[:size], send[:size])
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(recv[:size], send[:size // world])
    if op == "all_reduce":  # zeros summed in place: they stay zeros
        return lambda: dist.all_reduce(recv_bf16[:max(1, size // 2)])
    n = max(world, size // 2 // world * world)  # bf16 elements, a multiple of the world
    return lambda: dist.reduce_scatter_tensor(recv_bf16[:n // world], send_bf16[:n])


def _captured(run, count: int, device: torch.device):
    """`run` `count` times back to back, captured in one CUDA graph; the graph's replay. `run` runs once
    first, outside the capture (the communicator's first use of the buffers)."""
    run()
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    # thread_local: the capture forbids unsafe CUDA calls on this thread only; NCCL's watchdog thread
    # keeps querying its events meanwhile.
    with capture(graph, stream=stream, capture_error_mode="thread_local"):
        for _ in range(count):
            run()
    torch.cuda.synchronize(device)
    return graph.replay


def _worker(spec: dict) -> int:
    """One rank of a (setting, world) run, in its own process: times spec["op"] per size and writes
    {"rank", "seconds"} (median seconds per size) to spec["out"]."""
    rank, world, cuda = spec["rank"], spec["world"], spec["backend"] == "nccl"  # gloo: the CPU tests
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    dist.init_process_group(spec["backend"], init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=spec["timeout_s"]),
                            **({"device_id": device} if cuda else {}))
    try:
        send_N = torch.ones(max(spec["sizes"]), dtype=torch.uint8, device=device)
        recv_N = torch.empty_like(send_N)
        send_bf16 = torch.ones(max(spec["sizes"]) // 2 + world, dtype=torch.bfloat16, device=device)
        recv_bf16 = torch.zeros_like(send_bf16)
        medians = []
        for size in spec["sizes"]:
            run = _collective(spec.get("op", "all_to_all"), size, world, send_N, recv_N, send_bf16, recv_bf16)
            per_run = spec.get("graph", 0) or 1  # collectives per timed call
            if spec.get("graph", 0):
                print(f"{size} B: capturing {per_run}", flush=True)  # where a rank stops shows in its log
                run = _captured(run, per_run, device)
            print(f"{size} B: timing", flush=True)
            times = []
            for i in range(spec["warmup"] + spec["iters"]):
                if cuda:
                    dist.barrier(device_ids=[rank])
                else:
                    dist.barrier()
                sync()
                start = time.perf_counter()
                run()
                sync()
                if i >= spec["warmup"]:
                    times.append((time.perf_counter() - start) / per_run)
            medians.append(statistics.median(times))
            run = None  # a captured graph holds NCCL work: freed before the next capture and before teardown
            sync()
        Path(spec["out"]).write_text(json.dumps({"rank": rank, "seconds": medians}))
    finally:
        dist.destroy_process_group()
    return 0


def _env(setting: str) -> dict:
    env = dict(os.environ)
    env.pop("NCCL_P2P_DISABLE", None)
    env.update(SETTINGS[setting])
    # NVLink SHARP multicast is no PCIe feature and would serve only the barrier here: keep it off.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    root = str(Path(__file__).resolve().parents[2])  # the ranks import this copy of thunderep
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no output)"
    return " | ".join(text[-lines:]) or "(no output)"


def measure_world(world: int, setting: str, size_list: list[int], *, iters: int, warmup: int,
                  timeout_s: float, backend: str = "nccl", op: str = "all_to_all", graph: int = 0) -> list[float]:
    """Seconds per size (median over iterations, largest over ranks) of `op` (one of OPS; per-rank
    buffers of each size in bytes) on GPUs 0 .. world-1 under NCCL `setting`, in `world` freshly
    started processes (backend "gloo": on CPU). graph > 0: `graph` collectives captured in one CUDA
    graph per timed replay (NCCL only)."""
    if graph < 0 or (graph and backend != "nccl"):
        raise ConfigError(f"graph={graph}: collectives captured in CUDA graphs need graph >= 1 and the nccl "
                          f"backend (here {backend!r})")
    if setting not in SETTINGS:
        raise ConfigError(f"unknown NCCL setting {setting!r}; known: {', '.join(SETTINGS)}")
    if op not in OPS:
        raise ConfigError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    what = f"bench link, {op}{' in graph' if graph else ''}, world {world}, {setting}"
    with tempfile.TemporaryDirectory(prefix="thunderep-link-") as tmp:
        port, procs, logs = free_port(), [], []
        try:
            for rank in range(world):
                spec = {"rank": rank, "world": world, "port": port, "backend": backend, "sizes": size_list, "op": op,
                        "graph": graph, "iters": iters, "warmup": warmup, "timeout_s": timeout_s,
                        "out": str(Path(tmp) / f"rank{rank}.json")}
                logs.append(Path(tmp) / f"rank{rank}.log")
                with open(logs[-1], "w") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "thunderep.bench.link", "--worker", json.dumps(spec)],
                        env=_env(setting), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            while None in [p.poll() for p in procs]:  # poll() every rank, so returncode is current
                failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    r = failed[0]
                    raise CommError(f"{what}: rank {r} exited with code "
                                    f"{procs[r].returncode}: {_tail(logs[r])}")
                if time.monotonic() > deadline:
                    late = [r for r, p in enumerate(procs) if p.poll() is None]
                    raise PeerTimeout(f"{what}: ranks {late} still running after "
                                      f"--timeout {timeout_s:g} s, killed; rank {late[0]} said: {_tail(logs[late[0]])}",
                                      rank=late[0])
                time.sleep(0.1)
            for r, p in enumerate(procs):
                if p.returncode != 0:
                    raise CommError(f"{what}: rank {r} exited with code "
                                    f"{p.returncode}: {_tail(logs[r])}")
            per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text())["seconds"] for r in range(world)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    return [max(column) for column in zip(*per_rank)]


def _fit_row(world: int, setting: str, size_list: list[int], seconds: list[float], op: str = "all_to_all",
             graph: int = 0) -> dict:
    """The measured times of one (setting, world, op, graph) and their alpha-beta fit. Times that admit no
    fit (flat over the sizes: a latency-bound range) keep their row, with `fit_error` instead of the fit."""
    sent = [s * (world - 1) / world for s in size_list]
    row = {"world": world, "setting": setting, "op": op, "graph": graph, "env": SETTINGS[setting],
           "smallest_us": seconds[0] * 1e6, "largest_GBps": sent[-1] / seconds[-1] / 1e9,
           "points": [{"bytes_per_rank": s, "bytes_sent": x, "seconds": t}
                      for s, x, t in zip(size_list, sent, seconds)]}
    try:
        latency, beta = fit_alpha_beta(sent, seconds)
    except ThunderError as exc:
        return {**row, "fit_error": str(exc)}
    errors = [abs(latency + x / beta - t) / t for x, t in zip(sent, seconds)]
    return {**row, "latency_us": latency * 1e6, "alpha_us": latency * 1e6 / (world - 1), "beta_GBps": beta / 1e9,
            "max_rel_error": max(errors)}


def _op_label(fit: dict) -> str:
    return fit["op"] + (" in graph" if fit.get("graph") else "")


def _hardware(n: int) -> str:
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - the version is only a label
        nccl = "version unknown"
    return f"{n} x {', '.join(names)}, torch {torch.__version__}, NCCL {nccl}"


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def report(a: LinkBench) -> int:
    """The pair copies, then every (setting, world, op) run, its times and fits printed (and written to
    `a.json`); ThunderError without 2 GPUs, or naming the runs that failed once the others have printed."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        raise ThunderError(f"bench link needs 2 or more CUDA GPUs and finds {n} (torch {torch.__version__}, "
                           f"CUDA {torch.version.cuda or 'not built in'}); run it on the multi-GPU machine")
    hardware = _hardware(n)
    print(f"hardware: {hardware}")
    skipped = [f"world {w}: this machine has {n} GPUs" for w in a.worlds if w > n]
    worlds = [w for w in a.worlds if w <= n]
    for note in skipped:
        print(f"skipped {note}")
    pairs = _pairs(n, a.pair_mib)
    fits, failures = _measure_runs(a, worlds)
    _print_times(a, fits)
    _print_fits(fits)
    if a.json:
        out = {"tool": "thunderep bench link", "hardware": hardware,
               "timing": "barrier, synchronize, one collective, synchronize; median over "
                         f"{a.iters} iterations after {a.warmup}, slowest rank",
               "fit": "t = latency + bytes_sent / beta, least squares on relative error; "
                      "alpha_us = latency_us / (world - 1)",
               "fits": fits, "skipped": skipped, "failures": failures,
               "pairs": [{"src": c.src, "dst": c.dst, "nbytes": c.nbytes, "peer_access": c.peer_access,
                          "peer_gbps": c.peer_gbps, "via_host_gbps": c.via_host_gbps, "error": c.error}
                         for c in pairs]}
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    if failures:
        raise ThunderError(f"{len(failures)} of {len(failures) + len(fits)} runs failed (the others are above): "
                           + "; ".join(failures))
    return 0


def _pairs(n: int, pair_mib: int) -> list:
    """Peer copy vs host-staged copy for every ordered pair of the n GPUs (the doctor's measurement), printed."""
    pairs = [doctor_gpu.measure_pair(torch, i, j, pair_mib << 20) for i, j in permutations(range(n), 2)]
    print(f"\nGPU copies, {pair_mib} MiB, best of 5 (thunderep doctor's measurement):")
    print(f"{'src -> dst':>10} | {'peer access':>11} | {'peer copy GB/s':>14} | {'via host GB/s':>13} | {'ratio':>6}")
    for c in pairs:
        if c.error:
            print(f"{c.src:>3} -> {c.dst:<3} | {'yes' if c.peer_access else 'no':>11} | failed: {c.error}")
        else:
            print(f"{c.src:>3} -> {c.dst:<3} | {'yes' if c.peer_access else 'no':>11} | {c.peer_gbps:14.2f} | "
                  f"{c.via_host_gbps:13.2f} | {c.peer_gbps / c.via_host_gbps:5.2f}x")
    return pairs


def _measure_runs(a: LinkBench, worlds: list[int]) -> tuple[list[dict], list[str]]:
    """Every (setting, world, op, graph) run: the fitted rows of those that measured, and the errors of
    those that failed (the others still run)."""
    fits, failures = [], []
    for setting in a.settings:
        for world in worlds:
            size_list = sizes(a.min_bytes, a.max_bytes, world)
            for op in a.ops:  # the ops of one (setting, world) next to each other: drift hits them alike
                for graph in (0, a.graph) if a.graph else (0,):
                    started = time.perf_counter()
                    try:
                        seconds = measure_world(world, setting, size_list, iters=a.iters, warmup=a.warmup,
                                                timeout_s=a.timeout, op=op, graph=graph)
                    except ThunderError as exc:  # the other runs' times still print; the exit code says it
                        failures.append(str(exc))
                        print(f"failed: {exc}", flush=True)
                        continue
                    fits.append(_fit_row(world, setting, size_list, seconds, op, graph))
                    print(f"measured {_op_label(fits[-1])}, {setting}, {world} GPUs: {len(size_list)} sizes in "
                          f"{time.perf_counter() - started:.1f} s", flush=True)
    return fits, failures


def _print_times(a: LinkBench, fits: list[dict]) -> None:
    def label(f: dict) -> str:
        return f"{f['setting']} R={f['world']}" + ("" if len(a.ops) == 1 and not a.graph else f" {_op_label(f)}")

    width = max(16, *(len(label(f)) for f in fits)) if fits else 16
    graphed = f" (and in CUDA graphs of {a.graph})" if a.graph else ""
    print(f"\nNCCL {', '.join(a.ops)}{graphed}: exposed time of one collective (median over iterations, "
          "slowest rank), us:")
    print(f"{'bytes/rank':>10} | " + " | ".join(f"{label(f):>{width}}" for f in fits))
    for i in range(max((len(f["points"]) for f in fits), default=0)):
        cells = [f"{f['points'][i]['seconds'] * 1e6:{width}.1f}" if i < len(f["points"]) else " " * width
                 for f in fits]
        size = next(f["points"][i]["bytes_per_rank"] for f in fits if i < len(f["points"]))
        print(f"{_bytes(size):>10} | " + " | ".join(cells))


def _print_fits(fits: list[dict]) -> None:
    print("\nfit t = latency + sent / beta (least squares on relative error), sent = S (R - 1) / R bytes per rank;"
          "\nalpha = latency / (R - 1) per message; `thunderep project --link` uses the all_to_all rows:")
    print(f"{'op':<23} | {'setting':<12} | {'GPUs':>4} | {'latency us':>10} | {'alpha us':>8} | {'beta GB/s':>9} | "
          f"{'smallest us':>11} | {'largest GB/s':>12} | {'max fit err':>11}")
    for f in fits:
        head = f"{_op_label(f):<23} | {f['setting']:<12} | {f['world']:>4} | "
        tail = f"{f['smallest_us']:11.1f} | {f['largest_GBps']:12.2f} | "
        if "fit_error" in f:
            print(head + f"{'-':>10} | {'-':>8} | {'-':>9} | " + tail + f"{'-':>11}   no fit: {f['fit_error']}")
        else:
            print(head + f"{f['latency_us']:10.1f} | {f['alpha_us']:8.1f} | {f['beta_GBps']:9.2f} | " + tail
                  + f"{100 * f['max_rel_error']:10.1f}%")


if __name__ == "__main__":  # one rank, started by measure_world: python -m thunderep.bench.link --worker SPEC
    raise SystemExit(_worker(json.loads(sys.argv[2])))
