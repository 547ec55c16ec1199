"""Capturing CUDA graphs without leaving the device's random generator broken when a capture fails.

`torch.cuda.graph` puts the device's default random generator into capture mode when a capture
begins and takes it out only when the capture ends well. A capture that fails (an op that syncs with
the host, or one that cannot be captured) leaves it in capture mode, and every later draw from it on
that device fails with "Offset increment outside graph capture encountered unexpectedly": `torch.rand`
on the device, dropout, and sampling with no generator of its own. Seen with torch 2.11,
after a failed capture that was caught and worked around (docs/BENCHMARKS.md, "A failed capture and
the device's random generator").

`capture(graph, pool, ...)` is `torch.cuda.graph(graph, pool=pool, ...)` that, when the capture fails, captures
one empty graph (which takes the generator out of capture mode again) before the failure propagates.
Every CUDA-graph capture in ThunderEP goes through it.

`graph_steps(True)` marks the calls within it as the ones CUDA graphs capture and replay (a decode
step's, `thunderep.serve.static_decode`; `ThunderMoE.running(capturable=True)` sets it), whether this call
is the eager warm-up or the capture; `in_graph_steps()` reads it. Where a choice between two paths is
made by timing them (`thunderep.kernels.pairs.pairs_win`), such calls time graph replays: eager
timings of a path of many small kernels count the host's launch time, which the graph does not pay.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import torch

__all__ = ["capture", "graph_steps", "in_graph_steps"]

_GRAPH_STEPS = contextvars.ContextVar("thunderep_graph_steps", default=False)


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool=None, **options):
    """Capture the body into `graph` (memory from `pool`, a `torch.cuda.graph_pool_handle()`, if given;
    `options`: torch.cuda.graph's others, e.g. `stream`). A failed capture raises as `torch.cuda.graph`
    does, with the default generator usable again."""
    try:
        with torch.cuda.graph(graph, pool=pool, **options):
            yield graph
    except BaseException:
        _release_generator()
        raise


def _release_generator() -> None:
    """Take the current device's default generator out of the capture mode a failed capture left it
    in: an empty capture begins (which sets the mode) and ends well (which clears it)."""
    if torch.cuda.is_current_stream_capturing():  # still inside an outer capture: that one owns the mode
        return
    try:
        with warnings.catch_warnings():  # torch warns that the graph is empty, which is the point
            warnings.simplefilter("ignore", UserWarning)
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
    except Exception:  # noqa: BLE001 - the capture's own failure is the one to report
        pass


@contextlib.contextmanager
def graph_steps(on: bool = True):
    """Within the block, `in_graph_steps()` is `on` (the previous value after it)."""
    token = _GRAPH_STEPS.set(bool(on))
    try:
        yield
    finally:
        _GRAPH_STEPS.reset(token)


def in_graph_steps() -> bool:
    """Whether the current calls run in captured CUDA graphs (`graph_steps`)."""
    return _GRAPH_STEPS.get()
