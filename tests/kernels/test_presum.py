"""The combine's pre-sum kernel (thunderep/kernels/presum.py) against the torch formula the dispatcher
uses without it: forward and both gradients; compiled on a CUDA GPU where one is present, else in
Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_moe_triton import DEVICE  # noqa: E402

from thunderep.kernels.presum import positions, presum, presum_at  # noqa: E402


def _case(M, K, D, local, dtype, seed):
    """Q pairs over M rows: each row holds 0..local of its K positions (distinct), pairs in a random order
    (the local-slot order the experts ran them in); weights of all M K pairs."""
    gen = torch.Generator().manual_seed(seed)
    flat = []
    for m in range(M):
        ks = torch.randperm(K, generator=gen)[:int(torch.randint(0, local + 1, (1,), generator=gen))]
        flat += [m * K + int(k) for k in ks]
    pairs = torch.tensor(flat, dtype=torch.int64)[torch.randperm(len(flat), generator=gen)]
    y = torch.randn(len(flat), D, generator=gen).to(dtype)
    w = torch.rand(M * K, generator=gen)
    return y.to(DEVICE), w.to(DEVICE), pairs.to(DEVICE)


def _torch_presum(y, w, pairs, M, K):
    weighted = y.float() * w[pairs].float().unsqueeze(-1)
    full = weighted.new_zeros(M * K, y.shape[-1]).index_copy(0, pairs, weighted)
    return full.view(M, K, -1).sum(dim=1).to(y.dtype)


@pytest.mark.parametrize("M,K,D,local,dtype", [(7, 8, 40, 3, torch.float32), (5, 2, 300, 2, torch.bfloat16),
                                               (9, 8, 256, 8, torch.float16), (1, 1, 3, 1, torch.float32),
                                               (6, 4, 17, 0, torch.float32)])
def test_presum_equals_the_torch_formula_forward_and_backward(M, K, D, local, dtype):
    """Rows with no pair here come out zero; the weights of pairs computed elsewhere get no gradient."""
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
    if pairs.numel():
        torch.testing.assert_close(y1.grad, y2.grad, **tol)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-3)


def test_positions_map_each_listed_pair_to_its_output_row_and_the_rest_to_minus_one():
    pairs = torch.tensor([9, 1, 8, 3, 0], device=DEVICE)  # rows 0 (k 0, 1, 3), 2 (k 0, 1); row 1 empty; K = 4
    pos = positions(pairs, 12)
    assert pos.dtype == torch.int32 and pos.tolist() == [4, 1, -1, 3, -1, -1, -1, -1, 2, 0, -1, -1]
    y = torch.arange(5, dtype=torch.float32, device=DEVICE).unsqueeze(1).repeat(1, 3)  # row q holds q
    out = presum_at(y, torch.full((12,), 0.5, device=DEVICE), pos, 3, 4)
    assert out[:, 0].tolist() == [0.5 * (4 + 1 + 3), 0.0, 0.5 * (2 + 0)]


@pytest.mark.parametrize("M,K,D", [(7, 8, 40), (5, 2, 300)])
def test_presum_at_reads_the_weights_in_place_from_the_side_rows(M, K, D):
    """The dispatcher's side rows [M, 2K] (the weights, then the slots) hand their weight columns over as a
    strided [M, K] view: the same sums, bit for bit, as the flat copy; int32 pairs as the slot order gives."""
    y, w, pairs = _case(M, K, D, 3, torch.float32, seed=M * K)
    side = torch.cat([w.view(M, K), torch.full((M, K), 7.0, device=DEVICE)], dim=1)
    strided = side[:, :K]
    assert not strided.is_contiguous()
    pos = positions(pairs.to(torch.int32), M * K)
    assert torch.equal(presum_at(y, strided, pos, M, K), presum_at(y, w, pos, M, K))
    torch.testing.assert_close(presum_at(y, strided, pos, M, K), _torch_presum(y, w, pairs, M, K))
