"""Shared test helpers: deterministic initialisation and gradient comparison."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

# Without CUDA, the Triton kernel tests (tests/kernels) run in Triton's CPU interpreter; Triton reads
# this when the kernels are decorated, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from interpreter_calls import install  # noqa: E402

install()  # in the interpreter: helper calls in kernels skip repatching what their launch patched


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that changes torch's thread count changes it for itself only: float sums in another order
    (more or fewer threads) would make a later test's reference depend on which tests ran before it."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@contextlib.contextmanager
def one_thread():
    """torch on one thread within the block, as each rank of `run_ranks` runs: a single-process reference
    then sums in the ranks' order whatever the machine's core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def init_module(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Parameters ~ N(0, 1/sqrt(fan_in)) so that outputs are O(1) and comparisons are meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.1)
    return module


def grads_of(module: torch.nn.Module, x: torch.Tensor, forward, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run `forward(module, x)`, backprop `grad_out`, return {'x': dx, param_name: dparam}."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = forward(module, x)
    y.backward(grad_out)
    out = {"x": x.grad.detach().clone()}
    for name, p in module.named_parameters():
        out[name] = None if p.grad is None else p.grad.detach().clone()
    module.zero_grad(set_to_none=True)
    return out


def assert_grads_close(got: dict, want: dict, rtol: float, atol: float) -> None:
    """Element-wise |got - want| <= atol * max(1, max|want|) + rtol * |want| for every gradient.

    The absolute part scales with the tensor's magnitude: float32 sums with cancellation lose
    absolute (not relative) precision in proportion to the size of the terms.
    """
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        if w is None:
            assert g is None or not g.any(), f"gradient of {name}: expected none"
            continue
        assert g is not None, f"gradient of {name} missing"
        scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
        torch.testing.assert_close(
            g.float(), w.float(), rtol=rtol, atol=atol * scale, msg=lambda m: f"grad {name}: {m}"
        )
