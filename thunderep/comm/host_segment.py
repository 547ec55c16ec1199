"""The shared host segment of the host collectives (`comm/host_collective.py`): its layout, its creation,
attachment and cleanup as a POSIX shared-memory file, and the status lines where ranks say they attached
and where a rank's kernel records why it gave up. Host code only: CUDA registers the segment through
`register_cuda`, given the caller's cupy.

Layout (`SegmentLayout`), LINE = 128 bytes: a header line (magic, version, world, capacity, size); one
status line per rank (host: pid, state; GPU: error code, peer, call, chunk); one flag line per (rank,
chunk), holding `tag << ROUND_BITS | call`; then per rank two slots (the call's parity) of `capacity`
bytes. The name follows `segments.new_segment_name`, so `cleanup_stale_segments` removes a crashed run's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..errors import CommError, ConfigError, PeerTimeout, ThunderError
from .segments import new_segment_name

__all__ = ["ATTACHED", "CHUNK_BYTES", "CLOSED", "ERR_BLOCK", "ERR_CODE", "ERR_PEER", "ERR_ROUND", "ErrorRecord",
           "HostSegment", "LINE", "MAX_CAPACITY", "MAX_WORLD", "MISMATCH", "NEVER_ATTACHED", "ROUND_BITS",
           "SegmentLayout", "TIMED_OUT", "error_for", "open_segment"]

LINE = 128  # bytes per header, status and flag line
CHUNK_BYTES = 4096  # bytes per thread block and call; a block owns the same chunk of every slot
MAX_WORLD = 64
MAX_CAPACITY = 1 << 26
ROUND_BITS = 48  # a flag holds the call number in its low 48 bits, the call's tag above them
MAGIC, VERSION = 0x4C4F434854504554, 1  # b"TEPHCOL" little-endian
_HEADER = struct.Struct("<QIIQQ")  # magic, version, world, capacity, nbytes
_STATUS = struct.Struct("<QI")  # pid, state (host-written at offset 0 of the rank's line)
ERR_CODE, ERR_PEER, ERR_ROUND, ERR_BLOCK = 16, 20, 24, 32  # GPU-written, in the rank's status line
NEVER_ATTACHED, ATTACHED, CLOSED = 0, 1, 2
TIMED_OUT, MISMATCH = 1, 2
_SHM_DIR = Path("/dev/shm")
_NAME_BYTES = 128


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} ({value!r}) must be an integer in [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets in the segment of `world` ranks with `capacity` bytes per slot (a CHUNK_BYTES multiple)."""

    world: int
    capacity: int

    @classmethod
    def of(cls, world: int, capacity_bytes: int) -> SegmentLayout:
        """The layout for `world` ranks and messages of up to `capacity_bytes` per rank (rounded up)."""
        _int("world", world, 1, MAX_WORLD)
        _int("capacity_bytes", capacity_bytes, 1, MAX_CAPACITY)
        return cls(world, -(-capacity_bytes // CHUNK_BYTES) * CHUNK_BYTES)

    @property
    def blocks(self) -> int:
        """Thread blocks (chunks) of the largest call; each has its own flags and call counter."""
        return self.capacity // CHUNK_BYTES

    def status_offset(self, rank: int) -> int:
        return LINE * (1 + rank)

    @property
    def flags_offset(self) -> int:
        return LINE * (1 + self.world)

    def flag_offset(self, rank: int, block: int) -> int:
        return self.flags_offset + LINE * (rank * self.blocks + block)

    @property
    def slots_offset(self) -> int:
        end = self.flags_offset + LINE * self.world * self.blocks
        return -(-end // CHUNK_BYTES) * CHUNK_BYTES

    def slot_offset(self, rank: int, parity: int) -> int:
        return self.slots_offset + (2 * rank + parity) * self.capacity

    @property
    def nbytes(self) -> int:
        return self.slots_offset + 2 * self.world * self.capacity


class ErrorRecord(NamedTuple):
    """What a rank's kernel recorded when it gave up: code (TIMED_OUT or MISMATCH), the peer, the call."""

    code: int
    peer: int
    round: int
    block: int


def error_for(record: ErrorRecord, rank: int, timeout_s: float, peer_state: str) -> ThunderError:
    """The exception for `rank`'s error record: PeerTimeout (a peer did not arrive) or CommError."""
    what = f"host collective on rank {rank}: call {record.round} (chunk {record.block})"
    again = "every rank must make the same calls (operation, dtype, size) in the same order"
    if record.code == TIMED_OUT:
        return PeerTimeout(f"{what} waited more than {timeout_s:g} s for rank {record.peer}, which "
                           f"{peer_state}; {again}, and a rank that is only slow needs a larger timeout_s "
                           f"(THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S); the segment's calls are out of step now: "
                           f"close it", rank=record.peer, round=record.round)
    if record.code == MISMATCH:
        return CommError(f"{what} differs from rank {record.peer}'s call {record.round}; {again}")
    return CommError(f"{what}: unknown error code {record.code} in the segment (a corrupted segment?)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostSegment:
    """One rank's mapping of a segment laid out by `SegmentLayout` (host code only).

    Create it on one rank with `create`, attach on the others by `name` with `attach`, `unlink()` the name
    once every rank has attached (`open_segment` does all that over torch.distributed), `close()` to unmap.
    """

    def __init__(self, name: str, layout: SegmentLayout, fd: int):
        # Private: use create() or attach().
        self.name, self.layout = name, layout
        self._mm = mmap.mmap(fd, layout.nbytes)
        self._view = (ctypes.c_ubyte * layout.nbytes).from_buffer(self._mm)
        self.address = ctypes.addressof(self._view)
        self._cuda_refs, self._cuda_ptrs = 0, {}

    @staticmethod
    def _path(name: str) -> Path:
        if not isinstance(name, str) or not re.fullmatch(r"/[A-Za-z0-9_.-]{1,100}", name):
            raise ConfigError(f"segment name ({name!r}) must be '/' and 1-100 characters of [A-Za-z0-9_.-]")
        return _SHM_DIR / name[1:]

    @classmethod
    def create(cls, world: int, capacity_bytes: int, *, name: str | None = None) -> HostSegment:
        """A new zeroed segment (mode 0600) for `world` ranks and messages of up to `capacity_bytes`."""
        layout = SegmentLayout.of(world, capacity_bytes)
        name = new_segment_name() if name is None else name
        try:
            fd = os.open(cls._path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise CommError(f"cannot create host collective segment {name}: {exc.strerror}") from exc
        try:
            os.ftruncate(fd, layout.nbytes)
            seg = cls(name, layout, fd)
        except OSError as exc:
            os.unlink(cls._path(name))
            raise CommError(f"cannot size host collective segment {name} to {layout.nbytes} bytes: "
                            f"{exc.strerror} (is /dev/shm large enough?)") from exc
        finally:
            os.close(fd)
        _HEADER.pack_into(seg._mm, 0, MAGIC, VERSION, layout.world, layout.capacity, layout.nbytes)
        return seg

    @classmethod
    def attach(cls, name: str, world: int, capacity_bytes: int) -> HostSegment:
        """Map an existing segment; CommError unless its owner, mode, size and header match."""
        layout = SegmentLayout.of(world, capacity_bytes)
        try:
            fd = os.open(cls._path(name), os.O_RDWR)
        except OSError as exc:
            raise CommError(f"cannot attach to host collective segment {name}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size != layout.nbytes:
                raise CommError(f"host collective segment {name} is not this user's private segment of "
                                f"{layout.nbytes} bytes (owner {st.st_uid}, mode {st.st_mode & 0o777:o}, "
                                f"{st.st_size} bytes); were world and capacity_bytes the same on every rank?")
            seg = cls(name, layout, fd)
        finally:
            os.close(fd)
        got = _HEADER.unpack_from(seg._mm, 0)
        want = (MAGIC, VERSION, layout.world, layout.capacity, layout.nbytes)
        if got != want:
            seg.close()
            raise CommError(f"host collective segment {name} has header (magic, version, world, capacity, "
                            f"bytes) {got}, expected {want}")
        return seg

    def mark(self, rank: int, state: int) -> None:
        """Record in `rank`'s status line that this process attached (ATTACHED) or left (CLOSED)."""
        _STATUS.pack_into(self._mm, self.layout.status_offset(rank), os.getpid(), state)

    def peer_state(self, rank: int) -> str:
        """What the segment and the OS say about `rank`, for an error message."""
        pid, state = _STATUS.unpack_from(self._mm, self.layout.status_offset(rank))
        if state == NEVER_ATTACHED:
            return "never attached to the segment"
        if state == CLOSED:
            return f"closed its side (pid {pid})"
        return f"is attached (pid {pid})" if _pid_alive(pid) else f"exited (pid {pid})"

    def error(self, rank: int) -> ErrorRecord | None:
        """`rank`'s error record, or None while its kernels have recorded none."""
        base = self.layout.status_offset(rank)
        (code,) = struct.unpack_from("<I", self._mm, base + ERR_CODE)
        if not code:
            return None
        (peer,) = struct.unpack_from("<i", self._mm, base + ERR_PEER)
        (rnd,) = struct.unpack_from("<Q", self._mm, base + ERR_ROUND)
        (block,) = struct.unpack_from("<I", self._mm, base + ERR_BLOCK)
        return ErrorRecord(code, peer, rnd, block)

    def register_cuda(self, cp: Any, device: int) -> int:
        """Register the segment as mapped portable pinned memory (once per process); its device address."""
        with cp.cuda.Device(device):
            if self._cuda_refs == 0:
                try:
                    cp.cuda.runtime.hostRegister(self.address, self.layout.nbytes, 3)  # portable | mapped
                except Exception as exc:
                    raise CommError(f"cudaHostRegister of host collective segment {self.name} "
                                    f"({self.layout.nbytes} bytes) failed: {exc}") from exc
            self._cuda_refs += 1
            if device not in self._cuda_ptrs:
                rt = cp.cuda.runtime
                self._cuda_ptrs[device] = int(rt.hostGetDevicePointer(self.address, 0)) if hasattr(
                    rt, "hostGetDevicePointer") else int(rt.pointerGetAttributes(self.address).devicePointer)
        return self._cuda_ptrs[device]

    def unregister_cuda(self, cp: Any) -> None:
        """Drop one registration; the last one unregisters the segment (its kernels must have finished)."""
        self._cuda_refs -= 1
        if self._cuda_refs == 0:
            cp.cuda.runtime.hostUnregister(self.address)
            self._cuda_ptrs.clear()

    def as_tensor(self) -> torch.Tensor:
        """The mapping as a uint8 CPU tensor [nbytes], no copy. It dangles after `close()`: drop it first.
        Once registered with `register_mapped`, Triton kernels on the GPU take it for the segment."""
        return torch.frombuffer((ctypes.c_ubyte * self.layout.nbytes).from_address(self.address), dtype=torch.uint8)

    def register_mapped(self, device: int) -> None:
        """`register_cuda` through torch's CUDA runtime (no cupy; no device address: Triton's launcher
        maps the host address itself). Counted with register_cuda's registrations."""
        with torch.cuda.device(device):
            if self._cuda_refs == 0:
                err = torch.cuda.cudart().cudaHostRegister(self.address, self.layout.nbytes, 3)  # portable | mapped
                if int(err) != 0:
                    raise CommError(f"cudaHostRegister of host segment {self.name} ({self.layout.nbytes} bytes) "
                                    f"failed with CUDA error {int(err)}")
            self._cuda_refs += 1

    def unregister_mapped(self) -> None:
        """Drop one `register_mapped` registration; the last one unregisters (its kernels must have finished)."""
        self._cuda_refs -= 1
        if self._cuda_refs == 0:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._cuda_ptrs.clear()

    def unlink(self) -> None:
        """Remove the name (idempotent); mappings stay valid."""
        try:
            os.unlink(self._path(self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap (idempotent); CommError while CUDA registrations are still open."""
        if self._cuda_refs:
            raise CommError(f"host collective segment {self.name} is still registered with CUDA: close its "
                            f"HostCollectives first")
        if self._mm is not None:
            del self._view
            self._mm.close()
            self._mm = None

    def __enter__(self) -> HostSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_segment(capacity_bytes: int, group: dist.ProcessGroup | None = None) -> HostSegment:
    """The segment of `group`'s ranks, all on this host: rank 0 creates it and broadcasts its name, the
    others attach, and once every rank has, rank 0 unlinks the name. A rank that fails raises everywhere."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    root = dist.get_global_rank(group, 0) if group is not None else 0
    name_t = torch.zeros(_NAME_BYTES, dtype=torch.uint8, device=device)
    seg, failure = None, None
    try:
        if rank == 0:
            seg = HostSegment.create(world, capacity_bytes)
            name_t[:len(seg.name)] = torch.tensor(list(seg.name.encode()), dtype=torch.uint8)
    except ThunderError as exc:
        failure = exc
    dist.broadcast(name_t, src=root, group=group)
    name = bytes(name_t.cpu().tolist()).rstrip(b"\0").decode()
    if rank != 0 and name:
        try:
            seg = HostSegment.attach(name, world, capacity_bytes)
        except ThunderError as exc:
            failure = exc
    ok = torch.tensor([0 if failure or not name else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if rank == 0 and seg is not None:
        seg.unlink()
    if failure is not None:
        raise failure
    if not ok.item():
        if seg is not None:
            seg.close()
        raise CommError(f"rank {rank}: another rank could not create or attach to the host collective segment "
                        f"{name or '(none created)'}; its own error says why")
    return seg
