"""Shared-memory mailbox: the Python door to the C core in `native/mailbox.c`.

This is the only module that imports the private extension `thunderep.comm._mailbox_native`. It
validates every argument, turns C status codes into `CommError` / `PeerTimeout`, and never unpickles
anything read from the segment: records are plain bytes.

A `Mailbox` maps one POSIX shared-memory segment holding one seqlocked record slot per rank of a
process group on one host. Rank r publishes its record for round n and collects every rank's record
for round n; rounds start at 1 and advance by one. See `native/mailbox.h` for the layout.

The extension is built at install time; missing from a source checkout, it is built on first use
into the user's cache when a C compiler exists. Otherwise `native_available()` is False and creating
a mailbox raises `CommError` saying how to fix it; importing this module never fails because of it.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Any, NamedTuple

from ..errors import CommError, ConfigError, PeerTimeout
from .native_build import build_on_first_use
from .segments import cleanup_stale_segments, new_segment_name

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Mailbox",
    "PeerInfo",
    "cleanup_stale_segments",
    "native_available",
    "native_unavailable_reason",
    "new_segment_name",
]

DEFAULT_TIMEOUT_S = 10.0
_MODULE = "thunderep.comm._mailbox_native"
_STATE_NAMES = {0: "never attached", 1: "attached", 2: "closed"}

_native: Any = None
_native_error: str | None = None


class PeerInfo(NamedTuple):
    """What a segment says about one rank."""

    rank: int
    pid: int
    state: str  # "never attached" | "attached" | "closed"
    last_round: int


# ---------------------------------------------------------------- loading the extension

def _load() -> Any:
    """Return the extension module, importing or (in a source checkout) building it once."""
    global _native, _native_error
    if _native is not None:
        return _native
    if _native_error is not None:
        raise CommError(_native_error)
    try:  # deferred: the extension may be missing; then it is built on first use
        from . import _mailbox_native as mod  # type: ignore[attr-defined]
    except ImportError as exc:
        try:
            mod = _build_on_first_use(exc)
        except CommError as err:
            _native_error = str(err)
            raise
    _native = mod
    return mod


def _build_on_first_use(import_error: ImportError) -> Any:
    fix = (
        "install a C compiler (e.g. `apt install gcc`) and reinstall thunderep "
        "(`pip install --force-reinstall --no-deps thunderep`), or build in place from a checkout "
        "with `python native/build_mailbox.py`; until then use the collective control plane"
    )
    return build_on_first_use("mailbox", _MODULE, ("mailbox.c", "mailbox.h", "build_mailbox.py", "build_common.py",
                                                   "third_party/xxhash/xxhash.h"), import_error, fix, CommError)


def native_unavailable_reason() -> str | None:
    """Why the mailbox extension cannot be used, or None when it can (imports or builds it once)."""
    try:
        _load()
    except CommError as err:
        return str(err)
    return None


def native_available() -> bool:
    """True when the mailbox extension can be used (imports or builds it on the first call)."""
    return native_unavailable_reason() is None


# ---------------------------------------------------------------- the mailbox

def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} ({value!r}) must be an integer in [{lo}, {hi}]")
    return value


def _timeout_ns(timeout_s: Any) -> int:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
        raise ConfigError(f"timeout_s ({timeout_s!r}) must be a number of seconds in (0, 86400]")
    return int(timeout_s * 1e9)


class Mailbox:
    """One rank's handle on a shared-memory mailbox segment.

    Create it on one rank with `Mailbox.create(...)`, hand `name` and `generation` to the others (they
    are not secrets, but the name is unguessable), attach there with `Mailbox.attach(...)`, and
    `unlink()` the name once every rank has attached. Use as a context manager or call `close()`.
    Not thread-safe.
    """

    def __init__(self, _handle: Any, name: str, mod: Any, timeout_s: float):
        # Private: use create() or attach().
        self._ffi, self._lib, self._mb = mod.ffi, mod.lib, _handle
        self._name = name
        self._world = int(self._lib.tep_world_size(_handle))
        self._rank = int(self._lib.tep_rank(_handle))
        self._slot_size = int(self._lib.tep_slot_size(_handle))
        self._generation = int(self._lib.tep_generation(_handle))
        self._timeout_ns = _timeout_ns(timeout_s)
        self._unlinked = False
        # Preallocated per-call buffers: the hot path allocates only its result.
        self._out = self._ffi.new("char[]", self._world * self._slot_size)
        self._out_buf = self._ffi.buffer(self._out)
        self._lens = self._ffi.new("uint32_t[]", self._world)
        self._diag = self._ffi.new("tep_diag *")

    # -- lifecycle

    @classmethod
    def create(cls, *, world_size: int, slot_size: int, rank: int = 0, name: str | None = None,
               generation: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Mailbox:
        """Create a new segment (mode 0600) and attach to it as `rank`."""
        mod = _load()
        world_size, slot_size, rank = cls._check_args(mod, world_size, slot_size, rank, timeout_s)
        name = new_segment_name() if name is None else cls._check_name(name)
        generation = secrets.randbits(63) + 1 if generation is None else _check_int(
            "generation", generation, 1, 2**64 - 1)
        pp, diag = mod.ffi.new("tep_mailbox **"), mod.ffi.new("tep_diag *")
        st = mod.lib.tep_create(name.encode(), world_size, rank, slot_size, generation, pp, diag)
        if st:
            raise CommError(_open_error(mod, st, diag, "create", name, world_size, slot_size, generation))
        return cls(pp[0], name, mod, timeout_s)

    @classmethod
    def attach(cls, name: str, *, world_size: int, slot_size: int, rank: int, generation: int = 0,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Mailbox:
        """Attach to an existing segment as `rank`; checks owner, mode, magic, version, world size,
        slot size and (when non-zero) generation, raising `CommError` naming the mismatch."""
        mod = _load()
        world_size, slot_size, rank = cls._check_args(mod, world_size, slot_size, rank, timeout_s)
        name = cls._check_name(name)
        generation = _check_int("generation", generation, 0, 2**64 - 1)
        pp, diag = mod.ffi.new("tep_mailbox **"), mod.ffi.new("tep_diag *")
        st = mod.lib.tep_attach(name.encode(), world_size, rank, slot_size, generation, pp, diag)
        if st:
            raise CommError(_open_error(mod, st, diag, "attach to", name, world_size, slot_size,
                                        generation))
        return cls(pp[0], name, mod, timeout_s)

    @staticmethod
    def _check_args(mod: Any, world_size: int, slot_size: int, rank: int,
                    timeout_s: float) -> tuple[int, int, int]:
        _timeout_ns(timeout_s)
        world_size = _check_int("world_size", world_size, 1, int(mod.lib.TEP_MAX_WORLD))
        slot_size = _check_int("slot_size", slot_size, 1, int(mod.lib.TEP_MAX_SLOT_SIZE))
        rank = _check_int("rank", rank, 0, world_size - 1)
        return world_size, slot_size, rank

    @staticmethod
    def _check_name(name: Any) -> str:
        if not isinstance(name, str) or not re.fullmatch(r"/[A-Za-z0-9_.-]{1,200}", name):
            raise ConfigError(f"segment name ({name!r}) must be '/' followed by 1-200 characters "
                              f"from [A-Za-z0-9_.-]")
        return name

    def unlink(self) -> None:
        """Remove the segment's name (idempotent); attached ranks keep their mappings."""
        if self._unlinked:
            return
        self._unlinked = True
        st = self._lib.tep_unlink(self._name.encode(), self._diag)
        if st and not (st == self._lib.TEP_ERR_SYS and self._diag.os_errno == 2):  # ENOENT: already gone
            raise CommError(f"cannot unlink mailbox segment {self._name}: "
                            f"{os.strerror(self._diag.os_errno)}")

    def close(self) -> None:
        """Mark this rank closed and unmap the segment (idempotent). Peers are not affected; ones
        still waiting for this rank's record get `PeerTimeout` saying it closed."""
        mb, self._mb = self._mb, None
        if mb is not None:
            self._lib.tep_close(mb)

    def __enter__(self) -> Mailbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- properties

    name = property(lambda self: self._name, doc="Segment name, '/tep-...'.")
    world_size = property(lambda self: self._world)
    rank = property(lambda self: self._rank)
    slot_size = property(lambda self: self._slot_size, doc="Largest record in bytes.")
    generation = property(lambda self: self._generation, doc="Random id chosen by the creator.")
    closed = property(lambda self: self._mb is None)

    @property
    def last_round(self) -> int:
        return int(self._lib.tep_last_round(self._handle()))

    @property
    def address(self) -> int:
        """Address of the mapping in this process (for registering it with CUDA)."""
        return int(self._ffi.cast("uintptr_t", self._lib.tep_base(self._handle())))

    @property
    def nbytes(self) -> int:
        """Size of the mapping in bytes (a multiple of 4096)."""
        return int(self._lib.tep_size(self._handle()))

    def peer_info(self, rank: int) -> PeerInfo:
        """What the segment records about `rank`: pid, state and last published round."""
        _check_int("rank", rank, 0, self._world - 1)
        d = self._ffi.new("tep_diag *")
        self._lib.tep_peer_info(self._handle(), rank, d)
        return PeerInfo(rank, int(d.pid), _STATE_NAMES.get(int(d.state), str(d.state)), int(d.peer_round))

    def set_backoff(self, *, spin_us: float, yield_us: float, sleep_max_us: float) -> None:
        """Polling schedule: spin with a pause instruction for `spin_us`, then `sched_yield` until
        `yield_us`, then block until a peer publishes, at most `sleep_max_us` at a time."""
        for key, v in (("spin_us", spin_us), ("yield_us", yield_us), ("sleep_max_us", sleep_max_us)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e7:
                raise ConfigError(f"{key} ({v!r}) must be a number of microseconds in [0, 1e7]")
        self._lib.tep_set_backoff(self._handle(), int(spin_us * 1e3), int(yield_us * 1e3),
                                  int(sleep_max_us * 1e3))

    def set_checksum(self, on: bool) -> None:
        """Whether this rank's records carry an XXH3-64 checksum of their payload (on by default: about
        28 ns to hash a 256-byte record here, docs/benchmarks/2026-12-05-hardening.md). Readers check every record
        that carries one and raise `CommError` when the bytes changed after their writer published."""
        if not isinstance(on, bool):
            raise ConfigError(f"checksum must be True or False, not {on!r}")
        self._lib.tep_set_checksum(self._handle(), int(on))

    # -- records

    def publish(self, round: int, data: bytes | bytearray | memoryview) -> None:
        """Write this rank's record for `round` (the last published round + 1)."""
        ptr, n = self._record(data)
        _check_int("round", round, 1, 2**64 - 1)
        st = self._lib.tep_publish(self._handle(), round, ptr, n)
        if st:
            self._diag.rank, self._diag.found = self._rank, self.last_round
            self._raise(st, round, n)

    def collect(self, round: int, *, timeout_s: float | None = None) -> list[bytes]:
        """Wait for every rank's record of `round`; raises `PeerTimeout` naming the silent rank."""
        _check_int("round", round, 1, 2**64 - 1)
        t = self._timeout_ns if timeout_s is None else _timeout_ns(timeout_s)
        st = self._lib.tep_collect(self._handle(), round, self._out, self._slot_size, self._lens,
                                   0xFFFFFFFF, t, self._diag)
        if st:
            self._raise(st, round, None)
        s, buf, lens = self._slot_size, self._out_buf, self._lens
        return [buf[r * s: r * s + lens[r]] for r in range(self._world)]

    def exchange(self, round: int, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Publish `data` for `round` and collect every rank's record of that round (all of the same
        length as `data`). The hot path of the control plane."""
        n = len(data) if type(data) is bytes else -1
        if n < 0 or n > self._slot_size:
            data, n = self._record(data)
        try:
            st = self._lib.tep_exchange(self._mb, round, data, n, self._out, self._lens, self._timeout_ns,
                                        self._diag)
        except (OverflowError, TypeError) as exc:
            self._handle()  # a closed mailbox is the likelier cause
            raise CommError(f"round ({round!r}) must be an integer in [1, 2**64): {exc}") from None
        if st:
            self._raise(st, round, n)
        raw = self._out_buf[: n * self._world]
        return [raw[i: i + n] for i in range(0, n * self._world, n)] if n else [b""] * self._world

    def exchange_address(self, round: int, address: int, nbytes: int,
                         out_address: int = 0) -> memoryview | None:
        """Like `exchange`, from `nbytes` bytes at `address` in this process (e.g. a contiguous CPU
        tensor's data_ptr()). The packed records (world_size * nbytes bytes) are written to
        `out_address` when given (the caller guarantees the room; returns None), else to an internal
        buffer whose view is returned and stays valid until the next call on this mailbox."""
        for key, v in (("address", address), ("out_address", out_address)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CommError(f"{key} ({v!r}) must be a non-negative integer")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= self._slot_size:
            raise CommError(f"record of {nbytes!r} bytes exceeds the mailbox slot size ({self._slot_size})")
        if nbytes and not address:
            raise CommError("address must be non-zero for a non-empty record")
        cast = self._ffi.cast
        out = cast("void *", out_address) if out_address else self._out
        try:
            st = self._lib.tep_exchange(self._handle(), round, cast("void *", address), nbytes, out,
                                        self._lens, self._timeout_ns, self._diag)
        except (OverflowError, TypeError) as exc:
            self._handle()  # a closed mailbox is the likelier cause
            raise CommError(f"round ({round!r}) must be an integer in [1, 2**64): {exc}") from None
        if st:
            self._raise(st, round, nbytes)
        return None if out_address else memoryview(self._out_buf)[: nbytes * self._world]

    def _reserve_external(self, round: int) -> tuple[dict[str, int], int, int]:
        """For mailbox_cuda: claim `round` for a writer outside this process's CPU (field offsets,
        even seq before the write, generation)."""
        layout = self._ffi.new("tep_cell_layout *")
        seq, gen = self._ffi.new("uint64_t *"), self._ffi.new("uint64_t *")
        st = self._lib.tep_reserve_external(self._handle(), round, layout, seq, gen, self._diag)
        if st:
            self._raise(st, round, None)
        fields = {k: int(getattr(layout, k)) for k in ("seq", "round", "generation", "length", "payload")}
        return fields, int(seq[0]), int(gen[0])

    # -- internals

    def _handle(self) -> Any:
        if self._mb is None:
            raise CommError(f"mailbox {self._name} (rank {self._rank}) is closed")
        return self._mb

    def _record(self, data: Any) -> tuple[Any, int]:
        self._handle()
        if isinstance(data, bytes):
            ptr, n = data, len(data)
        elif isinstance(data, (bytearray, memoryview)):
            ptr = self._ffi.from_buffer(data)
            n = len(ptr)
        else:
            raise CommError(f"a mailbox record must be bytes, bytearray or memoryview, "
                            f"not {type(data).__name__}")
        if n > self._slot_size:
            raise CommError(f"record of {n} bytes exceeds the mailbox slot size ({self._slot_size}); "
                            f"create the mailbox with a larger slot_size")
        return ptr, n

    def _raise(self, st: int, round: int, length: int | None) -> None:
        lib, d = self._lib, self._diag
        if self._mb is None:
            self._handle()
        rank, who = int(d.rank), f"rank {int(d.rank)} (pid {int(d.pid)})"
        waited = f"{d.waited_ns / 1e9:.3g} s"
        if st == lib.TEP_ERR_TIMEOUT:
            raise PeerTimeout(f"{who} did not publish its record for round {round} within {waited} "
                              f"(its last round is {int(d.peer_round)}; this is rank {self._rank}): "
                              f"the peer is stalled or the ranks diverged; raise timeout_s if it is "
                              f"just slow", rank=rank, round=round)
        if st == lib.TEP_ERR_PEER_DEAD:
            raise PeerTimeout(f"{who} exited before publishing its record for round {round} (its last "
                              f"round was {int(d.peer_round)}): restart the process group",
                              rank=rank, round=round)
        if st == lib.TEP_ERR_PEER_CLOSED:
            raise PeerTimeout(f"{who} closed its mailbox before publishing its record for round {round} "
                              f"(its last round was {int(d.peer_round)}): every rank must make the "
                              f"same calls before close()", rank=rank, round=round)
        if st == lib.TEP_ERR_DESYNC:
            raise CommError(f"{who} published round {int(d.found)} while rank {self._rank} collects "
                            f"round {round}: the ranks made different numbers of exchange calls")
        if st == lib.TEP_ERR_LENGTH:
            raise CommError(f"{who} sent a {int(d.found)}-byte record in round {round} where rank "
                            f"{self._rank} sent {length} bytes: every rank must pass records of the "
                            f"same length in a round")
        if st == lib.TEP_ERR_CHECKSUM:
            raise CommError(f"{who}'s record for round {round} does not match its checksum: bytes of the "
                            f"shared segment changed after the rank published them (another process "
                            f"writing into it, or memory corruption)")
        if st == lib.TEP_ERR_ROUND:
            raise CommError(f"round {round} cannot be published by rank {self._rank}: its last round "
                            f"is {int(d.found)} and rounds must advance by exactly one")
        if st == lib.TEP_ERR_TOO_LARGE:
            raise CommError(f"record of {length} bytes exceeds the mailbox slot size ({self._slot_size})")
        raise CommError(f"mailbox {self._name}: call failed with status {st} in round {round}")


_SYS_HINTS = {
    2: "it does not exist (the creating rank failed, or unlinked it before this rank attached)",
    13: "permission denied",
    17: "a segment of that name already exists (pick a new name)",
    28: "/dev/shm is full (free space or remove stale segments)",
}


def _open_error(mod: Any, st: int, d: Any, verb: str, name: str, world: int, slot: int, gen: int) -> str:
    lib, found, err = mod.lib, int(d.found), int(d.os_errno)
    why = {
        lib.TEP_ERR_SYS: _SYS_HINTS.get(err) or os.strerror(err),
        lib.TEP_ERR_MAGIC: f"not a ThunderEP mailbox (magic {found:#018x}, "
                           f"expected {int(lib.TEP_MAGIC):#018x})",
        lib.TEP_ERR_VERSION: f"layout version {found}, this build reads version {int(lib.TEP_VERSION)}: "
                             f"every rank must run the same thunderep version",
        lib.TEP_ERR_WORLD: f"it was created for world size {found}, this rank expects {world}",
        lib.TEP_ERR_SLOT: f"it was created with slot size {found} bytes, this rank expects {slot}",
        lib.TEP_ERR_SIZE: f"its size ({found} bytes) does not match its header: the segment is corrupt",
        lib.TEP_ERR_GENERATION: f"its generation {found:#x} differs from the agreed {gen:#x} "
                                f"(a stale or foreign segment)",
        lib.TEP_ERR_OWNER: f"it belongs to uid {found >> 32} with mode {found & 0o7777:#o}; a mailbox must "
                           f"belong to this user (uid {os.geteuid()}) with mode 0o600",
        lib.TEP_ERR_RANK_TAKEN: f"rank {int(d.rank)} is already {_STATE_NAMES.get(found, found)} "
                                f"(pid {int(d.pid)}); each rank attaches once",
        lib.TEP_ERR_ARG: f"invalid argument (value {found})",
    }.get(st, f"status {st}")
    return f"cannot {verb} mailbox segment {name}: {why}"
