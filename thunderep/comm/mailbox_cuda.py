"""EXPERIMENTAL: CUDA streams write mailbox records through mapped pinned memory.

The mailbox segment is registered with CUDA as mapped, portable pinned memory
(`cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped)`; its device address
comes from `cudaHostGetDevicePointer`, or `cudaPointerGetAttributes` where cupy lacks the former), so
a GPU can store into this rank's slot directly. `CudaMailboxWriter.write(round, tensor)` enqueues that
store on a CUDA stream, ordered after the kernels that produced `tensor` and with no host
synchronization: the seqlock protocol of `native/mailbox.h` is followed from the device (seq odd,
payload, round / generation / length, seq even, with system-scope fences between). Peers, and this
rank's own `collect`, poll the slot from the CPU as for any record.

Two ways to move the payload:
  * "kernel" (default): one tiny kernel writes flags and payload (best for the few bytes of counts
    and fingerprints);
  * "copy": a kernel opens the seqlock, `cudaMemcpyAsync` moves the payload device -> mapped host,
    a second kernel publishes round and length and closes the seqlock.

Needs the `cuda` extra (cupy) and a CUDA device; cupy is imported when a writer is made, never at
import. Close the writer before its mailbox.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CommError
from .mailbox import Mailbox

__all__ = ["CudaMailboxWriter"]

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_MEMCPY_DEVICE_TO_HOST = 2
_PHASE_BEGIN, _PHASE_FINISH, _PHASE_ALL = 0, 1, 2

_KERNEL_SOURCE = r"""
typedef unsigned long long u64;
extern "C" __global__ void tep_write_record(const unsigned char* __restrict__ src,
                                            unsigned char* payload, unsigned int length,
                                            u64* seq, u64 seq_even, u64* round_p, u64 round,
                                            u64* gen_p, u64 gen, unsigned int* length_p, int phase) {
    // phase 0: open the seqlock; 1: publish fields and close it; 2: everything, payload included.
    if (phase != 1) {
        if (threadIdx.x == 0) {
            *(volatile u64*)seq = seq_even + 1;
            __threadfence_system();
        }
        __syncthreads();
    }
    if (phase == 2) {
        if ((((u64)src | (u64)payload) & 7u) == 0) {
            unsigned int words = length / 8;
            for (unsigned int i = threadIdx.x; i < words; i += blockDim.x)
                ((volatile u64*)payload)[i] = ((const u64*)src)[i];
            for (unsigned int i = words * 8 + threadIdx.x; i < length; i += blockDim.x)
                ((volatile unsigned char*)payload)[i] = src[i];
        } else {
            for (unsigned int i = threadIdx.x; i < length; i += blockDim.x)
                ((volatile unsigned char*)payload)[i] = src[i];
        }
        __threadfence_system();
        __syncthreads();
    }
    if (phase != 0 && threadIdx.x == 0) {
        *(volatile u64*)round_p = round;
        *(volatile u64*)gen_p = gen;
        *(volatile unsigned int*)length_p = length;
        __threadfence_system();
        *(volatile u64*)seq = seq_even + 2;
        __threadfence_system();
    }
}
"""


def _import_cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported on use
    except ImportError as exc:
        raise CommError(f"the CUDA mailbox path needs cupy ({exc}): install the cuda extra, "
                        f"`pip install 'thunderep[cuda]'` (cupy-cuda12x)") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError without a driver
        raise CommError(f"the CUDA mailbox path needs a CUDA device, but CUDA reports: {exc}") from exc
    if count < 1:
        raise CommError("the CUDA mailbox path needs a CUDA device, but none is visible")
    return cupy


class _StreamHandle:
    """A CUDA stream by its handle, in the CUDA stream protocol (`__cuda_stream__`: version 0, handle)."""

    def __init__(self, handle: int):
        self._handle = int(handle)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def _cupy_stream(cp: Any, stream: torch.cuda.Stream) -> Any:
    """A cupy stream object for torch's `stream`, which stays torch's: `Stream.from_external` where this
    cupy has it (CuPy 14 deprecates `ExternalStream`), else `ExternalStream`."""
    if hasattr(cp.cuda.Stream, "from_external"):
        return cp.cuda.Stream.from_external(_StreamHandle(stream.cuda_stream))
    return cp.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


class CudaMailboxWriter:
    """Lets CUDA streams write this rank's records of `mailbox` (experimental).

    mailbox: an open `Mailbox`; its whole segment is registered as mapped pinned memory.
    device: CUDA device index for the kernel (default: torch's current device).
    """

    def __init__(self, mailbox: Mailbox, device: int | None = None):
        if not isinstance(mailbox, Mailbox) or mailbox.closed:
            raise CommError("CudaMailboxWriter needs an open Mailbox")
        self._cp = cp = _import_cupy()
        self._device = torch.cuda.current_device() if device is None else int(device)
        self._mailbox = mailbox
        self._host = mailbox.address
        self._nbytes = mailbox.nbytes
        with cp.cuda.Device(self._device):
            try:
                cp.cuda.runtime.hostRegister(self._host, self._nbytes,
                                             _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            except Exception as exc:
                raise CommError(f"cudaHostRegister of mailbox {mailbox.name} ({self._nbytes} bytes) "
                                f"failed: {exc}") from exc
            self._registered = True
            try:
                self._dev = self._device_pointer(cp, self._host)
                self._kernel = cp.RawKernel(_KERNEL_SOURCE, "tep_write_record")
            except Exception:
                self.close()
                raise

    @staticmethod
    def _device_pointer(cp: Any, host: int) -> int:
        """cudaHostGetDevicePointer, through whichever binding this cupy has."""
        rt = cp.cuda.runtime
        if hasattr(rt, "hostGetDevicePointer"):
            return int(rt.hostGetDevicePointer(host, 0))
        return int(rt.pointerGetAttributes(host).devicePointer)

    @property
    def device_pointer(self) -> int:
        """Device address of the segment base."""
        return self._dev

    def write(self, round: int, tensor: torch.Tensor, *, stream: torch.cuda.Stream | None = None,
              method: str = "kernel") -> None:
        """Enqueue the write of `tensor`'s bytes as this rank's record for `round`.

        tensor: contiguous CUDA tensor of any dtype, at most mailbox.slot_size bytes; it must stay
        alive and unchanged until the stream reaches the write.
        stream: torch CUDA stream (default: the current stream of the tensor's device).
        Returns at once; `mailbox.collect(round)` then waits for every rank's record, this one's too.
        """
        if not self._registered:
            raise CommError("CudaMailboxWriter is closed")
        if method not in ("kernel", "copy"):
            raise CommError(f"method ({method!r}) must be 'kernel' or 'copy'")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            where = f" on {tensor.device}" if isinstance(tensor, torch.Tensor) else ""
            raise CommError(f"expected a CUDA tensor, got {type(tensor).__name__}{where}")
        if not tensor.is_contiguous():
            raise CommError("the tensor must be contiguous (call .contiguous())")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._mailbox.slot_size:
            raise CommError(f"tensor of {nbytes} bytes exceeds the mailbox slot size "
                            f"({self._mailbox.slot_size})")
        stream = torch.cuda.current_stream(tensor.device) if stream is None else stream
        fields, seq_even, generation = self._mailbox._reserve_external(round)
        cp, np_u64 = self._cp, self._cp.uint64
        ptr = {k: np_u64(self._dev + off) for k, off in fields.items()}
        common = (ptr["seq"], np_u64(seq_even), ptr["round"], np_u64(round), ptr["generation"],
                  np_u64(generation), ptr["length"])
        src = np_u64(tensor.data_ptr())
        with cp.cuda.Device(tensor.device.index), _cupy_stream(cp, stream):
            if method == "kernel":
                self._kernel((1,), (128,), (src, ptr["payload"], cp.uint32(nbytes), *common,
                                            cp.int32(_PHASE_ALL)))
                return
            head = (src, ptr["payload"], cp.uint32(nbytes), *common)
            self._kernel((1,), (1,), (*head, cp.int32(_PHASE_BEGIN)))
            if nbytes:
                cp.cuda.runtime.memcpyAsync(self._host + fields["payload"], tensor.data_ptr(), nbytes,
                                            _MEMCPY_DEVICE_TO_HOST, stream.cuda_stream)
            self._kernel((1,), (1,), (*head, cp.int32(_PHASE_FINISH)))

    def close(self) -> None:
        """Wait for pending writes and unregister the segment (idempotent)."""
        if getattr(self, "_registered", False):
            self._registered = False
            with self._cp.cuda.Device(self._device):
                self._cp.cuda.runtime.deviceSynchronize()
                self._cp.cuda.runtime.hostUnregister(self._host)

    def __enter__(self) -> CudaMailboxWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
