"""Probe: a decode step's small all-reduce through mapped pinned host memory, against NCCL, both inside
CUDA graphs, on the GPUs of one host. It measures whether the idea pays before any of it is built.

    NCCL_P2P_DISABLE=1 python examples/host_allreduce_probe.py --world 2 --sizes 8192,32768,65536

Latency mode all-reduces each MoE layer's [tokens, hidden] output at every decode step: 8 to 64 KiB.
Without GPU peer-to-peer NCCL stages it through host memory and takes 15-20 us inside a CUDA graph on
2 H200s (docs/BENCHMARKS.md, "The link between the 2 H200s"). Here every rank's GPU instead writes its
data into its own slot of one shared host segment (POSIX shared memory, registered with CUDA as
mapped pinned memory), raises its flag, waits for every other rank's flag, and sums the ranks' slots
in rank order (so every rank gets the same bits). One kernel, one thread block; a device counter
numbers the calls, so graph replays need no host; slots alternate by the call's parity, so a slot is
rewritten only after every rank has finished reading it. A rank that waits more than `--timeout-ms`
for a flag sets an error flag and stops waiting: the probe then reports a timeout, not a hang.

Float32 data (the kernel needs no bfloat16 header). Every call's result is checked against the sum.
Needs cupy (the `cuda` extra) and at least `--world` GPUs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FLAG_LINES = 64  # one 64-byte line per rank's flag, before the data slots
ITERS = 50  # all-reduces per captured graph (the ranks' skew at a replay's start spreads over them)

_SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

extern "C" __global__ void host_allreduce(const float* __restrict__ x, float* __restrict__ out, int n4,
                                          char* shm, u64 slot_bytes, u64* seq_dev, int rank, int world,
                                          u64 timeout_ns, int* err) {
    __shared__ u64 seq_s;
    if (threadIdx.x == 0) seq_s = *((volatile u64*)seq_dev) + 1;
    __syncthreads();
    const u64 seq = seq_s;
    const int parity = (int)(seq & 1);
    volatile u64* flags = (volatile u64*)shm;
    char* data = shm + 64 * 64;
    const float4* x4 = (const float4*)x;
    float4* mine = (float4*)(data + (u64)(rank * 2 + parity) * slot_bytes);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) mine[i] = x4[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) flags[rank * 8] = seq;
    if (threadIdx.x < world && threadIdx.x != rank) {
        const u64 t0 = now_ns();
        while (flags[threadIdx.x * 8] < seq) {
            if (now_ns() - t0 > timeout_ns) { atomicExch(err, 1); break; }
        }
        __threadfence_system();
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int r = 0; r < world; ++r) {
            const float4 v = r == rank ? x4[i] : __ldcv((const float4*)(data + (u64)(r * 2 + parity) * slot_bytes) + i);
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        ((float4*)out)[i] = acc;
    }
    if (threadIdx.x == 0) *((volatile u64*)seq_dev) = seq;
}
"""


def _graph_us(fn, check) -> float:
    """Median microseconds per call: ITERS calls captured in one CUDA graph, replayed in step with the other
    ranks (a barrier before each timed replay)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ITERS):
            fn()
    times = []
    for _ in range(12):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ITERS)
    check()
    del graph
    torch.cuda.synchronize()
    return statistics.median(times[2:])


def _rank(rank: int, world: int, port: int, shm_name: str, shm_bytes: int, sizes: list[int],
          timeout_ms: float, results) -> None:
    import cupy as cp

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    shm = shared_memory.SharedMemory(name=shm_name)
    view = ctypes.c_char.from_buffer(shm.buf)
    host = ctypes.addressof(view)
    registered = False
    try:
        with cp.cuda.Device(rank):
            cp.cuda.runtime.hostRegister(host, shm_bytes, 3)  # portable | mapped
            registered = True
            rt = cp.cuda.runtime
            dev = int(rt.hostGetDevicePointer(host, 0)) if hasattr(rt, "hostGetDevicePointer") else \
                int(rt.pointerGetAttributes(host).devicePointer)
            kernel = cp.RawKernel(_SOURCE, "host_allreduce")
        slot_bytes = max(sizes)
        seq = torch.zeros(1, dtype=torch.int64, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        rows = []
        for size in sizes:
            n = size // 4
            x = (torch.arange(n, device="cuda", dtype=torch.float32) % 97) + 1000 * (rank + 1)
            expected = sum((torch.arange(n, device="cuda", dtype=torch.float32) % 97) + 1000 * (r + 1)
                           for r in range(world))
            out = torch.empty_like(x)
            args = (cp.uint64(x.data_ptr()), cp.uint64(out.data_ptr()), cp.int32(n // 4), cp.uint64(dev),
                    cp.uint64(slot_bytes), cp.uint64(seq.data_ptr()), cp.int32(rank), cp.int32(world),
                    cp.uint64(int(timeout_ms * 1e6)), cp.uint64(err.data_ptr()))

            def host_call():
                with cp.cuda.Device(rank), cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    kernel((1,), (1024,), args)

            def host_check():
                if err.item():
                    raise RuntimeError(f"rank {rank}: waited more than {timeout_ms} ms for a flag")
                if not torch.equal(out, expected):
                    raise RuntimeError(f"rank {rank}: wrong sum, max error {(out - expected).abs().max().item()}")

            buf = x.clone()

            def nccl_call():
                buf.copy_(x)
                dist.all_reduce(buf)

            def nccl_check():
                if not torch.equal(buf, expected):
                    raise RuntimeError(f"rank {rank}: NCCL sum differs")

            rows.append((size, _graph_us(nccl_call, nccl_check), _graph_us(host_call, host_check)))
        if rank == 0:
            results.extend(rows)
    finally:
        torch.cuda.synchronize()
        if registered:
            cp.cuda.runtime.hostUnregister(host)
        del view
        shm.close()
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="8192,16384,32768,65536", help="bytes per rank (multiples of 16)")
    ap.add_argument("--timeout-ms", type=float, default=2000.0)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % 16 for s in sizes):
        ap.error(f"--sizes {args.sizes}: positive multiples of 16 bytes")
    if torch.cuda.device_count() < args.world:
        ap.error(f"--world {args.world} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    shm_bytes = FLAG_LINES * 64 + args.world * 2 * max(sizes)
    shm = shared_memory.SharedMemory(create=True, size=shm_bytes)
    shm.buf[:shm_bytes] = bytes(shm_bytes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().list()
    try:
        mp.spawn(_rank, args=(args.world, port, shm.name, shm_bytes, sizes, args.timeout_ms, results),
                 nprocs=args.world)
    finally:
        shm.close()
        shm.unlink()
    p2p = os.environ.get("NCCL_P2P_DISABLE", "0") == "1"
    print(f"{args.world} x {torch.cuda.get_device_name(0)}, NCCL P2P {'disabled' if p2p else 'default'}; "
          f"inside CUDA graphs, {ITERS} all-reduces per graph, median of 10 replays")
    print("| bytes per rank | NCCL us | host-mapped us | NCCL / host-mapped |\n|---|---|---|---|")
    for size, nccl, host in results:
        print(f"| {size} | {nccl:.1f} | {host:.1f} | {nccl / host:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
