"""Mailbox records against bytes changed behind their writer's back: every record carries the XXH3-64
checksum its writer computed from its own buffer, and a reader that copies anything else raises
`CommError`; a process flipping header fields and record bytes while ranks attach and exchange never
crashes them and never gets a changed record accepted."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import xxhash

from thunderep.comm import mailbox as mailbox_mod
from thunderep.errors import CommError, ConfigError

if not mailbox_mod.native_available():  # pragma: no cover - depends on the machine
    pytest.skip(f"mailbox extension unavailable: {mailbox_mod.native_unavailable_reason()}",
                allow_module_level=True)

from thunderep.comm.mailbox import Mailbox

SHM = "/dev/shm"
CHECKED = 0x314B4843  # a cell's flags when it carries a checksum ("CHK1")
GOLDEN = 0x9E3779B97F4A7C15


def _cell(slot_size: int, rank: int, round: int) -> int:
    """Byte offset of rank's cell for `round` (native/mailbox.c: header, then per rank info + 2 cells)."""
    cell_stride = 64 + (slot_size + 63) // 64 * 64
    return 64 + rank * (64 + 2 * cell_stride) + 64 + (round & 1) * cell_stride


def _open(name: str):
    import mmap
    fd = os.open(os.path.join(SHM, name.lstrip("/")), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


@pytest.fixture
def pair():
    a = Mailbox.create(world_size=2, slot_size=256, timeout_s=1.0)
    b = Mailbox.attach(a.name, world_size=2, slot_size=256, rank=1, generation=a.generation, timeout_s=1.0)
    seg = _open(a.name)
    a.unlink()
    yield a, b, seg
    seg.close()
    b.close()
    a.close()


def test_a_record_carries_the_xxh3_of_its_payload(pair):
    a, b, seg = pair
    payload = bytes(range(200))
    a.publish(1, payload)
    off = _cell(256, 0, 1)
    length, flags, checksum = struct.unpack_from("<IIQ", seg, off + 24)
    seed = (a.generation ^ (1 * GOLDEN)) % 2**64
    assert (length, flags) == (200, CHECKED)
    assert checksum == xxhash.xxh3_64_intdigest(payload, seed=seed)
    b.publish(1, b"x" * 200)
    assert b.collect(1)[0] == payload


def test_a_payload_byte_changed_after_publish_is_refused(pair):
    a, b, seg = pair
    a.publish(1, b"\x01" * 256)
    b.publish(1, b"\x02" * 256)
    seg[_cell(256, 0, 1) + 64 + 100] ^= 0x04  # one bit of rank 0's payload, as a stray writer would
    with pytest.raises(CommError, match=r"rank 0 .*record for round 1 does not match its checksum"):
        b.collect(1)


def test_without_checksums_the_same_change_goes_unnoticed(pair):
    """What the checksum is for: the seqlock alone accepts the changed bytes."""
    a, b, seg = pair
    a.set_checksum(False)
    a.publish(1, b"\x01" * 256)
    b.publish(1, b"\x02" * 256)
    seg[_cell(256, 0, 1) + 64 + 100] ^= 0x04
    assert b.collect(1)[0][100] == 0x05


def test_a_flipped_flag_bit_is_refused_not_read_as_unchecked(pair):
    a, b, seg = pair
    a.publish(1, b"\x01" * 64)
    b.publish(1, b"\x02" * 64)
    seg[_cell(256, 0, 1) + 28] ^= 0x01
    with pytest.raises(CommError, match="does not match its checksum"):
        b.collect(1)


def test_set_checksum_takes_a_bool(pair):
    with pytest.raises(ConfigError, match="checksum must be True or False"):
        pair[0].set_checksum(1)


_FLIPPER = """
import mmap, os, random, struct, sys, time
target, prefix, slot = sys.argv[1], sys.argv[2], int(sys.argv[3])
cells = 64 + 2 * (64 + slot)


def mapped(path):
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


head = mapped(target)  # the segment the ranks attach to: its header geometry changes under them
world, stride = struct.unpack_from("<I", head, 12)[0], struct.unpack_from("<I", head, 24)[0]
rng, flips, seg, seg_name = random.Random(0), 0, None, None
while not os.path.exists(target + ".stop"):
    flips += 1
    struct.pack_into("<I", head, 12, world if flips % 2 else 200)
    struct.pack_into("<I", head, 24, stride if flips % 3 else 0xFFFF0)
    if flips % 64 == 0:  # follow the ranks to the newest exchange segment
        names = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
        if names and names[-1] != seg_name:
            try:
                seg, seg_name = mapped("/dev/shm/" + names[-1]), names[-1]
            except OSError:
                pass
    if seg is not None:  # one bit of any cell of either rank (rank infos left alone: pids)
        pos = 64 + rng.randrange(2 * cells)
        if (pos - 64) % cells >= 64:
            seg[pos] ^= 1 << rng.randrange(8)
    time.sleep(0.0002)
struct.pack_into("<I", head, 12, world)
struct.pack_into("<I", head, 24, stride)
print(flips)
"""

_RANKS = """
import itertools, sys
from thunderep.comm.mailbox import Mailbox
from thunderep.errors import CommError, PeerTimeout
name, gen, rounds, attaches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
counts = {"ok": 0, "CommError": 0, "PeerTimeout": 0, "attach_ok": 0, "attach_refused": 0,
          "attach_geometry": 0, "wrong": 0}
for i in range(attaches):  # attaches while the header's geometry changes under them
    try:  # ranks 1..255 in turn: a rank attaches once, later attaches of it are refused as taken
        Mailbox.attach(name, world_size=256, slot_size=256, rank=1 + i % 255, generation=gen,
                       timeout_s=0.05).close()
        counts["attach_ok"] += 1
    except CommError as exc:
        counts["attach_refused"] += 1
        counts["attach_geometry"] += "size" in str(exc)  # world size, slot size or segment size
done = 0
for n in itertools.count():  # exchanges while cell bytes change: a broken pair is replaced by a new one
    if done == rounds:
        break
    a = Mailbox.create(world_size=2, slot_size=256, name=f"/tepfuzz-{name[1:]}-{n:08d}", timeout_s=0.05)
    b = Mailbox.attach(a.name, world_size=2, slot_size=256, rank=1, generation=a.generation, timeout_s=0.05)
    try:
        for rnd in range(1, rounds - done + 1):
            pa, pb = rnd.to_bytes(8, "little") * 32, (rnd ^ 0xFFFF).to_bytes(8, "little") * 32
            a.publish(rnd, pa)
            b.publish(rnd, pb)
            got = (a.collect(rnd), b.collect(rnd))
            done += 1
            counts["ok"] += 1
            counts["wrong"] += sum(g != [pa, pb] for g in got)
    except (CommError, PeerTimeout) as exc:
        done += 1
        counts[type(exc).__name__] += 1
    finally:
        a.unlink()
        b.close()
        a.close()
print(counts, flush=True)
"""


def _fuzz(rounds: int, attaches: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with Mailbox.create(world_size=256, slot_size=256) as target:
        path = os.path.join(SHM, target.name[1:])
        flipper = subprocess.Popen([sys.executable, "-c", _FLIPPER, path, f"tepfuzz-{target.name[1:]}-",
                                    "256"], stdout=subprocess.PIPE, text=True)
        try:
            ranks = subprocess.run([sys.executable, "-c", _RANKS, target.name, str(target.generation),
                                    str(rounds), str(attaches)], capture_output=True, text=True, env=env,
                                   timeout=900)
        finally:
            open(path + ".stop", "w").close()
            flips = int(flipper.communicate(timeout=30)[0])
            os.unlink(path + ".stop")
            target.unlink()
    assert ranks.returncode == 0, f"the ranks' process ended with {ranks.returncode}: {ranks.stderr[-2000:]}"
    counts = eval(ranks.stdout.strip().splitlines()[-1], {})  # the dict literal the child printed
    assert flips > 100, flips
    return counts


@pytest.mark.parametrize("rounds, attaches", [pytest.param(10_000, 2_000, id="1e4"),
                                               pytest.param(100_000, 100_000, id="1e5",
                                                            marks=pytest.mark.slow)])
def test_flipped_bytes_never_crash_and_are_never_accepted(rounds, attaches):
    counts = _fuzz(rounds, attaches)
    assert counts["wrong"] == 0, counts  # no changed record was ever accepted
    assert counts["ok"] + counts["CommError"] + counts["PeerTimeout"] == rounds, counts
    assert counts["attach_ok"] + counts["attach_refused"] == attaches, counts
    assert counts["attach_ok"] > 0 and counts["attach_geometry"] > 0, counts
    assert counts["CommError"] > 0 and counts["ok"] > 0, counts
