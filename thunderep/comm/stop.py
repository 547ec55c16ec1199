"""Stopping a command cleanly on SIGTERM: the signal raises `Stopped` where the main thread is (as Ctrl-C
raises KeyboardInterrupt), so that cleanup runs and the command says why it ended."""

from __future__ import annotations

import contextlib
import signal
import threading

from ..errors import Stopped

__all__ = ["raise_stopped", "stop_on_sigterm"]


def raise_stopped(signum, frame) -> None:
    """A signal handler: raise `Stopped` naming the signal."""
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_sigterm(handler=raise_stopped):
    """While inside: SIGTERM calls `handler` (by default `raise_stopped`); before, the process died at
    once and silently. Only the main thread can take signals: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
