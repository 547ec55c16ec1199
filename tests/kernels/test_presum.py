"""The combine's pre-sum kernel (thunderep/kernels/presum.py) against the torch formula the dispatcher
uses without it: forward and both gradients; compiled on a CUDA GPU where one is present, else in
Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_moe_triton import DEVICE  # noqa: E402

from thunderep.kernels.presum import csr, presum  # noqa: E402


def _case(M, K, D, local, dtype, seed):
    """Q pairs over M rows: each row holds 1..local of its K positions (distinct), pairs in a random order
    (the local-slot order the experts ran them in)."""
    gen = torch.Generator().manual_seed(seed)
    positions = []
    for m in range(M):
        ks = torch.randperm(K, generator=gen)[:int(torch.randint(1, local + 1, (1,), generator=gen))]
        positions += [m * K + int(k) for k in ks]
    pairs = torch.tensor(positions)[torch.randperm(len(positions), generator=gen)]
    y = torch.randn(len(positions), D, generator=gen).to(dtype)
    w = torch.rand(len(positions), generator=gen)
    return y.to(DEVICE), w.to(DEVICE), pairs.to(DEVICE)


def _torch_presum(y, w, pairs, M, K):
    weighted = y.float() * w.float().unsqueeze(-1)
    full = weighted.new_zeros(M * K, y.shape[-1]).index_copy(0, pairs, weighted)
    return full.view(M, K, -1).sum(dim=1).to(y.dtype)


@pytest.mark.parametrize("M,K,D,local,dtype", [(7, 8, 40, 3, torch.float32), (5, 2, 300, 2, torch.bfloat16),
                                               (9, 8, 256, 8, torch.float16), (1, 1, 3, 1, torch.float32)])
def test_presum_equals_the_torch_formula_forward_and_backward(M, K, D, local, dtype):
    y, w, pairs = _case(M, K, D, local, dtype, seed=M + D)
    y1, w1 = y.clone().requires_grad_(), w.clone().requires_grad_()
    y2, w2 = y.clone().requires_grad_(), w.clone().requires_grad_()
    got, want = presum(y1, w1, pairs, M, K), _torch_presum(y2, w2, pairs, M, K)
    assert got.dtype == dtype and got.shape == (M, D)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    grad = torch.randn(M, D).to(DEVICE, dtype)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(y1.grad, y2.grad, **tol)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-3)


def test_csr_orders_each_rows_pairs_by_k_and_rows_without_pairs_are_zero():
    pairs = torch.tensor([9, 1, 8, 3, 0], device=DEVICE)  # rows 0 (k 0, 1, 3), 2 (k 0, 1); row 1 empty; K = 4
    order, starts = csr(pairs, 3, 4)
    assert pairs[order].tolist() == [0, 1, 3, 8, 9] and starts.tolist() == [0, 3, 3, 5]
    y = torch.ones(5, 4, device=DEVICE)
    out = presum(y, torch.full((5,), 0.5, device=DEVICE), pairs, 3, 4)
    assert out[:, 0].tolist() == [1.5, 0.0, 1.0]
