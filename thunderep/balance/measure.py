"""Measured link bandwidth for the migration cost check: what each rank measures, how it travels,
how the ranks agree on one value.

What is measured
----------------
Per rank and layer, `LinkMeter` keeps the rate at which this rank's dispatch and combine all-to-alls
(forward and backward) move bytes to the other ranks: EMA(bytes sent to other ranks per step) /
EMA(wall seconds of those transfers per step), a ratio of two EMAs, so a step weighs by its bytes.
The bytes and seconds are the dispatcher's own accounting (`CommStats`: bytes per op and peer, wall
time from launch to completed wait); the meter takes their differences from one step to the next.

Why these transfers and not the migrations': they run every step on every rank over every link of
the EP group, so a measurement exists from the first step and follows the link as it is now
(contention from other layers and other traffic included). Migrations are rare (at least
`min_dwell` steps apart), the first one must be decided before any happened, and a rank that only
receives, or sends nothing, would have no sample. The price: an all-to-all's wall time also holds
its launch latency, compute overlapped with it and peers that arrive late, so the measured rate is a
*lower bound* of what the link moves in bulk - the cost check errs toward not migrating. (The times
are host times of the waits: they time the transfer where the wait blocks the host until it is done,
as with gloo; where a wait returns earlier, turn measurement off with `BalancerConfig.measure`.)

How it travels
--------------
A measurement is a 16-bit code (`encode_bandwidth`): an unsigned minifloat with a 6-bit exponent and
a 10-bit mantissa, value = (1 + m / 1024) * 2^e B/s for code = e * 1024 + m, covering 1 B/s to
1.8e19 B/s in steps of 1/1024 (log-scale in the exponent, linear within an octave). Encoding rounds
to the nearest code: the decoded value is within 2^-11 (0.05%) of the measured one. Code 0 means "no
measurement yet". Decoding uses only exact operations (an integer times a power of two), so every
host decodes a code to the same float. The code rides in one int32 word of the Negotiate record
(`records.encode_record`): 4 bytes per rank on a Negotiate step, nothing on a Stable step.

How ranks agree
---------------
Every rank receives every rank's code in the same exchange and takes `agreed_code(codes_R)`: the
smallest non-zero code, i.e. the slowest rank's measurement (the slowest link sets the time a
migration takes; codes are monotone in the value, so the integer minimum is the minimum bandwidth).
None measured: 0, and the cost check uses the configured `BalancerConfig.bandwidth`.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..errors import ConfigError

__all__ = ["BANDWIDTH_CODES", "LinkMeter", "agreed_code", "decode_bandwidth", "encode_bandwidth"]

MANTISSA_BITS = 10
EXPONENT_MAX = 63
BANDWIDTH_CODES = 1 << 16  # codes 0 .. 65535; 0 = no measurement
RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)  # bound of |decode(encode(x)) / x - 1| within the range


def encode_bandwidth(bytes_per_s: float | None) -> int:
    """A bandwidth in B/s -> its 16-bit code (0 for None; clamped to codes 1 .. 65535)."""
    if bytes_per_s is None:
        return 0
    x = float(bytes_per_s)
    if not x > 0 or math.isnan(x):
        raise ConfigError(f"a measured bandwidth must be > 0 B/s, got {bytes_per_s!r}")
    if math.isinf(x):
        return BANDWIDTH_CODES - 1
    mant, exp = math.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1): exact
    e, m = exp - 1, round((2.0 * mant - 1.0) * (1 << MANTISSA_BITS))
    if m == 1 << MANTISSA_BITS:
        e, m = e + 1, 0
    if e < 0:
        return 1
    if e > EXPONENT_MAX:
        return BANDWIDTH_CODES - 1
    return max(1, (e << MANTISSA_BITS) | m)


def decode_bandwidth(code: int) -> float | None:
    """A 16-bit code -> B/s (None for 0). Exact arithmetic: the same float on every host."""
    code = int(code)
    if not 0 <= code < BANDWIDTH_CODES:
        raise ConfigError(f"a bandwidth code is an integer in [0, {BANDWIDTH_CODES - 1}], got {code}")
    if code == 0:
        return None
    e, m = divmod(code, 1 << MANTISSA_BITS)
    return math.ldexp((1 << MANTISSA_BITS) + m, e - MANTISSA_BITS)


def agreed_code(codes_R: Sequence[int]) -> int:
    """The code every rank uses: the smallest non-zero one (the slowest measurement), 0 if none."""
    codes = [int(c) for c in codes_R]
    if any(not 0 <= c < BANDWIDTH_CODES for c in codes):
        raise ConfigError(f"bandwidth codes are integers in [0, {BANDWIDTH_CODES - 1}], got {codes[:8]}")
    measured = [c for c in codes if c]
    return min(measured) if measured else 0


class LinkMeter:
    """This rank's measured bandwidth for one layer (see the module docstring). Rank-local.

    alpha: the EMA weight per step (the balancer's `ema_alpha`). `observe(bytes, seconds)` adds one
    step's transfers; `observe_stats(stats)` takes them from a `CommStats`' running totals.
    """

    OPS = ("dispatch", "combine", "dispatch_backward", "combine_backward")

    def __init__(self, alpha: float = 0.3):
        if not 0 < alpha <= 1:
            raise ConfigError(f"LinkMeter alpha ({alpha!r}) must be in (0, 1]")
        self.alpha = alpha
        self.bytes_ema: float | None = None
        self.seconds_ema: float | None = None
        self._last: tuple[int, float] = (0, 0.0)

    @property
    def bandwidth(self) -> float | None:
        """Measured B/s, or None before the first step that sent bytes to another rank."""
        if self.bytes_ema is None:
            return None
        return self.bytes_ema / self.seconds_ema

    @property
    def code(self) -> int:
        """`encode_bandwidth(self.bandwidth)`: what this rank's Negotiate record carries."""
        return encode_bandwidth(self.bandwidth)

    def observe(self, remote_bytes: float, seconds: float) -> None:
        """One step's transfers: bytes this rank sent to other ranks, wall seconds they took. A step
        that sent nothing remote (or took no measurable time) is no evidence and is skipped."""
        if not (remote_bytes > 0 and seconds > 0):
            return
        if self.bytes_ema is None:
            self.bytes_ema, self.seconds_ema = float(remote_bytes), float(seconds)
        else:
            a = self.alpha
            self.bytes_ema = (1 - a) * self.bytes_ema + a * remote_bytes
            self.seconds_ema = (1 - a) * self.seconds_ema + a * seconds

    def observe_stats(self, stats) -> None:
        """Add the transfers `stats` (a `CommStats`) recorded since the last call: its remote bytes
        and seconds of the dispatch and combine ops, forward and backward. After a `stats.reset()`
        the totals restart from there (that step gives no sample)."""
        now = (sum(stats.remote_bytes(op) for op in self.OPS), sum(stats.seconds[op] for op in self.OPS))
        (b0, s0), self._last = self._last, now
        if now[0] >= b0 and now[1] >= s0:
            self.observe(now[0] - b0, now[1] - s0)

    def state_dict(self) -> dict:
        """The two EMAs (plain floats or None). The running totals last read belong to the live
        `CommStats`, not to the measurement, and are not saved."""
        return {"bytes_ema": self.bytes_ema, "seconds_ema": self.seconds_ema}

    def load_state_dict(self, state: dict) -> None:
        b, s = state["bytes_ema"], state["seconds_ema"]
        if (b is None) != (s is None) or (b is not None and not (b > 0 and s > 0)):
            raise ConfigError(f"not a LinkMeter state: bytes_ema={b!r}, seconds_ema={s!r}")
        self.bytes_ema, self.seconds_ema = (None, None) if b is None else (float(b), float(s))
