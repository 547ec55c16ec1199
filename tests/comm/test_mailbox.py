"""Mailbox: layout checks, seqlock / round semantics, faults, and a multi-process stress test.

Several ranks of one segment can live in one process (each handle is its own mapping), which tests
the protocol without spawning; the stress and dead-peer tests spawn real processes.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import struct
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import pytest
import xxhash

from thunderep.comm import mailbox as mailbox_mod
from thunderep.errors import CommError, ConfigError, PeerTimeout

if not mailbox_mod.native_available():  # pragma: no cover - depends on the machine
    pytest.skip(f"mailbox extension unavailable: {mailbox_mod.native_unavailable_reason()}",
                allow_module_level=True)

from thunderep.comm.mailbox import DEFAULT_TIMEOUT_S, Mailbox, cleanup_stale_segments  # noqa: E402

SHM = "/dev/shm"


def _segments() -> set[str]:
    """Segments this process created (the name carries the creator's pid): other test workers and
    other programs on the machine make their own at the same time."""
    if not os.path.isdir(SHM):
        return set()
    return {n for n in os.listdir(SHM) if n.startswith("tep-") and n.split("-")[3:4] == [str(os.getpid())]}


@pytest.fixture(autouse=True)
def no_leftovers():
    before = _segments()
    yield
    leftovers = _segments() - before
    for name in leftovers:
        os.unlink(os.path.join(SHM, name))
    assert not leftovers, f"segments left in /dev/shm: {sorted(leftovers)}"


@pytest.fixture
def pair():
    """Ranks 0 and 1 of a 2-rank mailbox (slot 64 bytes) in this process."""
    a = Mailbox.create(world_size=2, slot_size=64, timeout_s=2.0)
    b = Mailbox.attach(a.name, world_size=2, slot_size=64, rank=1, generation=a.generation, timeout_s=2.0)
    a.unlink()
    yield a, b
    b.close()
    a.close()


def _poke(name: str, offset: int, fmt: str, value: int) -> int:
    """Overwrite a field of a segment through a raw mapping; returns the old value."""
    fd = os.open(os.path.join(SHM, name.lstrip("/")), os.O_RDWR)
    try:
        with mmap.mmap(fd, 4096) as m:
            (old,) = struct.unpack_from(fmt, m, offset)
            struct.pack_into(fmt, m, offset, value)
            return old
    finally:
        os.close(fd)


def _cell_offset(world_rank: int, round: int, slot_size: int) -> int:
    # Layout of native/mailbox.h: header (64), then per rank: rank info (64) + 2 cells.
    cell_stride = 64 + (slot_size + 63) // 64 * 64
    slot_stride = 64 + 2 * cell_stride
    return 64 + world_rank * slot_stride + 64 + (round & 1) * cell_stride


# ------------------------------------------------------------------ single process


def test_default_timeout_is_bounded():
    assert 0 < DEFAULT_TIMEOUT_S <= 10


def test_segment_mode_is_0600_even_with_open_umask():
    old = os.umask(0)
    try:
        with Mailbox.create(world_size=2, slot_size=8) as mb:
            st = os.stat(os.path.join(SHM, mb.name.lstrip("/")))
            assert st.st_mode & 0o7777 == 0o600
            assert st.st_uid == os.geteuid()
            assert st.st_size == mb.nbytes and mb.nbytes % 4096 == 0
            mb.unlink()
            mb.unlink()  # idempotent
    finally:
        os.umask(old)


def test_exchange_collect_and_rounds(pair):
    a, b = pair
    for rnd in range(1, 6):
        b.publish(rnd, bytes([rnd]) * 3)
        assert a.exchange(rnd, bytes([100 + rnd]) * 3) == [bytes([100 + rnd]) * 3, bytes([rnd]) * 3]
        assert b.collect(rnd) == [bytes([100 + rnd]) * 3, bytes([rnd]) * 3]
    b.publish(6, bytearray(b"xy"))
    a.publish(6, memoryview(b"abcd"))
    assert a.collect(6) == [b"abcd", b"xy"]  # collect accepts records of different lengths
    assert a.peer_info(1).last_round == 6 and a.peer_info(1).state == "attached"
    with pytest.raises(CommError, match="advance by exactly one"):
        a.publish(8, b"")
    with pytest.raises(CommError, match="slot size"):
        a.publish(7, b"x" * 65)
    with pytest.raises(CommError, match="bytes, bytearray or memoryview"):
        a.exchange(7, "text")  # type: ignore[arg-type]
    with pytest.raises(CommError, match="round"):
        a.exchange(-1, b"x")
    assert a.last_round == 6


def test_stale_record_is_never_returned(pair):
    a, b = pair
    for rnd in (1, 2):
        b.publish(rnd, b"old%d" % rnd)
        a.exchange(rnd, b"new%d" % rnd)
    # Round 3 uses the cell that holds rank 1's round-1 record: it must not come back as round 3.
    a.publish(3, b"new3")
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        a.collect(3, timeout_s=0.2)
    assert info.value.rank == 1 and info.value.round == 3
    assert 0.2 <= time.monotonic() - t0 < 1.5
    assert "rank 1" in str(info.value) and "round 3" in str(info.value)
    b.publish(3, b"old3")
    assert a.collect(3) == [b"new3", b"old3"]


def test_record_being_written_is_not_returned():
    off = _cell_offset(1, 1, 64)
    with Mailbox.create(world_size=2, slot_size=64) as c:
        with Mailbox.attach(c.name, world_size=2, slot_size=64, rank=1) as d:
            d.publish(1, b"payload")
            c.publish(1, b"")
            seq = _poke(c.name, off, "<Q", 0)
            assert seq % 2 == 0
            _poke(c.name, off, "<Q", seq + 1)  # as if rank 1 were inside the seqlock
            with pytest.raises(PeerTimeout, match="rank 1"):
                c.collect(1, timeout_s=0.1)
            _poke(c.name, off, "<Q", seq)
            assert c.collect(1, timeout_s=0.1) == [b"", b"payload"]
        c.unlink()


def test_desync_and_length_mismatch_are_errors(pair):
    a, b = pair
    b.publish(1, b"12345678" * 2)
    with pytest.raises(CommError, match="16-byte record in round 1 where rank 0 sent 8 bytes"):
        a.exchange(1, b"12345678")
    for rnd in (2, 3):
        b.publish(rnd, b"")
    with pytest.raises(CommError, match="published round 3 while rank 0 collects round 1"):
        a.collect(1)


def test_closed_peer_is_reported_fast_and_its_last_record_survives(pair):
    a, b = pair
    b.publish(1, b"last words")
    b.close()
    b.close()  # idempotent
    assert a.exchange(1, b"0123456789") == [b"0123456789", b"last words"]
    assert a.peer_info(1).state == "closed"
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="closed its mailbox") as info:
        a.exchange(2, b"0123456789")
    assert (info.value.rank, info.value.round) == (1, 2)
    assert time.monotonic() - t0 < 1.0  # not the full timeout
    with pytest.raises(CommError, match="closed"):
        b.exchange(2, b"x")


def test_attach_validates_header():
    with Mailbox.create(world_size=2, slot_size=64) as mb:
        name = mb.name
        with pytest.raises(CommError, match="created for world size 2, this rank expects 3"):
            Mailbox.attach(name, world_size=3, slot_size=64, rank=1)
        with pytest.raises(CommError, match="slot size 64 bytes, this rank expects 128"):
            Mailbox.attach(name, world_size=2, slot_size=128, rank=1)
        with pytest.raises(CommError, match="generation .* differs"):
            Mailbox.attach(name, world_size=2, slot_size=64, rank=1, generation=mb.generation ^ 1)
        with pytest.raises(CommError, match="rank 0 is already attached"):
            Mailbox.attach(name, world_size=2, slot_size=64, rank=0)
        old = _poke(name, 0, "<Q", 0x1234)
        with pytest.raises(CommError, match="not a ThunderEP mailbox"):
            Mailbox.attach(name, world_size=2, slot_size=64, rank=1)
        _poke(name, 0, "<Q", old)
        old = _poke(name, 8, "<I", 99)
        with pytest.raises(CommError, match="layout version 99"):
            Mailbox.attach(name, world_size=2, slot_size=64, rank=1)
        _poke(name, 8, "<I", old)
        os.chmod(os.path.join(SHM, name.lstrip("/")), 0o644)
        with pytest.raises(CommError, match="mode 0o644"):
            Mailbox.attach(name, world_size=2, slot_size=64, rank=1)
        os.chmod(os.path.join(SHM, name.lstrip("/")), 0o600)
        with Mailbox.attach(name, world_size=2, slot_size=64, rank=1, generation=mb.generation) as peer:
            assert peer.rank == 1 and peer.generation == mb.generation
        mb.unlink()
        with pytest.raises(CommError, match="does not exist"):
            Mailbox.attach(name, world_size=2, slot_size=64, rank=1)


def test_argument_validation():
    with pytest.raises(ConfigError, match="world_size"):
        Mailbox.create(world_size=0, slot_size=8)
    with pytest.raises(ConfigError, match="rank"):
        Mailbox.create(world_size=2, slot_size=8, rank=2)
    with pytest.raises(ConfigError, match="slot_size"):
        Mailbox.create(world_size=2, slot_size=0)
    with pytest.raises(ConfigError, match="segment name"):
        Mailbox.attach("no-slash", world_size=2, slot_size=8, rank=1)
    with pytest.raises(ConfigError, match="timeout_s"):
        Mailbox.create(world_size=2, slot_size=8, timeout_s=0)


def test_stale_segments_of_dead_creators_are_cleaned():
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    uid, ns = os.geteuid(), os.stat("/proc/self/ns/pid").st_ino
    name = f"/tep-{uid}-{ns}-{dead.pid}-{'ab' * 8}"
    live = Mailbox.create(world_size=1, slot_size=8)  # named after this (live) process
    with Mailbox.create(world_size=1, slot_size=8, name=name):
        removed = cleanup_stale_segments()
    assert name in removed and live.name not in removed
    assert os.path.exists(os.path.join(SHM, live.name.lstrip("/")))
    live.unlink()
    live.close()


# ------------------------------------------------------------------ multi-process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, args):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    # Leave without tearing gloo down: with a dead peer in the group the teardown can block.
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(fn, world, *args, timeout=60.0, silent=()):
    """Run fn(rank, world, *args) in `world` spawned processes with gloo initialized; return the
    results by rank. Ranks in `silent` may exit without a result. Hard bound: `timeout` seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline, got = time.monotonic() + timeout, {}
    try:
        while len([r for r in got if r not in silent]) < world - len(silent):
            try:
                rank, ok, value = results.get(timeout=max(0.05, min(0.5, deadline - time.monotonic())))
                got[rank] = (ok, value)
            except queue.Empty:
                crashed = [r for r, p in enumerate(procs)
                           if r not in got and r not in silent and p.exitcode not in (None,)]
                if crashed:
                    time.sleep(0.5)  # let a last result arrive
                    while not results.empty():
                        rank, ok, value = results.get()
                        got[rank] = (ok, value)
                    crashed = [r for r in crashed if r not in got]
                    if crashed:
                        pytest.fail(f"ranks {crashed} died without a result "
                                    f"(exit codes {[procs[r].exitcode for r in crashed]})")
            if time.monotonic() > deadline:
                pytest.fail(f"multi-process test exceeded {timeout} s; results so far: {sorted(got)}")
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if errors:
        pytest.fail("\n".join(errors))
    return [got[r][1] if r in got else None for r in range(world)]


_REC = struct.Struct("<IIQ")  # rank, length, round; then payload; then xxh64 of everything before


def _record(rank: int, rnd: int, size: int) -> bytes:
    body_len = size - _REC.size - 8
    fill = ((rnd * 2654435761 + rank * 40503) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    body = _REC.pack(rank, size, rnd) + (fill * (body_len // 8 + 1))[:body_len]
    return body + xxhash.xxh64_digest(body)


def _stress_worker(rank, world, rounds, size, budget_s=None):
    """`rounds` rounds of checksummed records, or fewer where `budget_s` seconds run out first: the ranks
    agree after every block of 1000 rounds whether to go on (a loaded host can slow a round 100-fold)."""
    from thunderep.comm import make_control_plane

    if hasattr(os, "sched_setaffinity"):  # one core per rank: the run time stays predictable
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torn = stale = done = 0
    with make_control_plane("mailbox", record_bytes=size, timeout_s=10.0) as cp:
        t0 = time.perf_counter()
        while done < rounds:
            end = min(done + 1000, rounds)
            for rnd in range(done + 1, end + 1):
                recs = cp.exchange(_record(rank, rnd, size))
                for r, rec in enumerate(recs):
                    if xxhash.xxh64_digest(rec[:-8]) != rec[-8:]:
                        torn += 1
                    elif _REC.unpack_from(rec) != (r, size, rnd):
                        stale += 1
            done = end
            if budget_s is not None:  # every rank goes on only if none has run out of time
                over = time.perf_counter() - t0 > budget_s
                if b"1" in cp.exchange(b"1" if over else b"0"):
                    break
        elapsed = time.perf_counter() - t0
        cp.barrier()
    return {"torn": torn, "stale": stale, "seconds": elapsed, "rounds": done}


@pytest.mark.world_size(2)
def test_stress_1e5_rounds_no_torn_or_stale_records():
    """1e5 rounds (under a second on an idle host), or as many as 20 s allow on a loaded one: at least
    1e4, the same count on both ranks, no record torn or stale in any."""
    rounds = 100_000
    res = run_ranks(_stress_worker, 2, rounds, 256, 20.0, timeout=90.0)
    assert res[0]["rounds"] == res[1]["rounds"] >= 10_000, res
    for r in res:
        assert r["torn"] == 0 and r["stale"] == 0, res
    print(f"\n{res[0]['rounds']} rounds x 2 ranks, 256-byte records: {max(r['seconds'] for r in res):.2f} s")


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_stress_1e6_rounds_no_torn_or_stale_records():
    res = run_ranks(_stress_worker, 2, 1_000_000, 256, timeout=600.0)
    for r in res:
        assert r["torn"] == 0 and r["stale"] == 0 and r["rounds"] == 1_000_000, res


def _dead_peer_worker(rank, world, exit_rank, exit_round):
    from thunderep.comm import make_control_plane

    cp = make_control_plane("mailbox", timeout_s=8.0)
    for _ in range(exit_round - 1):
        cp.exchange(b"%8d" % rank)
    if rank == exit_rank:
        os._exit(0)  # dies without closing anything
    t0 = time.monotonic()
    try:
        cp.exchange(b"%8d" % rank)
    except PeerTimeout as exc:
        out = {"rank": exc.rank, "round": exc.round, "msg": str(exc), "seconds": time.monotonic() - t0}
    else:
        out = {"rank": None}
    try:
        cp.exchange(b"%8d" % rank)
    except CommError as exc:
        out["after"] = str(exc)
    cp.close()
    return out


@pytest.mark.world_size(3)
def test_dead_peer_raises_peer_timeout_naming_rank_and_round():
    res = run_ranks(_dead_peer_worker, 3, 2, 5, timeout=60.0, silent=(2,))
    for r in res[:2]:
        assert (r["rank"], r["round"]) == (2, 5), r
        assert "exited" in r["msg"], r
        assert r["seconds"] < 8.0  # detected before the timeout
        assert "failed in round 5 and cannot be used" in r["after"]


def _stall_worker(rank, world, stall_round, timeout_s):
    from thunderep.comm import make_control_plane

    with make_control_plane("mailbox", timeout_s=timeout_s) as cp:
        for _ in range(stall_round - 1):
            cp.exchange(b"ping")
        if rank == 1:
            time.sleep(timeout_s + 1.5)  # alive but silent
            return None
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout) as info:
            cp.exchange(b"ping")
        return {"rank": info.value.rank, "round": info.value.round, "seconds": time.monotonic() - t0,
                "msg": str(info.value)}


@pytest.mark.world_size(2)
def test_stalled_peer_raises_peer_timeout_within_timeout():
    res = run_ranks(_stall_worker, 2, 4, 1.0, timeout=60.0)
    r = res[0]
    assert (r["rank"], r["round"]) == (1, 4), r
    assert 1.0 <= r["seconds"] < 2.0, r
    assert "did not publish" in r["msg"] and "round 4" in r["msg"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


_TOGGLER = """
import mmap, os, struct, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 4096)
(world,), (stride,) = struct.unpack_from("<I", m, 12), struct.unpack_from("<I", m, 24)
end, flips = time.monotonic() + seconds, 0
while time.monotonic() < end:  # the header's geometry wrong half of the time, in every combination
    flips += 1
    struct.pack_into("<I", m, 12, world if flips % 2 else 200)
    struct.pack_into("<I", m, 24, stride if flips % 3 else 0xFFFF0)
    m[200 + flips % 64] ^= 0xFF  # and a payload byte of rank 0's cells
struct.pack_into("<I", m, 12, world)
struct.pack_into("<I", m, 24, stride)
print(flips)
"""

_ATTACHER = """
import sys, time
from thunderep.comm.mailbox import Mailbox
from thunderep.errors import CommError
name, seconds = sys.argv[1], float(sys.argv[2])
end, ok, refused = time.monotonic() + seconds, 0, 0
while time.monotonic() < end:
    try:
        Mailbox.attach(name, world_size=2, slot_size=64, rank=1, timeout_s=1.0).close()
        ok += 1
    except CommError:
        refused += 1
print(ok, refused)
"""


def test_a_header_changed_under_attaching_ranks_never_crashes_them():
    """Another process rewrites the header's world size and slot stride (and payload bytes) while a
    rank attaches over and over: the rank validates one private copy and uses only that, so every
    attach either succeeds or is a CommError; before, it re-read the header and could segfault."""
    with Mailbox.create(world_size=2, slot_size=64) as mb:
        path = os.path.join(SHM, mb.name.lstrip("/"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        toggler = subprocess.Popen([sys.executable, "-c", _TOGGLER, path, "4"], stdout=subprocess.PIPE, text=True)
        attacher = subprocess.run([sys.executable, "-c", _ATTACHER, mb.name, "3"], capture_output=True,
                                  text=True, env=env, timeout=60)
        flips = int(toggler.communicate(timeout=30)[0])
        mb.unlink()
    assert attacher.returncode == 0, (attacher.returncode, attacher.stderr[-2000:])
    ok, refused = (int(v) for v in attacher.stdout.split())
    assert flips > 1000 and ok + refused > 100, (flips, ok, refused)
