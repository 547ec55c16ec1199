"""Control plane: small, frequent exchanges among the ranks of a process group.

Per MoE layer the expert-parallel runtime exchanges split sizes and load fingerprints: a few bytes per
rank, latency-critical. `ControlPlane` is the interface; two implementations share it:

* `MailboxControlPlane` - one host: seqlocked slots in POSIX shared memory (`mailbox.Mailbox`),
  no collective on the path (docs/BENCHMARKS.md, "Control plane (mailbox vs gloo)"); a silent peer
  raises `PeerTimeout` naming its rank and round.
* `CollectiveControlPlane` - any topology: torch.distributed collectives on the given group.

`make_control_plane("auto")` picks the mailbox when every rank of the group is on one host and the
native extension is available, the collective plane otherwise.

Every rank must make the same sequence of calls with records of the same length per call.
Shapes: R = ranks of the group.
"""

from __future__ import annotations

import abc
import ctypes
import hashlib
import os
import socket
import struct
import warnings
from typing import Sequence

import psutil
import torch
import torch.distributed as dist

from ..errors import CommError, ConfigError, ThunderError
from . import mailbox as _mailbox
from .mailbox import DEFAULT_TIMEOUT_S, Mailbox

__all__ = [
    "CollectiveControlPlane",
    "ControlPlane",
    "MailboxControlPlane",
    "make_control_plane",
]

DEFAULT_RECORD_BYTES = 4096
_MSG_BYTES = 256  # handshake messages: name + generation, or an error text


class ControlPlane(abc.ABC):
    """Exchange of fixed-size records, all-reduce-max and barrier among the ranks of a group.

    Collective: every rank makes the same calls in the same order. Not thread-safe. Close it with
    `close()` or use it as a context manager; closing does not destroy the process group.
    """

    kind: str = "abstract"

    def __init__(self, rank: int, world_size: int, record_bytes: int):
        self._rank, self._world, self._record_bytes = rank, world_size, record_bytes
        self._closed = False

    rank = property(lambda self: self._rank, doc="This process's rank in the group.")
    world_size = property(lambda self: self._world, doc="R, ranks in the group.")
    record_bytes = property(lambda self: self._record_bytes, doc="Largest record exchange() accepts.")
    closed = property(lambda self: self._closed)

    @abc.abstractmethod
    def exchange(self, record: bytes) -> list[bytes]:
        """Send `record` (at most `record_bytes`, same length on every rank) and return the R records
        of this round, indexed by rank (this rank's own included)."""

    def exchange_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """All-gather a small tensor: returns [R, *values.shape] of values.dtype on values.device."""
        t = self._check_tensor(values)
        cpu = t.detach().to("cpu").contiguous()
        nbytes = cpu.numel() * cpu.element_size()
        if nbytes == 0:
            self.barrier()
            return torch.empty((self._world, *t.shape), dtype=t.dtype, device=t.device)
        rows = self._gather_bytes(cpu, nbytes)
        return rows.view((self._world, *t.shape)).to(t.device)

    def allreduce_max(self, values: torch.Tensor | Sequence[int]) -> torch.Tensor | list[int]:
        """Elementwise maximum over ranks. A tensor gives a tensor (same shape, dtype, device); a
        sequence of ints (int64 range) gives a list of ints."""
        if isinstance(values, torch.Tensor):
            return self.exchange_tensor(values).amax(dim=0)
        n = len(_check_int_list(values))
        if 8 * n > self._record_bytes:
            raise CommError(f"{n} values need {8 * n} bytes, over the record size ({self._record_bytes})")
        fmt = f"<{n}q"
        rows = [struct.unpack(fmt, rec) for rec in self.exchange(struct.pack(fmt, *values))]
        return [max(col) for col in zip(*rows)]

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release this rank's resources (idempotent)."""

    def dead_peers(self) -> list[str]:
        """The peers known to have exited, closed or been stopped, one phrase each ("rank 1 (pid 4242)
        exited"): what a failed collective names. Empty where this plane cannot tell (collectives only)."""
        return []

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self._rank}, world_size={self._world}, "
                f"record_bytes={self._record_bytes}{', closed' if self._closed else ''})")

    # -- helpers for subclasses

    def _gather_bytes(self, cpu: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Default: exchange the tensor's bytes; returns [R * numel] of cpu.dtype (a fresh tensor)."""
        raw = b"".join(self.exchange(ctypes.string_at(cpu.data_ptr(), nbytes)))
        return torch.frombuffer(bytearray(raw), dtype=cpu.dtype)

    def _check_tensor(self, values: object) -> torch.Tensor:
        if self._closed:
            raise CommError(f"{type(self).__name__} (rank {self._rank}) is closed")
        if not isinstance(values, torch.Tensor):
            raise CommError(f"expected a torch.Tensor, got {type(values).__name__}")
        nbytes = values.numel() * values.element_size()
        if nbytes > self._record_bytes:
            raise CommError(f"tensor of {nbytes} bytes exceeds the control plane's record size "
                            f"({self._record_bytes}); pass a larger record_bytes to make_control_plane")
        return values


def _check_int_list(values: object) -> Sequence[int]:
    if not isinstance(values, (list, tuple)) or not all(
            type(v) is int and -2**63 <= v < 2**63 for v in values):
        raise CommError(f"allreduce_max takes a torch.Tensor or a list of int64-range ints, "
                        f"got {values!r:.80}")
    return values


def _check_record_bytes(record_bytes: object) -> int:
    if type(record_bytes) is not int or not 1 <= record_bytes <= 1 << 20:
        raise ConfigError(f"record_bytes ({record_bytes!r}) must be an integer in [1, 1048576]")
    return record_bytes


def _check_timeout(timeout_s: object) -> float:
    if type(timeout_s) not in (int, float) or not 0 < timeout_s <= 86400:  # type: ignore[operator]
        raise ConfigError(f"timeout_s ({timeout_s!r}) must be a number of seconds in (0, 86400]")
    return float(timeout_s)  # type: ignore[arg-type]


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int, torch.device]:
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized: call torch.distributed."
                          "init_process_group() before creating a control plane")
    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ConfigError(f"this process (global rank {dist.get_rank()}) is not a member of the group "
                          f"it builds a control plane for; only members may call it")
    return rank, dist.get_world_size(group), device


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# Newer torch deprecates all_gather_into_tensor in favour of all_gather_single; older has only the former.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _encode(text: str, device: torch.device) -> torch.Tensor:
    raw = text.encode()[:_MSG_BYTES - 2]
    buf = bytearray(_MSG_BYTES)
    buf[0:2] = len(raw).to_bytes(2, "little")
    buf[2:2 + len(raw)] = raw
    return torch.frombuffer(buf, dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> str:
    raw = bytes(t.cpu().tolist())
    return raw[2:2 + int.from_bytes(raw[:2], "little")].decode(errors="replace")


def _all_gather_text(text: str, group: dist.ProcessGroup | None, world: int,
                     device: torch.device) -> list[str]:
    out = torch.empty(world * _MSG_BYTES, dtype=torch.uint8, device=device)
    all_gather_single(out, _encode(text, device), group=group)
    return [_decode(row) for row in out.view(world, _MSG_BYTES)]


class CollectiveControlPlane(ControlPlane):
    """Control plane on torch.distributed collectives (gloo on CPU, NCCL on GPU); any topology.

    Waits are bounded by the process group's own timeout.
    """

    kind = "collective"

    def __init__(self, group: dist.ProcessGroup | None = None, *, record_bytes: int = DEFAULT_RECORD_BYTES):
        rank, world, self._device = _group_info(group)
        super().__init__(rank, world, _check_record_bytes(record_bytes))
        self._group = group

    def exchange(self, record: bytes) -> list[bytes]:
        if self._closed:
            raise CommError(f"CollectiveControlPlane (rank {self._rank}) is closed")
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise CommError(f"a record must be bytes, not {type(record).__name__}")
        n = len(memoryview(record).cast("B"))
        if n > self._record_bytes:
            raise CommError(f"record of {n} bytes exceeds record_bytes ({self._record_bytes})")
        if n == 0:
            self.barrier()
            return [b""] * self._world
        src = torch.frombuffer(bytearray(record), dtype=torch.uint8).to(self._device)
        out = torch.empty(self._world * n, dtype=torch.uint8, device=self._device)
        all_gather_single(out, src, group=self._group)
        out = out.cpu()
        raw = ctypes.string_at(out.data_ptr(), out.numel())
        return [raw[i:i + n] for i in range(0, len(raw), n)]

    def _gather_bytes(self, cpu: torch.Tensor, nbytes: int) -> torch.Tensor:
        out = torch.empty(self._world * cpu.numel(), dtype=cpu.dtype, device=self._device)
        all_gather_single(out, cpu.reshape(-1).to(self._device), group=self._group)
        return out.cpu()

    def allreduce_max(self, values: torch.Tensor | Sequence[int]) -> torch.Tensor | list[int]:
        if not isinstance(values, torch.Tensor):
            t = torch.tensor(list(_check_int_list(values)), dtype=torch.int64)
            return self.allreduce_max(t).tolist()  # type: ignore[union-attr]
        t = self._check_tensor(values)
        work = t.detach().to(self._device, copy=True).contiguous()
        dist.all_reduce(work, op=dist.ReduceOp.MAX, group=self._group)
        return work.to(t.device)

    def barrier(self) -> None:
        if self._closed:
            raise CommError(f"CollectiveControlPlane (rank {self._rank}) is closed")
        dist.barrier(group=self._group)

    def close(self) -> None:
        self._closed = True


class MailboxControlPlane(ControlPlane):
    """Control plane through a shared-memory `Mailbox`; every rank of `group` must be on this host.

    Construction is collective on `group`: rank 0 creates a segment (mode 0600, random name and
    generation), broadcasts name and generation, every rank attaches, and rank 0 unlinks the name once
    all have attached, so nothing is left in /dev/shm even if a process crashes later. Any rank's
    failure raises `CommError` on every rank. A peer silent for `timeout_s` raises `PeerTimeout`
    naming its rank and round; after that the plane is unusable.
    """

    kind = "mailbox"

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 record_bytes: int = DEFAULT_RECORD_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S):
        rank, world, device = _group_info(group)
        super().__init__(rank, world, _check_record_bytes(record_bytes))
        self._timeout_s = _check_timeout(timeout_s)
        self._round = 0
        self._failed: BaseException | None = None
        self._mb = self._connect(group, device)
        self._exchange = self._mb.exchange

    def _connect(self, group: dist.ProcessGroup | None, device: torch.device) -> Mailbox:
        mb: Mailbox | None = None
        if self._rank == 0:
            try:
                _mailbox.cleanup_stale_segments()
                mb = Mailbox.create(world_size=self._world, slot_size=self._record_bytes, rank=0,
                                    timeout_s=self._timeout_s)
                msg = f"ok {mb.generation} {mb.name}"
            except Exception as exc:  # reported to every rank below
                msg = f"error {exc}"
            t = _encode(msg, device)
        else:
            t = torch.empty(_MSG_BYTES, dtype=torch.uint8, device=device)
        dist.broadcast(t, src=_global_rank(group, 0), group=group)
        msg = _decode(t)
        status = "ok"
        if not msg.startswith("ok "):
            status = "rank 0 could not create the mailbox: " + msg[len("error "):]
        elif self._rank != 0:
            _, gen, name = msg.split(" ", 2)
            try:
                mb = Mailbox.attach(name, world_size=self._world, slot_size=self._record_bytes,
                                    rank=self._rank, generation=int(gen), timeout_s=self._timeout_s)
            except Exception as exc:
                status = f"rank {self._rank} could not attach: {exc}"
        statuses = _all_gather_text(status, group, self._world, device)  # every rank has attached
        if mb is not None and self._rank == 0:
            try:
                mb.unlink()
            except CommError:
                pass
        failures = [s for s in statuses if s != "ok"]
        if failures:
            if mb is not None:
                mb.close()
            raise CommError("mailbox control plane unavailable: " + "; ".join(dict.fromkeys(failures)))
        assert mb is not None
        return mb

    def dead_peers(self) -> list[str]:
        found = []
        for r in range(self._world):
            if r == self._rank or self._mb is None:
                continue
            info = self._mb.peer_info(r)
            if info.state == "closed":
                found.append(f"rank {r} (pid {info.pid}) closed its control plane")
            elif info.pid:
                state = _state(info.pid)
                if state != "running":
                    found.append(f"rank {r} (pid {info.pid}) {state}")
        return found

    @property
    def mailbox(self) -> Mailbox:
        """The underlying mailbox (e.g. for `mailbox_cuda.CudaMailboxWriter`)."""
        return self._mb

    @property
    def round(self) -> int:
        """Rounds completed so far (each exchange, barrier or all-reduce is one round)."""
        return self._round

    def exchange(self, record: bytes) -> list[bytes]:
        rnd = self._round + 1
        try:
            out = self._exchange(rnd, record)
        except ThunderError as exc:
            self._check_broken(rnd, exc)
            raise
        self._round = rnd
        return out

    def exchange_tensor(self, values: torch.Tensor) -> torch.Tensor:
        t = values
        if (type(t) is not torch.Tensor or t.device.type != "cpu" or t.requires_grad
                or not t.is_contiguous() or not 0 < t.nbytes <= self._record_bytes):
            return super().exchange_tensor(t)  # validates, moves, or handles empty tensors
        out = torch.empty((self._world, *t.shape), dtype=t.dtype)
        self._gather_into(t, t.nbytes, out)
        return out

    def _gather_bytes(self, cpu: torch.Tensor, nbytes: int) -> torch.Tensor:
        out = torch.empty(self._world * cpu.numel(), dtype=cpu.dtype)
        self._gather_into(cpu, nbytes, out)
        return out

    def _gather_into(self, src: torch.Tensor, nbytes: int, out: torch.Tensor) -> None:
        # The C core copies every rank's record straight into `out`: no intermediate buffers.
        rnd = self._round + 1
        if self._closed or self._failed is not None:
            self._exchange(rnd, b"")  # raises the reason
        try:
            self._mb.exchange_address(rnd, src.data_ptr(), nbytes, out.data_ptr())
        except ThunderError as exc:
            self._check_broken(rnd, exc)
            raise
        self._round = rnd

    def barrier(self) -> None:
        self.exchange(b"")

    def _check_broken(self, rnd: int, exc: ThunderError) -> None:
        # A failure after this rank published (timeout, desync) leaves the ranks out of step for good;
        # one before it (record too large) leaves the plane usable.
        if self._failed is None and not self._closed and self._mb.last_round >= rnd:
            self._failed = exc
            self._exchange = self._broken

    def _broken(self, rnd: int, record: object) -> list[bytes]:
        if self._closed:
            raise CommError(f"MailboxControlPlane (rank {self._rank}) is closed")
        raise CommError(f"the mailbox control plane of rank {self._rank} failed in round "
                        f"{self._round + 1} and cannot be used: {self._failed}") from self._failed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._exchange = self._broken
            self._mb.close()


def _host_key() -> str:
    """Ranks with equal keys can share a mailbox: same host (boot id), /dev/shm and user."""
    parts = [socket.gethostname(), str(os.geteuid())]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    try:
        st = os.stat("/dev/shm")
        parts.append(f"{st.st_dev}:{st.st_ino}")
    except OSError:
        parts.append("no-/dev/shm")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def make_control_plane(kind: str = "auto", group: dist.ProcessGroup | None = None, *,
                       record_bytes: int = DEFAULT_RECORD_BYTES,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> ControlPlane:
    """Build the control plane for `group` (collective: call it on every rank of the group).

    kind: "mailbox" (one host, raises `CommError` if impossible), "collective", or "auto" (mailbox
    when all ranks share this host and the native extension is available, else collective, with a
    `RuntimeWarning` when only the extension or the segment setup was missing).
    timeout_s bounds every mailbox wait (the collective plane uses the group's timeout).
    """
    if kind not in ("auto", "mailbox", "collective"):
        raise ConfigError(f"control plane kind ({kind!r}) must be 'auto', 'mailbox' or 'collective'")
    _check_record_bytes(record_bytes)
    _check_timeout(timeout_s)
    if kind == "collective":
        return CollectiveControlPlane(group, record_bytes=record_bytes)
    rank, world, device = _group_info(group)
    reason = _mailbox.native_unavailable_reason()
    info = _all_gather_text(f"{_host_key()} {'native' if reason is None else 'none'}", group, world, device)
    keys = [s.split(" ")[0] for s in info]
    lacking = [r for r, s in enumerate(info) if not s.endswith(" native")]
    if len(set(keys)) > 1:
        if kind == "mailbox":
            others = [r for r, k in enumerate(keys) if k != keys[rank]]
            raise CommError(f"the mailbox control plane needs every rank on one host (and user and "
                            f"/dev/shm), but ranks {others} differ from rank {rank}; use kind='collective'")
        return CollectiveControlPlane(group, record_bytes=record_bytes)
    if lacking:
        why = reason or f"ranks {lacking} lack the mailbox extension"
        if kind == "mailbox":
            raise CommError(f"mailbox control plane unavailable: {why}")
        warnings.warn(f"thunderep: using the collective control plane: {why}", RuntimeWarning, stacklevel=2)
        return CollectiveControlPlane(group, record_bytes=record_bytes)
    try:
        return MailboxControlPlane(group, record_bytes=record_bytes, timeout_s=timeout_s)
    except CommError as exc:  # raised on every rank alike, so falling back keeps the group in step
        if kind == "mailbox":
            raise
        warnings.warn(f"thunderep: using the collective control plane: {exc}", RuntimeWarning, stacklevel=2)
        return CollectiveControlPlane(group, record_bytes=record_bytes)


def _state(pid: int) -> str:
    """"exited" (a zombie too: exited, not yet reaped), "is stopped (SIGSTOP or a debugger)" or "running"."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "exited"
    if status == psutil.STATUS_ZOMBIE:
        return "exited"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "is stopped (SIGSTOP or a debugger)"
    return "running"
