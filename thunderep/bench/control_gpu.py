"""GPU control-plane latency, side by side in one run: GPU-written mailbox vs NCCL.

    python -m thunderep.bench.control_gpu [--worlds 2 4] [--sizes 8 256] [--markdown] [--json FILE]

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

import argparse
import functools
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from ..errors import CommError

__all__ = ["check_rows", "format_table", "main", "preflight", "record_values", "rows_from_records", "run",
           "summarize"]

METHODS = ("mailbox", "one_way", "all_gather_copy", "all_gather_sync", "all_to_all_copy", "all_to_all_sync")
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
_NCCL_METHODS = {  # method: (all_to_all rather than all_gather, ends with the copy to the host)
    "all_gather_copy": (False, True), "all_gather_sync": (False, False),
    "all_to_all_copy": (True, True), "all_to_all_sync": (True, False),
}
_TAG_SHIFT, _RANK_SHIFT = 32, 20
_MAX_SLOT = 1 << 20


@dataclass(frozen=True)
class _Plan:
    """What every rank runs: record sizes in bytes, timed calls per block, blocks, warm-up calls,
    and the bound on every wait (mailbox collect and NCCL process group)."""

    sizes: tuple[int, ...]
    iters: int
    blocks: int
    warmup: int
    timeout_s: float


# ---------------------------------------------------------------- records and statistics (pure)

def record_values(tag: int, rank: int, words: int) -> torch.Tensor:
    """Rank `rank`'s record for `tag`: int64[words], word j = tag * 2**32 + rank * 2**20 + j."""
    assert 0 <= tag < 1 << 31 and 0 <= rank < 1 << 12 and 0 <= words <= 1 << _RANK_SHIFT
    return torch.arange(words, dtype=torch.int64) + ((tag << _TAG_SHIFT) + (rank << _RANK_SHIFT))


@functools.lru_cache(maxsize=16)
def _records_at_zero(world: int, words: int) -> torch.Tensor:
    return torch.stack([record_values(0, r, words) for r in range(world)])


def _describe(value: int) -> str:
    return (f"tag {value >> _TAG_SHIFT}, rank {(value >> _RANK_SHIFT) & 0xFFF}, "
            f"word {value & ((1 << _RANK_SHIFT) - 1)}")


def rows_from_records(records: list[bytes], words: int) -> torch.Tensor:
    """Mailbox records (one bytes object per rank) -> int64 [R, W]; raises CommError on a wrong length."""
    for r, rec in enumerate(records):
        if len(rec) != 8 * words:
            raise CommError(f"rank {r}'s record has {len(rec)} bytes, expected {8 * words}")
    return torch.frombuffer(bytearray(b"".join(records)), dtype=torch.int64).view(len(records), words)


def check_rows(rows_RW: torch.Tensor, tag: int, what: str) -> None:
    """Raise CommError unless row r of `rows_RW` (int64 [R, W], CPU) is rank r's record for `tag`."""
    world, words = rows_RW.shape
    expected_RW = _records_at_zero(world, words) + (tag << _TAG_SHIFT)
    if torch.equal(rows_RW, expected_RW):
        return
    r, j = (int(i) for i in (rows_RW != expected_RW).nonzero()[0])
    found, want = int(rows_RW[r, j]), int(expected_RW[r, j])
    kind = "stale" if 0 <= found >> _TAG_SHIFT < tag and found & ((1 << _TAG_SHIFT) - 1) == want & (
        (1 << _TAG_SHIFT) - 1) else "wrong"
    raise CommError(f"{what}: {kind} record from rank {r} for tag {tag}: word {j} is {found:#x} "
                    f"({_describe(found)}), expected {want:#x}")


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


# ---------------------------------------------------------------- one rank

def _clock_us(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e3


class _RankBench:
    """One rank's timed calls. Every method returns (latencies in us, [(tag, result)]); results are
    checked after the block, outside the timed region."""

    def __init__(self, rank: int, world: int, mailbox: Any, writer: Any, stream: torch.cuda.Stream):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.mailbox, self.writer, self.stream = mailbox, writer, stream
        self.device = torch.device("cuda", rank)
        self.round = mailbox.last_round  # mailbox rounds; every record of round n carries tag n
        self.tag = 0  # NCCL calls' tags
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._all_to_all = dist.all_to_all_single
        self.words = 0
        self.enqueue_us: list[float] = []  # the last mailbox_exchange's write() calls

    def barrier(self) -> None:
        self.round += 1
        self.mailbox.exchange(self.round, b"")

    def prepare(self, size: int) -> None:
        W, R = size // 8, self.world
        self.words = W
        self.pattern_host_W = record_values(0, self.rank, W)
        self.pattern_W = self.pattern_host_W.to(self.device)
        self.record_W = torch.empty_like(self.pattern_W)
        self.pattern_RW = self.pattern_W.repeat(R)  # all_to_all: this rank's record to every rank
        self.send_RW = torch.empty_like(self.pattern_RW)
        self.out_RW = torch.empty(R * W, dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)

    def _stage(self, dst: torch.Tensor, pattern: torch.Tensor, tag: int) -> None:
        torch.add(pattern, tag << _TAG_SHIFT, out=dst)
        self.stream.synchronize()

    def _host_record(self, tag: int) -> bytes:
        return (self.pattern_host_W + (tag << _TAG_SHIFT)).numpy().tobytes()

    # -- the timed calls

    def mailbox_exchange(self, n: int) -> tuple[list[float], list]:
        xs, kept, self.enqueue_us = [], [], []
        for _ in range(n):
            rnd = self.round = self.round + 1
            self._stage(self.record_W, self.pattern_W, rnd)
            t0 = time.perf_counter_ns()
            self.writer.write(rnd, self.record_W, stream=self.stream)
            self.enqueue_us.append(_clock_us(t0))
            records = self.mailbox.collect(rnd)
            xs.append(_clock_us(t0))
            kept.append((rnd, records))
        return xs, kept

    def ping_pong(self, n: int) -> tuple[list[float], list]:
        """Rank 0 times n round trips with rank 1 (world 2); one-way latencies on rank 0, none on rank 1."""
        assert self.world == 2
        mb, writer, stream = self.mailbox, self.writer, self.stream
        xs, kept = [], []
        if self.rank == 1:
            mb.publish(self.round + 1, self._host_record(self.round + 1))
        for i in range(n):
            a, b = self.round + 1, self.round + 2  # a: rank 0 -> rank 1, b: rank 1 -> rank 0
            if self.rank == 0:
                own_b = self._host_record(b)
                self._stage(self.record_W, self.pattern_W, a)
                t0 = time.perf_counter_ns()
                writer.write(a, self.record_W, stream=stream)
                got_a = mb.collect(a)  # rank 1's record of round a is there already
                mb.publish(b, own_b)
                got_b = mb.collect(b)  # waits for rank 1's GPU
                xs.append(_clock_us(t0) / 2)
            else:
                torch.add(self.pattern_W, b << _TAG_SHIFT, out=self.record_W)  # ordered before the write
                got_a = mb.collect(a)  # waits for rank 0's GPU
                writer.write(b, self.record_W, stream=stream)
                own_next = self._host_record(b + 1) if i + 1 < n else None
                got_b = mb.collect(b)
                if own_next is not None:
                    mb.publish(b + 1, own_next)
            kept += [(a, got_a), (b, got_b)]
            self.round = b
        return xs, kept

    def nccl(self, n: int, all_to_all: bool, copy: bool) -> tuple[list[float], list]:
        src, pattern = (self.send_RW, self.pattern_RW) if all_to_all else (self.record_W, self.pattern_W)
        collective = self._all_to_all if all_to_all else self._gather
        out = self.out_RW
        xs, kept = [], []
        for _ in range(n):
            tag = self.tag = self.tag + 1
            self._stage(src, pattern, tag)
            t0 = time.perf_counter_ns()
            collective(out, src)
            if copy:
                result = out.cpu()  # copies on this stream, after the collective, and waits for it
                xs.append(_clock_us(t0))
            else:
                self.stream.synchronize()
                xs.append(_clock_us(t0))
                result = out.clone()  # checked later; the next call overwrites `out`
            kept.append((tag, result))
        return xs, kept

    def run(self, method: str, n: int) -> list[float]:
        if method == "mailbox":
            xs, kept = self.mailbox_exchange(n)
        elif method == "one_way":
            xs, kept = self.ping_pong(n)
        else:
            all_to_all, copy = _NCCL_METHODS[method]
            xs, kept = self.nccl(n, all_to_all=all_to_all, copy=copy)
        what = f"{method} ({self.words * 8} B) on rank {self.rank}"
        for tag, result in kept:
            if isinstance(result, list):
                rows = rows_from_records(result, self.words)
            else:
                rows = result.cpu().view(self.world, self.words)
            check_rows(rows, tag, what)
        return xs


def _gpu_info(world: int) -> dict[str, Any]:
    import cupy

    nccl = torch.cuda.nccl.version()
    driver = int(cupy.cuda.runtime.driverGetVersion())
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus_visible": torch.cuda.device_count(),
        "peer_access": all(torch.cuda.can_device_access_peer(0, r) for r in range(1, world)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "cupy": cupy.__version__,
        "driver_cuda": f"{driver // 1000}.{driver % 1000 // 10}",
    }


def _measure(rank: int, world: int, port: int, plan: _Plan) -> tuple[dict[str, list[float]], dict | None]:
    import torch.distributed as dist

    from ..comm.control import make_control_plane
    from ..comm.mailbox_cuda import CudaMailboxWriter

    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=plan.timeout_s), device_id=device)
    stream = torch.cuda.Stream(device)
    samples: dict[str, list[float]] = {}
    methods = [m for m in METHODS if m != "one_way" or world == 2]
    with (torch.cuda.stream(stream),
          make_control_plane("mailbox", record_bytes=max(plan.sizes), timeout_s=plan.timeout_s) as cp,
          CudaMailboxWriter(cp.mailbox, device=rank) as writer):  # closed before the mailbox
        bench = _RankBench(rank, world, cp.mailbox, writer, stream)
        for size in plan.sizes:
            bench.prepare(size)
            for method in methods:  # warm up (and compile the write kernel), checked like the rest
                bench.barrier()
                bench.run(method, plan.warmup)
            for _ in range(plan.blocks):
                for method in methods:
                    bench.barrier()
                    samples.setdefault(f"{method}/{size}", []).extend(bench.run(method, plan.iters))
                    if method == "mailbox":  # the host's part: until write() has enqueued the kernel
                        samples.setdefault(f"mailbox_enqueue/{size}", []).extend(bench.enqueue_us)
        bench.barrier()
        info = _gpu_info(world) if rank == 0 else None
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
    return samples, info


def _child_env(p2p: str) -> dict[str, str | None]:
    """Variables each rank sets before CUDA and NCCL start (None: unset). NVLink multicast stays off."""
    return {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "NCCL_P2P_DISABLE": "1" if p2p == "disabled" else None}


def _rank_main(rank: int, world: int, port: int, env: dict[str, str | None], plan: _Plan,
               results: Any) -> None:
    try:
        for key, value in env.items():  # NCCL reads these when it initializes, below
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.cuda.set_device(rank)  # before any other CUDA call
        samples, info = _measure(rank, world, port, plan)
        results.put((rank, samples, info))
    except BaseException as exc:  # reported by the parent
        results.put((rank, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}", None))


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


def run(world: int, p2p: str, plan: _Plan, timeout_s: float = 300.0) -> tuple[dict[str, dict], dict | None]:
    """Spawn `world` ranks with NCCL setting `p2p` ("default" | "disabled"); return
    ({"method/size": summary}, GPU info from rank 0). Raises CommError when a rank fails, exits or the
    whole run exceeds `timeout_s`; every rank is then killed."""
    if p2p not in P2P_SETTINGS:
        raise CommError(f"NCCL P2P setting ({p2p!r}) must be one of {P2P_SETTINGS}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env = _child_env(p2p)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, env, plan, results), daemon=True)
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
    import torch.distributed as dist

    from ..comm.mailbox import native_unavailable_reason

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


def main(argv: list[str] | None = None) -> int:
    from .control import hardware_line

    ap = argparse.ArgumentParser(prog="thunderep bench control-gpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run (one GPU each)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 256], help="record bytes (multiples of 8)")
    ap.add_argument("--nccl-p2p", nargs="+", choices=P2P_SETTINGS, default=list(P2P_SETTINGS),
                    help="NCCL settings to run: default, and disabled (NCCL_P2P_DISABLE=1)")
    ap.add_argument("--iters", type=int, default=2000, help="timed calls per block, method and rank")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks per method")
    ap.add_argument("--warmup", type=int, default=100, help="untimed calls per method and size")
    ap.add_argument("--peer-timeout", type=float, default=60.0,
                    help="seconds any rank waits for a peer (mailbox and NCCL) before raising")
    ap.add_argument("--run-timeout", type=float, default=300.0,
                    help="seconds one run (process start to exit) may take before its ranks are killed")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--json", help="also write the statistics to this file")
    args = ap.parse_args(argv)
    for s in args.sizes:
        if s <= 0 or s % 8 or s > _MAX_SLOT:
            ap.error(f"record size ({s}) must be a positive multiple of 8 up to {_MAX_SLOT}")
    if any(w < 2 for w in args.worlds):
        ap.error(f"world sizes ({args.worlds}) must be at least 2")
    if min(args.iters, args.blocks, args.warmup) < 1:
        ap.error("--iters, --blocks and --warmup must be at least 1")
    if not (0 < args.peer_timeout < float("inf") and 0 < args.run_timeout < float("inf")):
        ap.error(f"--peer-timeout ({args.peer_timeout}) and --run-timeout ({args.run_timeout}) must be positive "
                 "seconds")
    reason = preflight()
    if reason is not None:
        print(f"thunderep bench control-gpu: {reason}", file=sys.stderr)
        return 2
    count = torch.cuda.device_count()
    notes = [f"skipped {w} ranks: only {count} CUDA devices are visible" for w in args.worlds if w > count]
    worlds = [w for w in dict.fromkeys(args.worlds) if w <= count]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not worlds:
        print(f"thunderep bench control-gpu: no world size fits the {count} visible GPUs", file=sys.stderr)
        return 2
    plan = _Plan(sizes=tuple(args.sizes), iters=args.iters, blocks=args.blocks, warmup=args.warmup,
                 timeout_s=args.peer_timeout)
    runs, info = [], None
    for world in worlds:
        for p2p in args.nccl_p2p:
            t0 = time.perf_counter()
            stats, rank0_info = run(world, p2p, plan, timeout_s=args.run_timeout)
            runs.append({"world": world, "nccl_p2p": p2p, "stats": stats})
            info = info or rank0_info
            print(f"[{world} ranks, NCCL P2P {p2p}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    print(_gpu_line(info))
    print(hardware_line())
    for note in notes:
        print(f"note: {note}")
    print(format_table(runs, args.sizes, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": info, "hardware": hardware_line(), "notes": notes, "plan": asdict(plan),
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
