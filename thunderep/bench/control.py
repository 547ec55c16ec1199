"""Control-plane latency, side by side in one run: mailbox vs gloo all_gather vs gloo all_to_all_single.

    thunderep bench control [--worlds 2 4] [--sizes 8 256] [--pin] [--markdown]

For each world size, that many processes are spawned on this host with a gloo process group. Each
rank times every call of:
  * mailbox    - `MailboxControlPlane.exchange(record)` (the product path, Python overhead included);
  * all_gather - gloo `all_gather_single` of the same record (uint8[size] -> uint8[R * size]);
  * all_to_all - gloo `all_to_all_single` of counts: int64[R * size / 8] in, each rank receiving
                 `size` bytes from every rank (how split sizes are usually exchanged).
Methods alternate in blocks so drift affects them alike; latencies of all ranks are pooled, and the
table gives median and p99 per call and the ratio of each gloo median to the mailbox median.
`--pin` binds rank r to core r mod cores (all methods alike), so that the scheduler cannot stack the
ranks on one core.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm.control import make_control_plane

__all__ = ["hardware_line", "report", "run"]

METHODS = ("mailbox", "all_gather", "all_to_all")


def hardware_line() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"CPU: {model}, {os.cpu_count()} logical cores; Linux {platform.release()}; "
            f"Python {platform.python_version()}; torch {torch.__version__}")


def _time_calls(fn, iters: int) -> list[float]:
    out = [0.0] * iters
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        fn()
        out[i] = (clock() - t0) / 1e3
    return out


def _rank_main(rank: int, world: int, port: int, sizes: list[int], iters: dict[str, int], blocks: int,
               backoff: tuple[float, float, float] | None, pin: bool, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    if pin and hasattr(os, "sched_setaffinity"):  # rank r on core r mod cores, for every method alike
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        samples: dict[str, list[float]] = {}
        with make_control_plane("mailbox", record_bytes=max(sizes)) as cp:
            if backoff is not None:
                cp.mailbox.set_backoff(spin_us=backoff[0], yield_us=backoff[1], sleep_max_us=backoff[2])
            for size in sizes:
                record = bytes([rank]) * size
                src = torch.full((size,), rank, dtype=torch.uint8)
                dst = torch.empty(world * size, dtype=torch.uint8)
                counts = torch.full((world * size // 8,), rank, dtype=torch.int64)
                counts_out = torch.empty_like(counts)
                calls = {
                    "mailbox": lambda: cp.exchange(record),
                    "all_gather": lambda: gather(dst, src),
                    "all_to_all": lambda: dist.all_to_all_single(counts_out, counts),
                }
                for method in METHODS:  # warm up, then check the results once
                    _time_calls(calls[method], max(10, iters[method] // 20))
                assert cp.exchange(record) == [bytes([r]) * size for r in range(world)]
                for _ in range(blocks):
                    for method in METHODS:
                        cp.barrier()
                        key = f"{method}/{size}"
                        samples.setdefault(key, []).extend(_time_calls(calls[method], iters[method]))
                        dist.barrier()
        results.put((rank, samples))
        dist.destroy_process_group()
    except BaseException as exc:  # reported by the parent
        results.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(world: int, sizes: list[int], iters: dict[str, int], blocks: int = 2,
        backoff: tuple[float, float, float] | None = None, pin: bool = False,
        timeout_s: float = 600.0) -> dict[str, dict[str, float]]:
    """Spawn `world` ranks and return {"method/size": {"median_us", "p99_us", "n"}}."""
    for s in sizes:
        if s <= 0 or s % 8:
            raise ValueError(f"record size ({s}) must be a positive multiple of 8")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, sizes, iters, blocks, backoff, pin, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, value = results.get(timeout=1.0)
                got[rank] = value
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"benchmark with {world} ranks failed or timed out; "
                                       f"results from ranks {sorted(got)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [v for v in got.values() if isinstance(v, str)]
    if errors:
        raise RuntimeError("\n".join(errors))
    pooled: dict[str, list[float]] = {}
    for value in got.values():
        for key, xs in value.items():  # type: ignore[union-attr]
            pooled.setdefault(key, []).extend(xs)
    stats = {}
    for key, xs in pooled.items():
        xs.sort()
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        stats[key] = {"median_us": statistics.median(xs), "p99_us": p99, "n": len(xs)}
    return stats


def _table(all_stats: dict[int, dict], sizes: list[int], markdown: bool) -> str:
    head = ["ranks", "record", "mailbox median", "mailbox p99", "all_gather median", "all_gather p99",
            "all_to_all median", "all_to_all p99", "all_gather / mailbox", "all_to_all / mailbox"]
    rows = []
    for world, stats in all_stats.items():
        for size in sizes:
            m, g, a = (stats[f"{k}/{size}"] for k in METHODS)
            rows.append([str(world), f"{size} B", f"{m['median_us']:.2f} us", f"{m['p99_us']:.2f} us",
                         f"{g['median_us']:.1f} us", f"{g['p99_us']:.1f} us", f"{a['median_us']:.1f} us",
                         f"{a['p99_us']:.1f} us", f"{g['median_us'] / m['median_us']:.0f}x",
                         f"{a['median_us'] / m['median_us']:.0f}x"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows])


def report(worlds: list[int], sizes: list[int], iters: dict[str, int], *, blocks: int = 3,
           backoff: tuple[float, float, float] | None = None, pin: bool = False, markdown: bool = False,
           json_path: str | None = None) -> int:
    """Run every world size and print the table (`iters`: calls per block and rank for "mailbox",
    "all_gather" and "all_to_all"); also write the raw statistics to `json_path` if given."""
    all_stats = {}
    for world in worlds:
        t0 = time.perf_counter()
        all_stats[world] = run(world, sizes, iters, blocks=blocks, backoff=backoff, pin=pin)
        print(f"[{world} ranks done in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    print(hardware_line())
    print(_table(all_stats, sizes, markdown))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"hardware": hardware_line(), "stats": all_stats}, f, indent=1)
    return 0
