"""One-shot all-reduce and all-gather of small CUDA tensors through pinned host memory (one host, no P2P).

Every rank maps one shared host segment (`comm/host_segment.py`), registered with CUDA as mapped, portable
pinned memory, and one kernel per call does all the work, with no host involvement:
  1. each thread block takes the next call number of its chunk from a counter in device memory (so CUDA
     graph replays advance it);
  2. copies its chunk of this rank's tensor into this rank's slot of the call's parity;
  3. publishes `tag << 48 | call` in its flag with system-scope release ordering;
  4. waits (acquire) until every peer's flag for this chunk reaches the call, for at most the timeout;
  5. reads the peers' chunks and sums them in float32 in rank order (every rank gets the same bits), or
     copies them side by side (all-gather).
A rank rewrites its slot for call n only after every peer has published call n - 1, so has finished
reading it at call n - 2. A wait that times out, or a peer whose call differs (the 16-bit tag: operation, dtype, size),
latches an error in this rank's status line; `check()` turns it into `PeerTimeout` / `CommError` naming
the peer, and later calls stop waiting, so the GPU never hangs. Calls are ordered by their stream.
Needs the `cuda` extra (cupy, which compiles the kernel with NVRTC).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from .. import env
from ..errors import CommError, ConfigError, InputError
from .host_segment import (ATTACHED, CHUNK_BYTES, CLOSED, ERR_BLOCK, ERR_CODE, ERR_PEER, ERR_ROUND, LINE, MISMATCH,
                           ROUND_BITS, TIMED_OUT, HostSegment, error_for, open_segment)

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_TIMEOUT_S", "KERNEL_NAMES", "KERNEL_SOURCE", "SUM_DTYPES", "HostCollective",
           "call_tag", "check_tensor", "use_host_path"]

THREADS = 256
DEFAULT_MAX_BYTES = 64 << 10  # the automatic choice's threshold (latency mode's 8-64 KiB; to be measured)
DEFAULT_TIMEOUT_S = 10.0
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
SUM_DTYPES = tuple(_DTYPES)  # what all_reduce_ sums

_KERNEL = r"""
typedef unsigned long long u64; typedef unsigned int u32; typedef unsigned short u16; typedef unsigned char u8;
#define ROUND_MASK ((1ull << ROUND_BITS) - 1ull)
struct Call { const char* x; char* out; u64 nbytes; char* seg; u64* state; int rank, world, nblocks;
              u64 capacity, flags_off, slots_off, tag, timeout_ns; };

__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ u64 load_acquire(const u64* p) {
    u64 v; asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void store_release(u64* p, u64 v) {
    asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ char* slot(const Call& c, int r, u64 seq) {
    return c.seg + c.slots_off + ((u64)(2 * r) + (seq & 1ull)) * c.capacity + (u64)blockIdx.x * CHUNK; }
__device__ __forceinline__ u64* flag(const Call& c, int r) {
    return (u64*)(c.seg + c.flags_off + ((u64)r * c.nblocks + blockIdx.x) * LINE); }

// The rank's first failure: latched in state[nblocks], recorded in its status line (code last).
__device__ void fail(const Call& c, u32 code, int peer, u64 seq) {
    if (atomicCAS(c.state + c.nblocks, 0ull, (u64)code) != 0ull) return;
    char* line = c.seg + (u64)LINE * (1 + c.rank);
    *(volatile int*)(line + ERR_PEER) = peer;
    *(volatile u64*)(line + ERR_ROUND) = seq;
    *(volatile u32*)(line + ERR_BLOCK) = blockIdx.x;
    __threadfence_system();
    *(volatile u32*)(line + ERR_CODE) = code;
    __threadfence_system();
}

__device__ u64 next_call(const Call& c) {
    __shared__ u64 seq;
    if (threadIdx.x == 0) { seq = c.state[blockIdx.x] + 1ull; c.state[blockIdx.x] = seq; }
    __syncthreads();
    return seq;
}

// This rank's chunk is in its slot: publish the call, then wait (bounded) for every peer's.
__device__ void publish_and_wait(const Call& c, u64 seq) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) store_release(flag(c, c.rank), (c.tag << ROUND_BITS) | seq);
    const int p = threadIdx.x;
    if (p < c.world && p != c.rank) {
        const u64* f = flag(c, p);
        const volatile u64* latched = c.state + c.nblocks;
        const u64 t0 = now_ns();
        while (true) {
            const u64 w = load_acquire(f), seen = w & ROUND_MASK;
            if (seen >= seq) {
                if (seen == seq && (w >> ROUND_BITS) != c.tag) fail(c, MISMATCH, p, seq);
                break;
            }
            if (*latched != 0ull) break;  // an earlier failure: stop waiting
            if (now_ns() - t0 > c.timeout_ns) { fail(c, TIMED_OUT, p, seq); break; }
        }
    }
    __syncthreads();
}

template <int DT> struct Elem;
template <> struct Elem<0> { typedef u32 raw;
    static __device__ __forceinline__ float get(u32 v) { return __uint_as_float(v); }
    static __device__ __forceinline__ u32 put(float f) { return __float_as_uint(f); } };
template <> struct Elem<1> { typedef u16 raw;
    static __device__ __forceinline__ float get(u16 v) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }
    static __device__ __forceinline__ u16 put(float f) {
        u16 v; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f)); return v; } };
template <> struct Elem<2> { typedef u16 raw;  // bfloat16: round to nearest even, NaN stays a quiet NaN
    static __device__ __forceinline__ float get(u16 v) { return __uint_as_float((u32)v << 16); }
    static __device__ __forceinline__ u16 put(float f) {
        const u32 u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
        return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); } };

__device__ __forceinline__ u64 chunk_units(const Call& c, u64 begin, u64 unit) {
    return (c.nbytes - begin < CHUNK ? c.nbytes - begin : CHUNK) / unit; }

// Rank r's unit i of this call: this rank's from its input (device memory), a peer's from its slot.
template <typename W>
__device__ __forceinline__ const W* source(const Call& c, const W* x, int r, u64 seq, u64 i) {
    return r == c.rank ? x + i : (const W*)slot(c, r, seq) + i; }

// The copy into this rank's slot, then the wait: steps 1-4 for this block's chunk.
template <typename W>
__device__ u64 exchange(const Call& c, const W* x, u64 units) {
    const u64 seq = next_call(c);
    W* mine = (W*)slot(c, c.rank, seq);
    for (u64 i = threadIdx.x; i < units; i += blockDim.x) mine[i] = x[i];
    publish_and_wait(c, seq);
    return seq;
}

#define GROUP 4  // ranks whose units a thread loads at once (their host-memory reads overlap)

template <int DT, typename W>  // W: what one thread moves at once, one element or 16 bytes
__device__ void all_reduce(const Call& c) {
    typedef typename Elem<DT>::raw E;
    constexpr int N = sizeof(W) / sizeof(E);
    const u64 begin = (u64)blockIdx.x * CHUNK, units = chunk_units(c, begin, sizeof(W));
    const W* x = (const W*)(c.x + begin);
    const u64 seq = exchange(c, x, units);
    for (u64 i = threadIdx.x; i < units; i += blockDim.x) {
        float acc[N];
        for (int r0 = 0; r0 < c.world; r0 += GROUP) {
            W w[GROUP];
#pragma unroll
            for (int j = 0; j < GROUP; ++j) if (r0 + j < c.world) w[j] = __ldcv(source(c, x, r0 + j, seq, i));
#pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                if (r0 + j >= c.world) break;
                const E* e = (const E*)&w[j];
#pragma unroll
                for (int k = 0; k < N; ++k)  // rank order; rank 0's value as it is (-0 stays -0)
                    acc[k] = r0 + j == 0 ? Elem<DT>::get(e[k]) : acc[k] + Elem<DT>::get(e[k]);
            }
        }
        W o;
        E* oe = (E*)&o;
#pragma unroll
        for (int k = 0; k < N; ++k) oe[k] = Elem<DT>::put(acc[k]);
        ((W*)(c.out + begin))[i] = o;
    }
}

template <typename W>
__device__ void all_gather(const Call& c) {
    const u64 begin = (u64)blockIdx.x * CHUNK, units = chunk_units(c, begin, sizeof(W));
    const W* x = (const W*)(c.x + begin);
    const u64 seq = exchange(c, x, units);
    for (u64 i = threadIdx.x; i < units; i += blockDim.x) {
        for (int r0 = 0; r0 < c.world; r0 += GROUP) {
            W w[GROUP];
#pragma unroll
            for (int j = 0; j < GROUP; ++j) if (r0 + j < c.world) w[j] = __ldcv(source(c, x, r0 + j, seq, i));
#pragma unroll
            for (int j = 0; j < GROUP; ++j)
                if (r0 + j < c.world) ((W*)(c.out + (u64)(r0 + j) * c.nbytes + begin))[i] = w[j];
        }
    }
}

#define ARGS const char* x, char* out, u64 nbytes, char* seg, u64* state, int rank, int world, int nblocks, \
             u64 capacity, u64 flags_off, u64 slots_off, u64 tag, u64 timeout_ns
#define CALL {x, out, nbytes, seg, state, rank, world, nblocks, capacity, flags_off, slots_off, tag, timeout_ns}
#define AR(name, DT, W) extern "C" __global__ void name(ARGS) { const Call c = CALL; all_reduce<DT, W>(c); }
#define AG(name, W) extern "C" __global__ void name(ARGS) { const Call c = CALL; all_gather<W>(c); }
AR(tep_ar_f32_4, 0, u32) AR(tep_ar_f32_16, 0, uint4) AR(tep_ar_f16_2, 1, u16) AR(tep_ar_f16_16, 1, uint4)
AR(tep_ar_bf16_2, 2, u16) AR(tep_ar_bf16_16, 2, uint4)
AG(tep_ag_1, u8) AG(tep_ag_2, u16) AG(tep_ag_4, u32) AG(tep_ag_8, u64) AG(tep_ag_16, uint4)
"""
_DEFINES = {"LINE": LINE, "CHUNK": CHUNK_BYTES, "ROUND_BITS": ROUND_BITS, "ERR_CODE": ERR_CODE,
            "ERR_PEER": ERR_PEER, "ERR_ROUND": ERR_ROUND, "ERR_BLOCK": ERR_BLOCK, "TIMED_OUT": TIMED_OUT,
            "MISMATCH": MISMATCH}
KERNEL_SOURCE = "".join(f"#define {k} {v}\n" for k, v in _DEFINES.items()) + _KERNEL
KERNEL_NAMES = tuple(f"tep_ar_{d}_{u}" for d, u in (("f32", 4), ("f32", 16), ("f16", 2), ("f16", 16),
                                                    ("bf16", 2), ("bf16", 16))) + \
    tuple(f"tep_ag_{u}" for u in (1, 2, 4, 8, 16))


def call_tag(op: str, dtype: torch.dtype | None, nbytes: int) -> int:
    """16-bit tag of a call, published with its number so that a peer making another call is noticed."""
    return zlib.crc32(f"{op}:{dtype}:{nbytes}".encode()) & 0xFFFF


def check_tensor(tensor: Any, *, op: str, capacity: int, device: torch.device) -> int:
    """The byte size of `tensor` after checking that `op` ("all_reduce" | "all_gather") can take it on
    `device` with `capacity` bytes per rank; InputError quoting what does not fit."""
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"host {op} takes a torch.Tensor, got {type(tensor).__name__}")
    if op == "all_reduce" and tensor.dtype not in _DTYPES:
        raise InputError(f"host all_reduce sums bfloat16, float16 or float32 tensors; got {tensor.dtype}")
    if tensor.device != device:
        raise InputError(f"the tensor is on {tensor.device}, but this host collective runs on {device}")
    if not tensor.is_contiguous():
        raise InputError(f"host {op} needs a contiguous tensor (shape {tuple(tensor.shape)}, strides "
                         f"{tensor.stride()}): call .contiguous()")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > capacity:
        raise InputError(f"a tensor of {nbytes} bytes exceeds the host collective's capacity ({capacity} bytes "
                         f"per rank): use NCCL for it, or a larger capacity_bytes")
    return nbytes


def use_host_path(nbytes: int, *, same_host: bool, capacity: int) -> bool:
    """Whether a collective of `nbytes` per rank goes through host memory: never across hosts or above
    `capacity`; THUNDEREP_HOST_COLLECTIVE=0 / 1 forces NCCL / host memory, else up to DEFAULT_MAX_BYTES."""
    if not same_host or nbytes > capacity:
        return False
    forced = env.host_collective()
    return forced if forced is not None else nbytes <= DEFAULT_MAX_BYTES


def _cuda_index(device: torch.device | int | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ConfigError(f"device ({device!r}) must be a CUDA device")
    return torch.cuda.current_device() if dev.index is None else dev.index


class _StreamPtr:
    """A CUDA stream for cupy's `Function.__call__`, which takes any object with the handle as `ptr`."""

    def __init__(self, handle: int):
        self.ptr = int(handle)


def _import_cupy() -> Any:
    try:
        import cupy  # optional dependency (the cuda extra), imported on use
    except ImportError as exc:
        raise CommError(f"the host collective needs cupy ({exc}): install the cuda extra, "
                        f"`pip install 'thunderep[cuda]'`") from exc
    return cupy


_FUNCTIONS: dict[int, dict[str, Any]] = {}  # device -> kernel name -> cupy Function (compiled once)


def _functions(cp: Any, device: int) -> dict[str, Any]:
    if device not in _FUNCTIONS:
        with cp.cuda.Device(device):
            module = cp.RawModule(code=KERNEL_SOURCE, options=("-std=c++17",))
            _FUNCTIONS[device] = {name: module.get_function(name) for name in KERNEL_NAMES}
    return _FUNCTIONS[device]


class HostCollective:
    """One rank's one-shot all-reduce and all-gather of small CUDA tensors through a `HostSegment`.

    segment: the group's segment; each of its `layout.world` ranks makes one HostCollective (ranks may
    share one segment object in one process, e.g. ranks on streams of one GPU).
    rank: this rank. device: its CUDA device (default: torch's current one).
    timeout_s: how long a kernel waits for a peer (default THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S, else 10 s).
    owns_segment: `close()` closes the segment too (as `for_group` makes it).
    Every rank makes the same calls in the same order, one stream at a time; `close()` when done. Ranks
    sharing one GPU (streams of one process) need their calls' blocks resident at once (small messages) and
    every rank's call enqueued before any work that waits for one: CUDA does not promise that streams run at
    once, and work queued behind a waiting call can keep a peer's call from starting until the timeout.
    """

    def __init__(self, segment: HostSegment, rank: int, *, device: torch.device | int | None = None,
                 timeout_s: float | None = None, owns_segment: bool = False):
        layout = segment.layout
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world:
            raise ConfigError(f"rank ({rank!r}) must be an integer in [0, {layout.world - 1}]")
        self._rank = rank
        if timeout_s is None:
            timeout_s = env.host_collective_timeout_s() or DEFAULT_TIMEOUT_S
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ConfigError(f"timeout_s ({timeout_s!r}) must be a number of seconds in (0, 3600]")
        self._timeout_s = float(timeout_s)
        index = _cuda_index(device)
        self._device = torch.device("cuda", index)
        self._cp = cp = _import_cupy()
        self._segment, self._owns_segment, self._layout = segment, owns_segment, layout
        self._fns = _functions(cp, index)
        self._state = torch.zeros(layout.blocks + 1, dtype=torch.int64, device=self._device)  # calls, error
        self._ptr = segment.register_cuda(cp, index)
        self._open = True
        segment.mark(rank, ATTACHED)

    @classmethod
    def for_group(cls, capacity_bytes: int, group: dist.ProcessGroup | None = None, *,
                  device: torch.device | int | None = None, timeout_s: float | None = None) -> HostCollective:
        """This rank's HostCollective on a segment shared by `group` (every rank on this host calls it)."""
        seg = open_segment(capacity_bytes, group)
        try:
            return cls(seg, dist.get_rank(group), device=device, timeout_s=timeout_s, owns_segment=True)
        except BaseException:
            seg.close()
            raise

    @property
    def world(self) -> int:
        return self._layout.world

    @property
    def capacity(self) -> int:
        """The largest message in bytes per rank."""
        return self._layout.capacity

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (bfloat16 / float16 / float32, any shape, contiguous, on this device) over the ranks
        in place, in float32 in rank order; returns it. Enqueued on the current stream."""
        nbytes = self._enqueue_check(tensor, "all_reduce")
        unit = 16 if nbytes % 16 == 0 and tensor.data_ptr() % 16 == 0 else tensor.element_size()
        self._launch(f"tep_ar_{_DTYPES[tensor.dtype]}_{unit}", tensor, tensor, nbytes,
                     call_tag("all_reduce", tensor.dtype, nbytes))
        return tensor

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `tensor` (any dtype, contiguous, on this device), stacked: [world, *tensor.shape]
        (into `out` when given, a contiguous tensor of that shape and dtype). Enqueued on the current stream."""
        nbytes = self._enqueue_check(tensor, "all_gather")
        shape = (self.world, *tensor.shape)
        if out is None:
            out = torch.empty(shape, dtype=tensor.dtype, device=self._device)
        elif out.shape != shape or out.dtype != tensor.dtype or out.device != self._device \
                or not out.is_contiguous():
            raise InputError(f"out must be a contiguous {tensor.dtype} tensor of shape {shape} on {self._device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        unit = next(u for u in (16, 8, 4, 2, 1)
                    if nbytes % u == 0 and tensor.data_ptr() % u == 0 and out.data_ptr() % u == 0)
        self._launch(f"tep_ag_{unit}", tensor, out, nbytes, call_tag("all_gather", None, nbytes))
        return out

    def _enqueue_check(self, tensor: torch.Tensor, op: str) -> int:
        if not self._open:
            raise CommError("this HostCollective is closed")
        self.check()
        return check_tensor(tensor, op=op, capacity=self.capacity, device=self._device)

    def _launch(self, name: str, x: torch.Tensor, out: torch.Tensor, nbytes: int, tag: int) -> None:
        if nbytes == 0:
            return  # no blocks, no call numbers: the same on every rank
        cp, lay = self._cp, self._layout
        u64 = cp.uint64
        args = (u64(x.data_ptr()), u64(out.data_ptr()), u64(nbytes), u64(self._ptr), u64(self._state.data_ptr()),
                cp.int32(self._rank), cp.int32(lay.world), cp.int32(lay.blocks), u64(lay.capacity),
                u64(lay.flags_offset), u64(lay.slots_offset), u64(tag), u64(int(self._timeout_s * 1e9)))
        stream = _StreamPtr(torch.cuda.current_stream(self._device).cuda_stream)
        with cp.cuda.Device(self._device.index):
            self._fns[name]((-(-nbytes // CHUNK_BYTES),), (THREADS,), args, stream=stream)

    def check(self) -> None:
        """Raise PeerTimeout / CommError if a kernel of this rank has given up (reads host memory only:
        it sees kernels that have finished; synchronize first to include the ones in flight)."""
        record = self._segment.error(self._rank)
        if record is not None:
            raise error_for(record, self._rank, self._timeout_s, self._segment.peer_state(record.peer))

    def close(self) -> None:
        """Wait for this device's work, mark this rank closed, unregister the segment (idempotent)."""
        if not self._open:
            return
        self._open = False
        torch.cuda.synchronize(self._device)
        self._segment.mark(self._rank, CLOSED)
        with self._cp.cuda.Device(self._device.index):
            self._segment.unregister_cuda(self._cp)
        if self._owns_segment:
            self._segment.close()

    def __enter__(self) -> HostCollective:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
