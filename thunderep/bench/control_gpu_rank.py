"""One rank of `thunderep bench control-gpu` (thunderep/bench/control_gpu.py): the records every method
delivers and their checks, and the timed calls of each method on one GPU."""

from __future__ import annotations

import functools
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..comm.control import make_control_plane
from ..comm.mailbox_cuda import CudaMailboxWriter
from ..errors import CommError

__all__ = ["METHODS", "Plan", "check_rows", "rank_main", "record_values", "rows_from_records"]

METHODS = ("mailbox", "one_way", "all_gather_copy", "all_gather_sync", "all_to_all_copy", "all_to_all_sync")
_NCCL_METHODS = {  # method: (all_to_all rather than all_gather, ends with the copy to the host)
    "all_gather_copy": (False, True), "all_gather_sync": (False, False),
    "all_to_all_copy": (True, True), "all_to_all_sync": (True, False),
}
_TAG_SHIFT, _RANK_SHIFT = 32, 20


@dataclass(frozen=True)
class Plan:
    """What every rank runs: record sizes in bytes, timed calls per block, blocks, warm-up calls,
    and the bound on every wait (mailbox collect and NCCL process group)."""

    sizes: tuple[int, ...]
    iters: int
    blocks: int
    warmup: int
    timeout_s: float


# ---------------------------------------------------------------- records (pure)

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


# ---------------------------------------------------------------- one rank

def _clock_us(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e3


class _RankBench:
    """One rank's timed calls. Every method returns (latencies in us, [(tag, result)]); results are
    checked after the block, outside the timed region."""

    def __init__(self, rank: int, world: int, mailbox: Any, writer: Any, stream: torch.cuda.Stream):
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
    import cupy  # cupy: optional (the cuda extra)

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


def _measure(rank: int, world: int, port: int, plan: Plan) -> tuple[dict[str, list[float]], dict | None]:
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


def rank_main(rank: int, world: int, port: int, env: dict[str, str | None], plan: Plan,
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
