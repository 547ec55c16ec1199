"""Copies between host and device for the expert tiers (`thunderep.moe.tiers`): the double-buffered staging
area cold slots stream through, and host copies of device tensors that let queued work run on."""

from __future__ import annotations

import torch

__all__ = ["SlotTable", "Staging", "mapped", "to_device", "to_host", "to_host_all"]


class Staging:
    """Two device buffers holding one slot of expert tensors each, shared by the layers whose slots have the
    same shapes. On CUDA the copies run on a side stream: `load` of the next slot overlaps the compute on
    the other buffer; `ready` makes the compute stream wait for a load, `release` marks a buffer's compute
    issued. Elsewhere the copy is a plain copy and the waits are nothing."""

    def __init__(self, like: dict[str, torch.Tensor], device: torch.device):
        self.buffers = [{n: torch.empty((1, *t.shape[1:]), dtype=t.dtype, device=device) for n, t in like.items()}
                        for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loaded: list = [None, None]
        self._used: list = [None, None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())

    def load(self, i: int, host: dict[str, torch.Tensor], slot: int) -> None:
        if self.stream is None:
            for n, t in self.buffers[i].items():
                t.copy_(host[n][slot:slot + 1])
            return
        with torch.cuda.stream(self.stream):
            if self._used[i] is not None:
                self.stream.wait_event(self._used[i])
            for n, t in self.buffers[i].items():
                t.copy_(host[n][slot:slot + 1], non_blocking=True)
            self._loaded[i] = torch.cuda.Event()
            self._loaded[i].record(self.stream)

    def ready(self, i: int) -> None:
        if self._loaded[i] is not None:
            torch.cuda.current_stream().wait_event(self._loaded[i])

    def release(self, i: int) -> None:
        if self.stream is not None:
            self._used[i] = torch.cuda.Event()
            self._used[i].record()


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(t on the host, the event its copy completes or None): from a CUDA device one non-blocking copy into
    pinned memory, so that work queued after it runs while the host waits for the copy alone; a plain copy
    from another device (host tensors stay where they are)."""
    (host,), copied = to_host_all([t])
    return host, copied


def to_host_all(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """`to_host` for several tensors of one device: their host copies and one event after the last copy."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors], None
    hosts = []
    for t in tensors:
        hosts.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        hosts[-1].copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return hosts, copied


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`; to a CUDA device through pinned memory, non-blocking, so that the host
    does not wait for the work queued before the copy."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SlotTable:
    """int64 [num_slots + 1] on `device`: an entry per slot, -1 elsewhere and at index -1 (so that a pair
    another rank computes, slot -1, maps to -1): what the pair kernels read each pair's entry through (the
    hot copies' rows, the mapped slots).

    `set` rewrites it in place without the host waiting for the device: the entries are written into a
    pinned row, which the current stream copies into `values` after every kernel queued before it (those read
    the old entries). The row is written again only once that copy is done (an event, recorded a re-choice
    earlier: long done). A copy from pageable memory would wait for the whole stream instead, and there for
    the host jobs the stream waits on: on one H100 each re-choice of a decode step's layer took some 4 ms so
    (examples/decode_step_probe.py --cprofile)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.values = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=self.device)
        self._row = torch.empty(num_slots + 1, dtype=torch.int64, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None  # after the last copy from the row (none yet: done)

    def set(self, entries: dict[int, int]) -> torch.Tensor:
        """Make entries[s] slot s's entry (-1 for the slots not in `entries`); returns `values`."""
        if self._copied is not None:
            self._copied.synchronize()
        self._row.fill_(-1)
        if entries:
            self._row[list(entries)] = torch.tensor(list(entries.values()), dtype=torch.int64)
        if self._copied is None:
            self.values.copy_(self._row)
            return self.values
        self.values.copy_(self._row, non_blocking=True)
        self._copied.record()
        return self.values


class _Aliased:
    """The CUDA array interface of a pinned host tensor's bytes, as 2-byte or 1-byte integers (the interface
    has no bfloat16): what `mapped` hands torch.as_tensor. Holds the host tensor, so that the alias keeps
    it alive."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        width = 2 if t.element_size() % 2 == 0 else 1
        ratio = t.element_size() // width
        shape = (*t.shape[:-1], t.shape[-1] * ratio)
        strides = (*(s * t.element_size() for s in t.stride()[:-1]), width)
        self.__cuda_array_interface__ = {"shape": shape, "strides": strides, "typestr": f"<i{width}",
                                         "data": (t.data_ptr(), False), "version": 3}


def mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on the CUDA `device` that aliases the pinned host tensor `t` (no copy): a kernel reading it
    reads host memory across the bus, as a staged copy would, but with no copy launched and no host
    knowledge of which rows it reads (the decode pair kernels take the ids on the device). Pinned memory is
    mapped into every device's address space at the host's own addresses (unified addressing), so the
    alias is the host pointer itself. `t` must be pinned with a unit stride in its last dimension."""
    if not t.is_pinned():
        raise ValueError("a mapped view needs pinned host memory")
    if not t.dim() or t.stride(-1) != 1:
        raise ValueError(f"a mapped view needs a unit last stride, got strides {t.stride()}")
    with torch.cuda.device(device):
        alias = torch.as_tensor(_Aliased(t), device=device)
    return alias.view(t.dtype)
