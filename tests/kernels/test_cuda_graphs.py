"""thunderep.kernels.graphs: a capture that fails leaves the device's default random generator usable."""

from __future__ import annotations

import contextlib

import pytest
import torch

from thunderep.kernels.graphs import capture, graph_steps, in_graph_steps


def test_a_failed_capture_is_followed_by_an_empty_one_then_raised(monkeypatch):
    """The mechanism with torch's capture stood in for (no GPU needed): the body's failure propagates,
    after one more capture with an empty body has begun and ended; a capture that works is not
    followed by one."""
    events = []

    @contextlib.contextmanager
    def graph(g, pool=None, **options):
        events.append(("begin", g, pool, options))
        yield
        events.append(("end", g))

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "empty")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RuntimeError, match="syncs"):
        with capture("g", "pool", stream="s"):
            raise RuntimeError("the body syncs")
    assert events == [("begin", "g", "pool", {"stream": "s"}), ("begin", "empty", None, {}), ("end", "empty")]
    del events[:]
    with capture("g"):
        pass
    assert events == [("begin", "g", None, {}), ("end", "g")]


def test_graph_steps_nest_and_restore():
    assert not in_graph_steps()
    with graph_steps():
        assert in_graph_steps()
        with graph_steps(False):
            assert not in_graph_steps()
        assert in_graph_steps()
    assert not in_graph_steps()


def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_gpu_a_failed_capture_raises_and_random_draws_still_work():
    _needs_gpu()
    x = torch.ones(4, device="cuda")
    with pytest.raises(Exception):  # noqa: B017 - torch's error for a sync inside a capture
        with capture(torch.cuda.CUDAGraph()):
            x.sum().item()
    torch.cuda.synchronize()
    assert torch.rand(3, device="cuda").shape == (3,)
    # A capture that draws, after the failure, replays to fresh values (the generator's capture state
    # is the one a fresh process has).
    out = torch.empty(1000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        out.copy_(torch.rand(1000, device="cuda"))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)


@pytest.mark.gpu
def test_gpu_a_capture_that_works_replays_its_work():
    _needs_gpu()
    x = torch.arange(6.0, device="cuda")
    y = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        y.copy_(x * 2)
    x += 1
    graph.replay()
    assert torch.equal(y, (torch.arange(6.0, device="cuda") + 1) * 2)
