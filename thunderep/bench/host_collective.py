"""Host-memory collectives on one GPU, side by side in one run: the floor and the one-shot all-reduce.

    python -m thunderep.bench.host_collective [--sizes 2048,8192,32768,65536] [--calls 50] [--replays 20]
                                              [--markdown] [--json FILE]

1. The floor: two one-thread kernels on two streams ping-pong a counter (release store, acquire spin)
   through the collectives' segment, mapped pinned host memory registered as they register it, and for
   comparison through device memory. One-way = round trip / 2: GPU write -> host memory -> visible to a GPU.
2. The all-reduce (bfloat16, `host_collective.HostCollective`) with 2 ranks as 2 streams sharing the GPU:
   `calls` calls captured in one CUDA graph per rank, both graphs replayed together, us per call (median
   over replays); beside it the same kernel with 1 rank (no peer to wait for), a captured device copy of
   the same bytes (what any one kernel in a graph costs), and the host's time to enqueue one eager call.
NCCL cannot put 2 ranks on one GPU: the comparison with NCCL across GPUs belongs to a multi-GPU run.
Needs CUDA and cupy (`pip install 'thunderep[cuda]'`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.host_collective import HostCollective
from ..comm.host_segment import HostSegment
from . import dataclass_options, parsed
from ..errors import ConfigError

__all__ = ["Options", "format_table", "main", "measure_all_reduce", "measure_floor", "parse", "preflight"]

_PINGPONG = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
extern "C" __global__ void pingpong(u64* mine, const u64* theirs, int iters, int serve, u64 timeout_ns,
                                    int* err) {
    const u64 t0 = now_ns();
    for (u64 i = 1; i <= (u64)iters; ++i) {
        if (serve) asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(mine), "l"(i) : "memory");
        while (true) {
            u64 v; asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(theirs) : "memory");
            if (v >= i) break;
            if (now_ns() - t0 > timeout_ns) { *err = 1; return; }
        }
        if (!serve) asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(mine), "l"(i) : "memory");
    }
}
"""


def preflight() -> str | None:
    """Why this benchmark cannot run here (one line), or None when it can."""
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU, but torch {torch.__version__} sees none"
    if importlib.util.find_spec("cupy") is None:
        return "needs cupy: `pip install 'thunderep[cuda]'`"
    return None


class _Stream:
    """A stream handle as cupy's Function takes it (any object with `ptr`)."""

    def __init__(self, handle: int):
        self.ptr = int(handle)


def _timed_streams(streams: list[torch.cuda.Stream], launch: Callable[[int], None]) -> float:
    """Milliseconds from a start event on stream 0 until every stream has run launch(r) on stream r."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(streams[0])
    for s in streams[1:]:
        s.wait_event(start)
    for r, s in enumerate(streams):
        with torch.cuda.stream(s):
            launch(r)
    for s in streams[1:]:
        done = torch.cuda.Event()
        done.record(s)
        streams[0].wait_event(done)
    end.record(streams[0])
    end.synchronize()
    return start.elapsed_time(end)


def measure_floor(iters: int = 10_000, repeats: int = 5) -> dict[str, float]:
    """Round trip and one-way microseconds of a counter ping-ponged between two streams' kernels, through
    the mapped host segment ("host_*") and through device memory ("device_*"); medians of `repeats`."""
    import cupy as cp  # optional dependency (the cuda extra)

    dev = torch.cuda.current_device()
    streams = [torch.cuda.Stream() for _ in range(2)]
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    with cp.cuda.Device(dev):
        kernel = cp.RawModule(code=_PINGPONG).get_function("pingpong")
    seg = HostSegment.create(2, 4096)
    seg.unlink()
    base, lay = seg.register_cuda(cp, dev), seg.layout
    dmem = torch.zeros(32, dtype=torch.int64, device="cuda")
    places = {"host": [base + lay.flag_offset(r, 0) for r in range(2)],
              "device": [dmem.data_ptr(), dmem.data_ptr() + 128]}
    out = {}
    try:
        for where, ptrs in places.items():
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                ctypes.memset(seg.address + lay.flags_offset, 0, lay.slots_offset - lay.flags_offset)
                dmem.zero_()

                def launch(r: int, ptrs=ptrs) -> None:
                    args = (cp.uint64(ptrs[r]), cp.uint64(ptrs[1 - r]), cp.int32(iters), cp.int32(r == 0),
                            cp.uint64(10**10), cp.uint64(err.data_ptr()))
                    with cp.cuda.Device(dev):
                        kernel((1,), (1,), args, stream=_Stream(torch.cuda.current_stream().cuda_stream))

                times.append(_timed_streams(streams, launch) * 1e3 / iters)
            if err.item():
                raise RuntimeError(f"the {where} ping-pong timed out: do the two streams' kernels run at once?")
            out[f"{where}_round_trip_us"] = statistics.median(times)
            out[f"{where}_one_way_us"] = out[f"{where}_round_trip_us"] / 2
        return out
    finally:
        torch.cuda.synchronize()
        seg.unregister_cuda(cp)
        seg.close()


def _graph_us(fns: list[Callable[[], Any]], streams: list[torch.cuda.Stream], calls: int, replays: int) -> float:
    """Microseconds per call: rank r's `calls` calls of fns[r] in one CUDA graph per rank, all ranks' graphs
    replayed together (median over replays, the first two left out)."""
    _timed_streams(streams, lambda r: fns[r]())  # eager warm-up, every rank at once
    graphs = [torch.cuda.CUDAGraph() for _ in fns]
    for r, g in enumerate(graphs):
        with torch.cuda.graph(g, stream=streams[r]):
            for _ in range(calls):
                fns[r]()
    times = [_timed_streams(streams, lambda r: graphs[r].replay()) * 1e3 / calls for _ in range(replays + 2)]
    return statistics.median(times[2:])


def _eager_us(fns: list[Callable[[], Any]], streams: list[torch.cuda.Stream], n: int = 200) -> float:
    """Host microseconds to enqueue one eager call (every rank's calls alternating)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                fns[r]()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    return seconds * 1e6 / (n * len(fns))


def measure_all_reduce(sizes: list[int], calls: int, replays: int) -> list[dict[str, float]]:
    """Per size in bytes: us per all-reduce with 2 ranks and with 1, a device copy, the eager enqueue."""
    rows = []
    cap = max(sizes)
    segs = {w: HostSegment.create(w, cap) for w in (1, 2)}
    for seg in segs.values():
        seg.unlink()
    hcs: dict[int, list[HostCollective]] = {1: [], 2: []}
    streams = [torch.cuda.Stream() for _ in range(2)]
    try:
        for w, group in hcs.items():
            group.extend(HostCollective(segs[w], r, timeout_s=10.0) for r in range(w))
        for size in sizes:
            bufs = [torch.zeros(size // 2, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            dst = torch.empty_like(bufs[0])
            two = [lambda r=r: hcs[2][r].all_reduce_(bufs[r]) for r in range(2)]
            row = {"bytes": size, "two_ranks_us": _graph_us(two, streams, calls, replays),
                   "one_rank_us": _graph_us([lambda: hcs[1][0].all_reduce_(bufs[0])], streams[:1], calls, replays),
                   "device_copy_us": _graph_us([lambda: dst.copy_(bufs[0])], streams[:1], calls, replays),
                   "eager_enqueue_us": _eager_us(two, streams)}
            for group in hcs.values():
                for hc in group:
                    hc.check()
            rows.append(row)
        return rows
    finally:
        for group in hcs.values():
            for hc in group:
                hc.close()
        for seg in segs.values():
            seg.close()


def format_table(floor: dict[str, float], rows: list[dict[str, float]], markdown: bool) -> str:
    """The floor in one line, then one row per size: us per call and the 2-rank all-reduce over the floor."""
    note = (f"floor: ping-pong through mapped host memory {floor['host_round_trip_us']:.2f} us round trip, "
            f"{floor['host_one_way_us']:.2f} us one-way; through device memory "
            f"{floor['device_round_trip_us']:.2f} us round trip")
    head = ["bytes", "all-reduce, 2 ranks (graph)", "1 rank, no peer", "device copy (graph)",
            "2 ranks / host round trip", "eager enqueue (host)"]
    body = [[str(r["bytes"]), f"{r['two_ranks_us']:.2f}", f"{r['one_rank_us']:.2f}", f"{r['device_copy_us']:.2f}",
             f"{r['two_ranks_us'] / floor['host_round_trip_us']:.2f}x", f"{r['eager_enqueue_us']:.1f}"]
            for r in rows]
    unit = "us per call (medians), bfloat16 data; 2 ranks = 2 streams of one process on one GPU"
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join([note, "", *lines, *("| " + " | ".join(b) + " |" for b in body), "", unit])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([note, fmt.format(*head), *(fmt.format(*b) for b in body), unit])


@dataclass(frozen=True)
class Options:
    """What `main` measures: `sizes` in bytes per rank (even: bfloat16 data), `calls` per captured graph."""

    sizes: tuple[int, ...] = (2048, 8192, 32768, 65536)
    calls: int = 50
    replays: int = 20
    markdown: bool = False
    json: str = ""


def parse(argv: list[str]) -> Options:
    """`Options` from `--name value` options (`--sizes` comma-separated; `--markdown` bare); ConfigError."""
    opts = Options(**dataclass_options(Options, argv))
    if not opts.sizes or any(n <= 0 or n % 2 for n in opts.sizes) or opts.calls < 1 or opts.replays < 1:
        raise ConfigError(f"--sizes {opts.sizes}: positive even byte counts; --calls, --replays: 1 or more")
    return opts


def main(argv: list[str] | None = None) -> int:
    """`python -m thunderep.bench.host_collective [options]`: 0 when run (or --help), 2 otherwise."""
    opts, code = parsed(argv, __doc__, parse, "host_collective")
    if code is not None:
        return code
    reason = preflight()
    if reason:
        print(f"host collective benchmark: {reason}", file=sys.stderr)
        return 2
    floor = measure_floor()
    rows = measure_all_reduce(list(opts.sizes), opts.calls, opts.replays)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(format_table(floor, rows, opts.markdown))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "floor": floor, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
