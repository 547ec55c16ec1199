"""Split-size records written into pinned host memory by the kernel that counts them (ranks of one host).

Shape legend: T tokens of a wave, K experts per token, R ranks, S slots per rank, P = R * S global slots,
W waves, V rider words, L = W * (P + R) + V words (int32) of a record.

`Dispatcher.plan` counts each wave's pairs per global slot and rows per destination rank on the device,
copies them to the host (a wait for the GPU), and exchanges them over the control plane. Here one kernel
per wave counts them and the last one writes the record straight into this rank's slot of a segment
that every rank of the host maps (`kernels/records.py`), then publishes the round with system-scope
release ordering: no host work on this side, and a peer polling the segment sees the record about one
GPU-to-host write after the kernel runs. `read()` waits, bounded, for every rank's round and copies the
R records:

    write(slots_W, S, rider_V)  enqueue the record's launches on the current stream (capturable)
    read()                      -> int32 [R, L] on the host: what `.cpu()` + `exchange_tensor` returned
    exchange(slots_W, S, rider_V) both

Segment use (`host_segment.SegmentLayout`): rank r's record for round n sits in its slot of parity n % 2,
its flag is its first flag line, `tag << 48 | n`, the tag naming the record's shape (W, P, R, V). A rank
rewrites a parity at round n + 2 only after its host read round n + 1, which needs every peer's round
n + 1, which a peer writes only after its host read round n: two slots need no wait on the GPU. The
round advances in device memory; the host counts its own writes, so `read()` expects one `write()`
before it (a CUDA graph replay of `write` advances the device's count alone).
"""

from __future__ import annotations

import ctypes
import os
import time
import zlib

import torch
import torch.distributed as dist

from .. import env
from ..errors import CommError, ConfigError, InputError, PeerTimeout
from .host_segment import ATTACHED, CLOSED, ROUND_BITS, HostSegment, open_segment

__all__ = ["DEFAULT_TIMEOUT_S", "RecordExchange", "record_tag", "record_words", "reference_record"]

DEFAULT_TIMEOUT_S = 10.0
SPIN_S, YIELD_S, NAP_S = 20e-6, 10e-3, 100e-6  # polling: spin, then sched_yield, then naps of NAP_S
_ROUND_MASK = (1 << ROUND_BITS) - 1


def record_words(waves: int, ranks: int, slots_per_rank: int, rider_words: int = 0) -> int:
    """L = W * (P + R) + V: the int32 words of a record."""
    return waves * (ranks * slots_per_rank + ranks) + rider_words


def record_tag(waves: int, ranks: int, slots_per_rank: int, rider_words: int) -> int:
    """16-bit tag (never 0) of a record's shape, published with its round so that ranks writing records
    of different shapes are noticed."""
    return zlib.crc32(f"records:{waves}:{ranks}:{slots_per_rank}:{rider_words}".encode()) & 0xFFFF or 1


def reference_record(slots_W: list[torch.Tensor], ranks: int, slots_per_rank: int,
                     rider_V: torch.Tensor | None = None) -> torch.Tensor:
    """The record in torch ops (the kernel's reference, and the path it replaces): int32 [L] on the
    slots' device. slots_W[w]: int64 [T_w, K] global slots in [0, R * S); rider_V: int32 [V]."""
    R, S = ranks, slots_per_rank
    parts = []
    for slots_TK in slots_W:
        counts_P = torch.zeros(R * S, dtype=torch.int64, device=slots_TK.device).scatter_add_(
            0, slots_TK.reshape(-1), torch.ones_like(slots_TK.reshape(-1)))
        dest_TK = torch.div(slots_TK, S, rounding_mode="floor")
        on_RTK = dest_TK.unsqueeze(0) == torch.arange(R, device=slots_TK.device).view(R, 1, 1)
        parts += [counts_P, on_RTK.any(dim=2).sum(dim=1)]
    if rider_V is not None:
        parts.append(rider_V.to(slots_W[0].device))
    return torch.cat([p.to(torch.int32) for p in parts])


def _device_of(device: torch.device | int | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    if dev.type == "cpu" and env.triton_interpreter():
        return dev
    raise ConfigError(f"device ({device!r}) must be a CUDA device (or the CPU under Triton's interpreter, "
                      f"TRITON_INTERPRET=1)")


class RecordExchange:
    """One rank's GPU-written control records in a `HostSegment` shared by the ranks of one host.

    segment: the ranks' segment (slots of at least 4 * L bytes); each of its `layout.world` ranks makes
    one RecordExchange. rank: this rank. device: its CUDA device (default: torch's current one; the CPU
    under Triton's interpreter, where the segment is plain host memory). timeout_s: how long `read()`
    waits for a rank (default THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S, else 10 s). owns_segment: `close()`
    closes the segment too (as `for_group` makes it). Every rank makes the same calls with records of
    the same shape, write then read, one stream at a time; `close()` when done.
    """

    def __init__(self, segment: HostSegment, rank: int, *, device: torch.device | int | str | None = None,
                 timeout_s: float | None = None, owns_segment: bool = False):
        from ..kernels import records  # triton: optional, imported where the records are written

        lay = segment.layout
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < lay.world:
            raise ConfigError(f"rank ({rank!r}) must be an integer in [0, {lay.world - 1}]")
        if timeout_s is None:
            timeout_s = env.host_collective_timeout_s() or DEFAULT_TIMEOUT_S
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ConfigError(f"timeout_s ({timeout_s!r}) must be a number of seconds in (0, 3600]")
        self._kernels, self._rank, self._timeout_s = records, rank, float(timeout_s)
        self._device = _device_of(device)
        self._segment, self._owns_segment, self._layout = segment, owns_segment, lay
        if self._device.type == "cuda":
            segment.register_mapped(self._device.index)
        self._open, self._round, self._written = True, 0, None
        view = segment.as_tensor()
        self._seg32, self._seg64 = view.view(torch.int32), view.view(torch.int64)
        self._scratch = torch.zeros(lay.capacity // 4, dtype=torch.int32, device=self._device)
        self._state = torch.zeros(2, dtype=torch.int64, device=self._device)  # ticket, round
        self._flags = [ctypes.c_uint64.from_address(segment.address + lay.flag_offset(r, 0))
                       for r in range(lay.world)]
        self._targets: dict[tuple[int, int, int], object] = {}
        segment.mark(rank, ATTACHED)

    @classmethod
    def for_group(cls, capacity_bytes: int, group: dist.ProcessGroup | None = None, *,
                  device: torch.device | int | str | None = None,
                  timeout_s: float | None = None) -> RecordExchange:
        """This rank's RecordExchange on a segment shared by `group` (every rank, all on this host, calls
        it), for records of up to `capacity_bytes`."""
        seg = open_segment(capacity_bytes, group)
        try:
            return cls(seg, dist.get_rank(group), device=device, timeout_s=timeout_s, owns_segment=True)
        except BaseException:
            seg.close()
            raise

    world = property(lambda self: self._layout.world, doc="R, the ranks sharing the segment.")
    capacity_words = property(lambda self: self._layout.capacity // 4, doc="The largest record, in int32 words.")
    round = property(lambda self: self._round, doc="Records written so far by this rank's host.")

    def fits(self, waves: int, slots_per_rank: int, rider_words: int = 0) -> bool:
        """Whether a record of this shape fits the segment's slots."""
        return record_words(waves, self.world, slots_per_rank, rider_words) <= self.capacity_words

    def write(self, slots_W: list[torch.Tensor], slots_per_rank: int, rider_V: torch.Tensor | None = None) -> None:
        """Enqueue the record of `slots_W` (int64 [T_w, K] per wave, global slots in [0, R * S); a slot
        outside counts nowhere) and `rider_V` (int32 [V] or None) on the current stream: the kernel
        writes it into this rank's slot and publishes the next round. No wait for the GPU."""
        if not self._open:
            raise CommError("this RecordExchange is closed")
        if self._written is not None:
            raise CommError(f"round {self._round}'s record was written but not read: call read() first")
        S, R, W = slots_per_rank, self.world, len(slots_W)
        V = 0 if rider_V is None else self._check_rider(rider_V)
        target = self._target(W, S, V)
        self._check_slots(slots_W)
        self._round += 1
        self._written = (record_words(W, R, S, V), record_tag(W, R, S, V))
        last = W - 1
        for w, slots_TK in enumerate(slots_W):
            self._kernels.write_wave(slots_TK, w, (W, S, R), rider_V, target, publish=w == last)

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's record of the round written last: int32 [R, L] on the host (into `out` when given,
        a contiguous CPU tensor of that shape and dtype). Waits at most timeout_s for each rank:
        PeerTimeout names a rank that did not publish, CommError one whose record has another shape."""
        if self._written is None:
            raise CommError("read() needs a write() before it (one read per write)")
        L, tag = self._written
        n, R, lay = self._round, self.world, self._layout
        if out is None:
            out = torch.empty(R, L, dtype=torch.int32)
        elif out.shape != (R, L) or out.dtype != torch.int32 or out.device.type != "cpu" or not out.is_contiguous():
            raise InputError(f"out must be a contiguous int32 CPU tensor of shape ({R}, {L}), got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        for r in range(R):
            seen = self._flags[r].value
            if seen & _ROUND_MASK < n:
                seen = self._wait(r, n)
            if seen & _ROUND_MASK == n and seen >> ROUND_BITS != tag:
                raise CommError(f"control records on rank {self._rank}: rank {r}'s record of round {n} has "
                                f"another shape (tag {seen >> ROUND_BITS:#x}, expected {tag:#x}); every rank "
                                f"must write records of the same waves, slots and rider words")
            ctypes.memmove(out.data_ptr() + 4 * L * r, self._segment.address + lay.slot_offset(r, n & 1), 4 * L)
        ahead = [r for r in range(R) if self._flags[r].value & _ROUND_MASK > n + 1]
        if ahead:
            raise CommError(f"control records on rank {self._rank}: ranks {ahead} are more than one round "
                            f"ahead of round {n}, so their records may have been overwritten; the ranks are "
                            f"out of step (each must read every round it writes)")
        self._written = None
        return out

    def exchange(self, slots_W: list[torch.Tensor], slots_per_rank: int,
                 rider_V: torch.Tensor | None = None) -> torch.Tensor:
        """`write` then `read`: every rank's record, int32 [R, L] on the host."""
        self.write(slots_W, slots_per_rank, rider_V)
        return self.read()

    def _wait(self, r: int, n: int) -> int:
        flag = self._flags[r]
        start = time.monotonic()
        while True:
            seen = flag.value
            if seen & _ROUND_MASK >= n:
                return seen
            waited = time.monotonic() - start
            if waited > self._timeout_s:
                raise self._timeout(r, n)
            if waited > YIELD_S:
                time.sleep(NAP_S)
            elif waited > SPIN_S:
                os.sched_yield()

    def _timeout(self, r: int, n: int) -> CommError:
        what = f"control records on rank {self._rank}: waited more than {self._timeout_s:g} s for"
        if r == self._rank:
            return CommError(f"{what} this rank's own record of round {n}: its kernel has not run (a busy or "
                             f"stuck GPU?)")
        return PeerTimeout(f"{what} rank {r}'s record of round {n}; rank {r} {self._segment.peer_state(r)}. "
                           f"Every rank must write and read the same rounds; a rank that is only slow needs a "
                           f"larger timeout_s", rank=r, round=n)

    def _target(self, W: int, S: int, V: int):
        key = (W, S, V)
        target = self._targets.get(key)
        if target is None:
            if isinstance(S, bool) or not isinstance(S, int) or S < 1 or W < 1:
                raise InputError(f"slots_per_rank ({S!r}) must be a positive int, and slots_W a non-empty list")
            L, lay = record_words(W, self.world, S, V), self._layout
            if L > self.capacity_words:
                raise InputError(f"a record of {L} words ({W} waves, {self.world * S} slots, {self.world} ranks, "
                                 f"{V} rider words) exceeds the segment's {self.capacity_words} words: open it "
                                 f"with capacity_bytes >= {4 * L}")
            tag_hi = record_tag(W, self.world, S, V) << ROUND_BITS
            target = self._kernels.RecordTarget(
                self._seg32, self._seg64, lay.slot_offset(self._rank, 0) // 4, lay.capacity // 4,
                lay.flag_offset(self._rank, 0) // 8, tag_hi - (1 << 64) if tag_hi >= 1 << 63 else tag_hi,
                self._scratch, self._state)
            self._targets[key] = target
        return target

    def _check_slots(self, slots_W: list[torch.Tensor]) -> None:
        K = None
        for w, slots_TK in enumerate(slots_W):
            if not isinstance(slots_TK, torch.Tensor) or slots_TK.dtype != torch.int64 or slots_TK.dim() != 2 \
                    or slots_TK.device != self._device or not slots_TK.is_contiguous():
                raise InputError(f"slots_W[{w}] must be a contiguous int64 [T, K] tensor on {self._device}, got "
                                 f"{getattr(slots_TK, 'dtype', type(slots_TK).__name__)} "
                                 f"{tuple(getattr(slots_TK, 'shape', ()))} on {getattr(slots_TK, 'device', '-')}")
            if K is not None and slots_TK.shape[1] != K:
                raise InputError(f"every wave needs the same K; slots_W[{w}] has {slots_TK.shape[1]}, not {K}")
            K = slots_TK.shape[1]
        if K == 0:
            raise InputError("slots_W: K (experts per token) must be at least 1")

    def _check_rider(self, rider_V: torch.Tensor) -> int:
        if not isinstance(rider_V, torch.Tensor) or rider_V.dtype != torch.int32 or rider_V.dim() != 1 \
                or rider_V.device != self._device or not rider_V.is_contiguous():
            raise InputError(f"rider_V must be a contiguous int32 [V] tensor on {self._device}, got "
                             f"{getattr(rider_V, 'dtype', type(rider_V).__name__)} "
                             f"{tuple(getattr(rider_V, 'shape', ()))} on {getattr(rider_V, 'device', '-')}")
        return rider_V.numel()

    def close(self) -> None:
        """Wait for this device's work, mark this rank closed, unregister the segment (idempotent)."""
        if not self._open:
            return
        self._open = False
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._segment.mark(self._rank, CLOSED)
        self._seg32 = self._seg64 = None
        self._targets.clear()
        if self._device.type == "cuda":
            self._segment.unregister_mapped()
        if self._owns_segment:
            self._segment.close()

    def __enter__(self) -> RecordExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
