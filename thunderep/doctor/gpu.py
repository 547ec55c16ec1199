"""What CUDA itself says: the peer-access matrix and measured GPU-to-GPU copy bandwidth.

Everything here is guarded: without torch, without CUDA or without GPUs, `cuda_report()` returns None
and the doctor reports these checks as n/a. Bandwidth is measured two ways for every ordered pair of
GPUs (src -> dst), side by side in one run:

- **peer copy**: `dst.copy_(src)` between the two devices. PyTorch enables peer access when CUDA allows
  it, and the copy then goes straight over PCIe (P2P); otherwise the CUDA driver stages it through host
  memory itself. `peer_access` in the result says which case applies.
- **via host**: an explicit, unpipelined staging copy: device -> pinned host buffer (waited for), then
  pinned host buffer -> device. It is the baseline a peer copy must beat to be worth anything.

Each figure is the best of `iters` timed copies after one warm-up copy, in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["CudaDevice", "CopyBandwidth", "CudaReport", "cuda_report", "measure_pair"]


@dataclass(frozen=True)
class CudaDevice:
    """A CUDA device as torch numbers it; `bdf` when torch exposes the PCI location."""

    index: int
    name: str
    bdf: str | None
    total_memory_mib: int


@dataclass(frozen=True)
class CopyBandwidth:
    """Measured copy bandwidth src -> dst in GB/s; `error` when the measurement failed."""

    src: int
    dst: int
    nbytes: int
    peer_access: bool
    peer_gbps: float | None
    via_host_gbps: float | None
    error: str | None = None


@dataclass(frozen=True)
class CudaReport:
    devices: tuple[CudaDevice, ...]
    can_access_peer: tuple[tuple[bool, ...], ...]  # [i][j]: device i can access device j's memory
    bandwidth: tuple[CopyBandwidth, ...]


def _load_cuda():
    try:
        import torch  # optional: the doctor (and sysconfig, which imports it) runs without torch
    except Exception:  # noqa: BLE001 - torch missing or broken: the doctor must still run
        return None
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
    except Exception:  # noqa: BLE001 - a driver/runtime mismatch raises here
        return None
    return torch


def _device(torch, i: int) -> CudaDevice:
    p = torch.cuda.get_device_properties(i)
    bdf = None
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bdf = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    return CudaDevice(i, str(p.name), bdf, int(p.total_memory) >> 20)


def _best_seconds(fn: Callable[[], None], sync: Callable[[], None], iters: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_pair(torch, src: int, dst: int, nbytes: int = 64 << 20, iters: int = 5) -> CopyBandwidth:
    """Peer-copy and via-host bandwidth from device `src` to device `dst` (buffers of `nbytes`)."""
    peer = bool(torch.cuda.can_device_access_peer(src, dst))
    try:
        a_N = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
        b_N = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
        host_N = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        a_N.fill_(1)

        def sync() -> None:
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)

        def peer_copy() -> None:
            b_N.copy_(a_N, non_blocking=True)

        def via_host() -> None:
            host_N.copy_(a_N)  # device -> pinned host; returns once the data is in host memory
            b_N.copy_(host_N, non_blocking=True)

        t_peer = _best_seconds(peer_copy, sync, iters)
        t_host = _best_seconds(via_host, sync, iters)
        return CopyBandwidth(src, dst, nbytes, peer, nbytes / t_peer / 1e9, nbytes / t_host / 1e9)
    except RuntimeError as exc:  # out of memory, a broken peer mapping, ...
        return CopyBandwidth(src, dst, nbytes, peer, None, None, f"{type(exc).__name__}: {exc}")
    finally:
        a_N = b_N = host_N = None  # noqa: F841 - release before the next pair allocates
        torch.cuda.empty_cache()


def cuda_report(measure: bool = True, nbytes: int = 64 << 20, iters: int = 5) -> CudaReport | None:
    """Devices, peer-access matrix and (if `measure` and >= 2 GPUs) bandwidth; None without CUDA."""
    torch = _load_cuda()
    if torch is None:
        return None
    n = torch.cuda.device_count()
    devices = tuple(_device(torch, i) for i in range(n))
    access = tuple(
        tuple(i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)) for i in range(n)
    )
    bandwidth = []
    if measure and n >= 2:
        for i in range(n):
            for j in range(n):
                if i != j:
                    bandwidth.append(measure_pair(torch, i, j, nbytes, iters))
    return CudaReport(devices, access, tuple(bandwidth))
