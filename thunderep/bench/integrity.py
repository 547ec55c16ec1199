"""What the mailbox's per-record checksum costs, two ways, per record size: the XXH3-64 hash alone in a C
loop compiled like the mailbox (-O2; needs a source checkout and a C compiler), and publish + collect of
one rank's records with the checksum on and off, side by side (the added time is one hash when written
and one when read, plus the noise of a Python call per exchange).

    thunderep bench integrity [--rounds N] [--blocks B]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..comm.mailbox import Mailbox

__all__ = ["hash_ns", "measure", "report"]

SIZES = (64, 256, 1024, 4096)
_NATIVE = Path(__file__).resolve().parents[2] / "native"
_LOOP = """
#define XXH_INLINE_ALL
#define XXH_NO_STREAM
#include "third_party/xxhash/xxhash.h"
uint64_t hash_loop(const unsigned char *data, uint64_t length, uint64_t iters) {
    uint64_t acc = 0;
    for (uint64_t i = 0; i < iters; ++i) acc += XXH3_64bits_withSeed(data, length, acc ^ i);
    return acc;  /* each seed depends on the previous hash: nothing is hoisted out of the loop */
}
"""


def hash_ns(sizes: tuple[int, ...] = SIZES, iters: int = 2_000_000, blocks: int = 5) -> dict[int, float]:
    """ns per XXH3-64 of one record of each size, in C (the fastest of `blocks` timed loops)."""
    import cffi  # deferred: only this measurement compiles C

    ffi = cffi.FFI()
    ffi.cdef("uint64_t hash_loop(const unsigned char *data, uint64_t length, uint64_t iters);")
    ffi.set_source("_tep_hash_loop", _LOOP, include_dirs=[str(_NATIVE)], extra_compile_args=["-O2"])
    with tempfile.TemporaryDirectory() as tmp:
        lib = ffi.dlopen(ffi.compile(tmpdir=tmp))
    out = {}
    for size in sizes:
        buf = ffi.new("unsigned char[]", bytes(i % 251 for i in range(size)))
        best = float("inf")
        for _ in range(blocks):
            t0 = time.perf_counter_ns()
            lib.hash_loop(buf, size, iters)
            best = min(best, (time.perf_counter_ns() - t0) / iters)
        out[size] = best
    return out


def _ns_per_round(mb: Mailbox, first_round: int, rounds: int, record: bytes) -> float:
    t0 = time.perf_counter_ns()
    for r in range(first_round, first_round + rounds):
        mb.exchange(r, record)
    return (time.perf_counter_ns() - t0) / rounds


def measure(sizes: tuple[int, ...] = SIZES, rounds: int = 100_000, blocks: int = 5) -> list[dict]:
    """Per size: the fastest block's ns per exchange (publish + collect, one rank) with the checksum off and on,
    blocks alternating so both see the same machine state."""
    rows = []
    for size in sizes:
        with Mailbox.create(world_size=1, slot_size=max(sizes)) as mb:
            mb.unlink()
            record, nxt, times = bytes(range(256)) * (size // 256) + bytes(size % 256), 1, {False: [], True: []}
            for _ in range(blocks):
                for on in (False, True):
                    mb.set_checksum(on)
                    times[on].append(_ns_per_round(mb, nxt, rounds, record))
                    nxt += rounds
        off, on = min(times[False]), min(times[True])  # the least disturbed block of each
        rows.append({"bytes": size, "off_ns": off, "on_ns": on, "added_ns": on - off})
    return rows


def report(rounds: int = 20_000, blocks: int = 21) -> str:
    """The markdown table of both measurements."""
    hashes = hash_ns()
    lines = ["| record bytes | XXH3-64 in C (ns) | exchange, checksum off (ns) | on (ns) | added (ns) |",
             "|---:|---:|---:|---:|---:|"]
    for row in measure(rounds=rounds, blocks=blocks):
        lines.append(f"| {row['bytes']} | {hashes[row['bytes']]:.1f} | {row['off_ns']:.0f} | {row['on_ns']:.0f} | "
                     f"{row['added_ns']:+.0f} |")
    return "\n".join(lines)
