"""Reports of serving steps that stalled, with what ran in them (`StepWatch`)."""

from __future__ import annotations

import collections
import sys
import time

__all__ = ["StepWatch"]


class StepWatch:
    """Reports a serving step that stalled, with what ran in it that a server in its steady state does not:
    kernel tunings and compiles (ThunderEP's Triton kernels), CUDA-graph captures and decode-storage
    reallocations (`StaticDecodeBatch.events`). A decode step is reported when it took MIN_SECONDS or more
    and FACTOR times the median of the decode steps before it, or MIN_SECONDS with any of those events; a
    prefill (slow anyway for a long prompt) only with an event. Rank 0 reports every stall, naming the
    events of its own process or saying none ran there (it then waited for another rank, or the host
    stalled); another rank reports only stalls with events of its own. Events are counted since the
    previous report (or the start), and looked at only after a step of MIN_SECONDS or more: a steady step
    pays two clock reads."""

    MIN_SECONDS = 1.0
    FACTOR = 10.0

    def __init__(self, batch, rank: int, clock=None):
        self.batch, self.rank, self.clock = batch, rank, clock or time.perf_counter
        self.decode_s: collections.deque = collections.deque(maxlen=64)  # the last decode steps' seconds
        self.marks = self._marks()

    def _marks(self) -> collections.Counter:
        marks = collections.Counter(getattr(self.batch, "events", {}))
        tuning = sys.modules.get("thunderep.kernels.tuning")
        if tuning is not None:
            marks["kernel tuning"] = tuning.chosen_configs()
            try:
                marks["kernel compile"] = tuning.compiled_kernels()
            except Exception:  # noqa: BLE001 - a Triton whose caches look otherwise: no count, serving goes on
                pass
        return marks

    def start(self) -> float:
        return self.clock()

    def done(self, started: float, what: str, decode: bool) -> str | None:
        """The report line of a step that began at `started` (from `start()`), or None; printed here."""
        seconds = self.clock() - started
        if seconds < self.MIN_SECONDS:
            if decode:
                self.decode_s.append(seconds)
            return None
        typical = sorted(self.decode_s)[len(self.decode_s) // 2] if len(self.decode_s) >= 8 else None
        if decode:
            self.decode_s.append(seconds)
        marks = self._marks()
        events, self.marks = marks - self.marks, marks
        stalled = decode and typical is not None and seconds >= self.FACTOR * typical
        if not events and (self.rank != 0 or not stalled):
            return None
        ran = ", ".join(f"{n} {name}{'s' if n > 1 else ''}" for name, n in sorted(events.items())) if events else \
            "no kernel tuning or compile, graph capture or storage reallocation on this rank"
        usual = f" (median decode step {typical * 1e3:.1f} ms)" if typical is not None else ""
        line = f"slow step on rank {self.rank}: {what} took {seconds:.2f} s{usual}; since the last report: {ran}"
        print(f"[thunderep serve] {line}", file=sys.stderr, flush=True)
        return line
