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

`before_replay(fn)`, called while a graph is being captured (`capture`), has `replay(graph)` run fn() before
each replay of that graph: host work the captured kernels wait for at every replay, which the capture itself
cannot start (the host jobs of offloaded experts, `thunderep.moe.tier_graphs`). A graph replayed through
`graph.replay()` alone runs no such work: every replay of a graph captured here goes through `replay`.

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

from ..errors import ThunderError

__all__ = ["before_replay", "capture", "capturing", "collect_before_replay", "graph_steps", "in_graph_steps",
           "replay"]

_GRAPH_STEPS = contextvars.ContextVar("thunderep_graph_steps", default=False)
_BEFORE = contextvars.ContextVar("thunderep_before_replay", default=None)  # the capture's list, while one runs


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool=None, **options):
    """Capture the body into `graph` (memory from `pool`, a `torch.cuda.graph_pool_handle()`, if given;
    `options`: torch.cuda.graph's others, e.g. `stream`). A failed capture raises as `torch.cuda.graph`
    does, with the default generator usable again."""
    try:
        with collect_before_replay() as hooks, torch.cuda.graph(graph, pool=pool, **options):
            yield graph
    except BaseException:
        _release_generator()
        raise
    if hooks:
        graph.thunderep_before_replay = hooks


def capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a CUDA graph (never on another device type)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def collect_before_replay():
    """Within the block, `before_replay(fn)` appends fn to the list this yields (`capture` keeps it on the
    graph for `replay`)."""
    hooks: list = []
    token = _BEFORE.set(hooks)
    try:
        yield hooks
    finally:
        _BEFORE.reset(token)


def before_replay(fn, last: bool = False) -> None:
    """Have fn() run before every replay of the graph being captured (module docstring); a ThunderError outside
    a capture made by `capture`, where nothing would run it. last: after every fn registered without it (work
    that starts what the replay waits for goes last, so that a failure of the others starts nothing)."""
    hooks = _BEFORE.get()
    if hooks is None:
        raise ThunderError("work to run before each replay of a CUDA graph was registered outside a capture made by "
                           "thunderep.kernels.graphs.capture")
    hooks.append((bool(last), fn))


def replay(graph) -> None:
    """Replay `graph`, first running what its capture registered (`before_replay`): in registration order, those
    registered `last` after the others."""
    hooks = getattr(graph, "thunderep_before_replay", ())
    for fn in [fn for last, fn in hooks if not last] + [fn for last, fn in hooks if last]:
        fn()
    graph.replay()


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
