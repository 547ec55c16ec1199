"""Stopping a server cleanly on SIGTERM: drain what is being generated, refuse the rest, then end every
rank's serving loop (`StopRequest`)."""

from __future__ import annotations

import time

from ..comm.launch import GRACE_S
from ..comm.stop import raise_stopped
from ..errors import Stopped
from .config import ServeConfig
from .http_api import Server

__all__ = ["StopRequest"]


class StopRequest:
    """SIGTERM on a serving rank (its handler, `comm.stop.stop_on_sigterm`). Before the serving loop starts it
    raises `Stopped`: nothing is open yet. After, it marks the time, and rank 0's loop stops: new and
    queued requests are refused (503), those being generated get --drain-timeout seconds to finish
    (`drain`), then rank 0's next message tells every rank to end. A rank other than 0 that took SIGTERM
    alone (rank 0 goes on serving) ends by itself once rank 0 has not ended the loop within
    --drain-timeout + GRACE_S (`overdue`); rank 0 then fails its requests as for any rank that died."""

    def __init__(self):
        self.serving = False
        self.at: float | None = None  # when SIGTERM came (time.monotonic)
        self.generating = self.cut = self.refused = 0  # at SIGTERM; cut at --drain-timeout; refused queued

    def __call__(self, signum, frame) -> None:
        if not self.serving:
            raise_stopped(signum, frame)
        if self.at is None:
            self.at = time.monotonic()

    def drain(self, server: Server, jobs: dict, drain_s: float) -> bool:
        """Rank 0 once SIGTERM came: refuse new and queued requests, fail the ones in `jobs` (key -> Job,
        being generated) once `drain_s` has passed. Whether the serving loop can end (none left)."""
        if not server.stopping:
            self.generating = len(jobs)
            self.refused = server.refuse_new("the server is stopping (SIGTERM); send the request again")
            print(f"[thunderep serve] stopping (SIGTERM): {self.generating} request(s) being generated get "
                  f"up to {drain_s:g} s to finish (--drain-timeout); new and queued ones get 503", flush=True)
        if jobs and time.monotonic() - self.at >= drain_s:
            self.cut = len(jobs)
            for job in jobs.values():
                server.fail(job, f"the server stopped before this answer was complete: SIGTERM, and "
                                 f"--drain-timeout {drain_s:g} s passed")
            jobs.clear()
        return not jobs

    def overdue(self, config: ServeConfig) -> bool:
        return self.at is not None and time.monotonic() - self.at > config.drain_timeout + GRACE_S

    def end_if_overdue(self, config: ServeConfig) -> None:
        """A rank other than 0 whose rank 0 has not ended the loop in time after SIGTERM ends by itself."""
        if self.overdue(config):
            raise Stopped("stopped by SIGTERM: rank 0 did not end the serving loop in time")

    def summary(self, drain_s: float) -> str:
        return (f"stopped (SIGTERM): {self.generating - self.cut} of {self.generating} request(s) being "
                f"generated finished, {self.cut} cut off at --drain-timeout {drain_s:g} s; {self.refused} "
                f"queued one(s) refused")
