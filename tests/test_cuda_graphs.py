"""thunderep.cuda_graphs: a capture that fails leaves the device's default random generator usable."""

from __future__ import annotations

import pytest
import torch

from thunderep.cuda_graphs import capture


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
