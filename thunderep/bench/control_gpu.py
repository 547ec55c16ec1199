"""GPU control-plane latency, side by side in one run: GPU-written mailbox vs NCCL.

    thunderep bench control-gpu [--worlds 2 4] [--sizes 8 256] [--markdown] [--json FILE]

For every world size R (at most the visible GPUs) and every NCCL setting ("default", and "disabled":
NCCL_P2P_DISABLE=1, standing in for a consumer box without GPU peer-to-peer), R processes are spawned,
rank r on cuda:r, with one NCCL process group and one mailbox control plane. A rank's record is
int64[W], W = size / 8, on its GPU; word j of rank r's record for tag t is t * 2**32 + r * 2**20 + j,
and every record a method delivers is checked against that: a wrong or stale one raises. Each rank
times:
  * mailbox         - `CudaMailboxWriter.write(round, record)` then `Mailbox.collect(round)`: from before
                      the write is enqueued until every rank's record is on this host; the table also
                      gives the part until `write()` returns (the host's cost of enqueueing it);
  * one_way         - 2 ranks: ping-pong, half the round trip. Rank 0's GPU writes round n, rank 1's host
                      sees it and its GPU writes round n + 1, rank 0's host sees that. The mailbox
                      collects a round only once every rank has a record in it, so the receiving rank
                      publishes its record of a round from the CPU beforehand (no GPU time involved);
  * all_gather_copy - NCCL all_gather of the record (int64[W] -> int64[R * W]), then `.cpu()`;
  * all_gather_sync - the same, ending at stream synchronization (no copy to the host);
  * all_to_all_copy - NCCL all_to_all_single of counts, int64[R * W] -> int64[R * W] (each rank receives
                      R * size bytes, as from the mailbox), then `.cpu()`;
  * all_to_all_sync - the same, ending at stream synchronization.
Every timed call starts from an idle stream (the record is staged and the stream synchronized before
the clock starts). The `_copy` methods end where the runtime can read split sizes on the host, as the
mailbox does. Methods alternate in blocks so drift affects them alike; latencies of all ranks are
pooled (ping-pong: rank 0's), and the table gives median / p99 per call and each NCCL median over the
mailbox median. Needs CUDA GPUs, NCCL and cupy (`pip install 'thunderep[cuda]'`).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from ..comm.mailbox import native_unavailable_reason
from ..errors import CommError
from .control import hardware_line
from .control_gpu_rank import METHODS, Plan, rank_main

__all__ = ["COLUMNS", "HEADINGS", "MAX_SLOT", "P2P_SETTINGS", "format_table", "preflight", "report", "run",
           "summarize"]

COLUMNS = ("mailbox", "mailbox_enqueue") + METHODS[1:]
HEADINGS = {
    "mailbox": "mailbox (GPU write -> host)",
    "mailbox_enqueue": "of which write() call",
    "one_way": "mailbox one-way (ping-pong / 2)",
    "all_gather_copy": "all_gather + .cpu()",
    "all_gather_sync": "all_gather, sync",
    "all_to_all_copy": "all_to_all + .cpu()",
    "all_to_all_sync": "all_to_all, sync",
}
P2P_SETTINGS = ("default", "disabled")
MAX_SLOT = 1 << 20  # the largest record size in bytes


def summarize(xs: list[float]) -> dict[str, float]:
    """Median, p99 (the value below which 99% of the sorted samples lie) and count of `xs`."""
    s = sorted(xs)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return {"median_us": round(statistics.median(s), 3), "p99_us": round(p99, 3), "n": len(s)}


def format_table(runs: list[dict[str, Any]], sizes: list[int], markdown: bool) -> str:
    """One row per (ranks, record size, NCCL setting); cells "median / p99" in us, NCCL cells with their
    median over the mailbox median. runs: [{"world", "nccl_p2p", "stats": {"method/size": summary}}]."""
    head = ["ranks", "record", "NCCL P2P"] + [HEADINGS[m] for m in COLUMNS]
    rows = []
    for world in sorted({run["world"] for run in runs}):
        for size in sizes:
            for run in (r for r in runs if r["world"] == world):
                stats = run["stats"]
                base = stats[f"mailbox/{size}"]["median_us"]
                row = [str(world), f"{size} B", run["nccl_p2p"]]
                for method in COLUMNS:
                    s = stats.get(f"{method}/{size}")
                    if s is None:
                        row.append("-")
                        continue
                    cell = f"{s['median_us']:.1f} / {s['p99_us']:.1f}"
                    if method.startswith("all_"):
                        cell += f" ({s['median_us'] / base:.1f}x)"
                    row.append(cell)
                rows.append(row)
    note = ("us per call, median / p99 over all ranks' calls; (Nx) = NCCL median / mailbox median; "
            "one-way: rank 0's ping-pongs, 2 ranks only")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows] + ["", note])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows] + [note])


def _child_env(p2p: str) -> dict[str, str | None]:
    """Variables each rank sets before CUDA and NCCL start (None: unset). NVLink multicast stays off."""
    return {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "NCCL_P2P_DISABLE": "1" if p2p == "disabled" else None}


# ---------------------------------------------------------------- the parent

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list, grace_s: float) -> list[int]:
    """Join every process within `grace_s` in all; kill the ones still alive and return their ranks."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    killed = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in killed:
        procs[r].kill()
        procs[r].join(timeout=5)
    return killed


def run(world: int, p2p: str, plan: Plan, timeout_s: float = 300.0) -> tuple[dict[str, dict], dict | None]:
    """Spawn `world` ranks with NCCL setting `p2p` ("default" | "disabled"); return
    ({"method/size": summary}, GPU info from rank 0). Raises CommError when a rank fails, exits or the
    whole run exceeds `timeout_s`; every rank is then killed."""
    if p2p not in P2P_SETTINGS:
        raise CommError(f"NCCL P2P setting ({p2p!r}) must be one of {P2P_SETTINGS}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env = _child_env(p2p)
    procs = [ctx.Process(target=rank_main, args=(r, world, port, env, plan, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[dict, dict | None]] = {}
    where = f"{world} ranks, NCCL P2P {p2p}"
    ok = False
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < world:
            try:
                rank, value, info = results.get(timeout=1.0)
            except queue.Empty:
                exited = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if exited:
                    raise CommError(f"benchmark ({where}): ranks exited with codes {exited} before "
                                    f"reporting") from None
                if time.monotonic() > deadline:
                    raise CommError(f"benchmark ({where}) timed out after {timeout_s:.0f} s with results "
                                    f"from ranks {sorted(got)}; raise --run-timeout if it is just "
                                    f"slow") from None
                continue
            if isinstance(value, str):
                raise CommError(f"benchmark ({where}) failed:\n{value}")
            got[rank] = (value, info)
        ok = True
    finally:
        killed = _stop(procs, grace_s=60.0 if ok else 2.0)
    if killed:
        raise CommError(f"benchmark ({where}): ranks {killed} did not exit within 60 s after reporting; "
                        f"killed them")
    pooled: dict[str, list[float]] = {}
    for samples, _ in got.values():
        for key, xs in samples.items():
            pooled.setdefault(key, []).extend(xs)
    return {key: summarize(xs) for key, xs in pooled.items()}, got[0][1]


def _have_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None


def preflight(min_gpus: int = 2) -> str | None:
    """Why this benchmark cannot run here (one line), or None when it can."""
    if not torch.cuda.is_available():
        return (f"needs CUDA GPUs, but torch {torch.__version__} sees none (torch's CUDA: "
                f"{torch.version.cuda or 'none, a CPU-only build'}); run it on a machine with NVIDIA GPUs")
    count = torch.cuda.device_count()
    if count < min_gpus:
        return f"needs at least {min_gpus} CUDA GPUs, but {count} is visible"
    if not (dist.is_available() and dist.is_nccl_available()):
        return f"needs torch.distributed with NCCL, which torch {torch.__version__} lacks"
    if not _have_cupy():
        return "needs cupy for the GPU-written mailbox: `pip install 'thunderep[cuda]'` (cupy-cuda12x)"
    reason = native_unavailable_reason()
    return None if reason is None else reason.replace("\n", " ")


def _gpu_line(info: dict[str, Any]) -> str:
    return (f"GPU: {info['gpu']} ({info['gpus_visible']} visible, peer access among ranks: "
            f"{'yes' if info['peer_access'] else 'no'}); torch {info['torch']}, CUDA {info['cuda']} "
            f"(driver {info['driver_cuda']}), NCCL {info['nccl']}, cupy {info['cupy']}")


def report(plan: Plan, worlds: list[int], p2p_settings: list[str], *, run_timeout: float = 300.0,
           markdown: bool = False, json_path: str | None = None) -> int:
    """Run every (world size, NCCL setting) that fits the visible GPUs and print the table; 2 (with the
    reason on stderr) where the benchmark cannot run here."""
    reason = preflight()
    if reason is not None:
        print(f"thunderep bench control-gpu: {reason}", file=sys.stderr)
        return 2
    count = torch.cuda.device_count()
    notes = [f"skipped {w} ranks: only {count} CUDA devices are visible" for w in worlds if w > count]
    fit = [w for w in dict.fromkeys(worlds) if w <= count]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not fit:
        print(f"thunderep bench control-gpu: no world size fits the {count} visible GPUs", file=sys.stderr)
        return 2
    runs, info = [], None
    for world in fit:
        for p2p in p2p_settings:
            t0 = time.perf_counter()
            stats, rank0_info = run(world, p2p, plan, timeout_s=run_timeout)
            runs.append({"world": world, "nccl_p2p": p2p, "stats": stats})
            info = info or rank0_info
            print(f"[{world} ranks, NCCL P2P {p2p}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    print(_gpu_line(info))
    print(hardware_line())
    for note in notes:
        print(f"note: {note}")
    print(format_table(runs, list(plan.sizes), markdown))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"gpu": info, "hardware": hardware_line(), "notes": notes, "plan": asdict(plan),
                       "runs": runs}, f, indent=1)
    return 0
