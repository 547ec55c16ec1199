"""ops.moe_mlp_summed (expert parallelism's receiving rank: some pairs of each received row, weighted and
summed in the down kernel's epilogue) against a float64 reference, on both GEMM paths; and its errors.

Without CUDA the kernels run in Triton's interpreter on small shapes; the `gpu` test runs the compiled
kernels on Qwen3's and Mixtral's expert shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from thunderep.errors import InputError  # noqa: E402
from thunderep.kernels import ops, sorted_mlp  # noqa: E402
from thunderep.kernels.slot_order import slot_order  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _case(M, D, I, E, K, seed, dtype=torch.float32, absent=0.4):
    """Received rows x [M, D], weights, and each pair's local expert (-1: another rank's, with
    probability `absent`); the pairs this rank computes grouped by expert (order_Q, counts_E)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=gen)
    w_gu = torch.randn(E, 2 * I, D, generator=gen) / D**0.5
    w_d = torch.randn(E, D, I, generator=gen) / I**0.5
    slot_MK = torch.randint(0, E, (M, K), generator=gen)
    slot_MK[torch.rand(M, K, generator=gen) < absent] = -1
    weights_MK = torch.rand(M, K, generator=gen)
    flat = slot_MK.reshape(-1)
    here = (flat >= 0).nonzero().squeeze(1)
    order_Q = here[torch.argsort(flat[here], stable=True)]
    counts_E = torch.bincount(flat[here], minlength=E)
    to = dict(device=DEVICE, dtype=dtype)
    return (x.to(**to), w_gu.to(**to), w_d.to(**to), slot_MK, weights_MK.to(**to), order_Q.to(DEVICE),
            counts_E.to(DEVICE))


def _reference(x, w_gu, w_d, slot_MK, weights_MK):
    """float64: y[m] = sum over the pairs (m, k) with a local expert of w_mk * expert(x_m)."""
    x, w_gu, w_d, weights_MK = (t.double().cpu() for t in (x, w_gu, w_d, weights_MK))
    y = torch.zeros(x.shape[0], w_d.shape[1], dtype=torch.float64)
    for (m, k), e in zip(torch.cartesian_prod(torch.arange(x.shape[0]), torch.arange(slot_MK.shape[1])).tolist(),
                         slot_MK.reshape(-1).tolist()):
        if e >= 0:
            gate, up = (x[m] @ w_gu[e].T).chunk(2)
            y[m] += weights_MK[m, k] * ((F.silu(gate) * up) @ w_d[e].T)
    return y


@pytest.mark.parametrize("gemm", ["triton", "torch"])
@pytest.mark.parametrize("M,K,E,absent", [(9, 1, 4, 0.3), (7, 2, 4, 0.5), (5, 8, 8, 0.6), (6, 3, 4, 0.0),
                                          (4, 2, 4, 1.0)])
def test_summed_equals_the_float64_reference(gemm, M, K, E, absent):
    """Every listed pair weighted and added into its row; rows with no pair here come out 0 (absent 1.0:
    no pair at all; 0.0: every pair)."""
    if gemm == "torch" and CUDA and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the torch GEMM path is the Hopper one")
    x, w_gu, w_d, slot_MK, weights_MK, order_Q, counts_E = _case(M, 32, 16, E, K, seed=M * 10 + K)
    with torch.no_grad():
        if gemm == "triton":
            y = ops.moe_mlp_summed(x, w_gu, w_d, counts_E, order_Q=order_Q, weights_N=weights_MK, top_k=K)
        else:
            y = sorted_mlp.forward_summed(x, w_gu, w_d, order_Q.int(), counts_E.int(), weights_MK.reshape(-1), K,
                                          "silu", False, "torch")
    want = _reference(x, w_gu, w_d, slot_MK, weights_MK)
    assert y.shape == want.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double().cpu(), want, rtol=1e-5, atol=1e-5)
    assert not y[(slot_MK < 0).all(dim=1)].any()
    # the receiver's order and positions from one launch (kernels/slot_order.py), as the dispatcher hands them
    keys = torch.where(slot_MK < 0, E, slot_MK).reshape(-1).to(torch.int16).to(DEVICE)
    pairs_Q, positions_N = slot_order(keys, counts_E.cpu())
    assert pairs_Q.dtype == torch.int32 and torch.equal(pairs_Q.long(), order_Q.long())
    with torch.no_grad():
        if gemm == "triton":
            y2 = ops.moe_mlp_summed(x, w_gu, w_d, counts_E, order_Q=pairs_Q, weights_N=weights_MK, top_k=K,
                                    positions_N=positions_N)
        else:
            y2 = sorted_mlp.forward_summed(x, w_gu, w_d, pairs_Q.int(), counts_E.int(), weights_MK.reshape(-1), K,
                                           "silu", False, "torch", positions_N)
    assert torch.equal(y2, y)
    if gemm == "triton" and order_Q.numel():  # the positions given are the ones used: none listed, all zero
        with torch.no_grad():
            y0 = ops.moe_mlp_summed(x, w_gu, w_d, counts_E, order_Q=pairs_Q, weights_N=weights_MK, top_k=K,
                                    positions_N=torch.full_like(positions_N, -1))
        assert not y0.any()


def test_summed_declines_where_gradients_are_needed():
    """Inference only: with gradients asked for it returns None (the caller expands the rows instead)."""
    x, w_gu, w_d, _, weights_MK, order_Q, counts_E = _case(5, 32, 16, 4, 2, seed=1)
    assert ops.moe_mlp_summed(x.requires_grad_(), w_gu, w_d, counts_E, order_Q=order_Q, weights_N=weights_MK,
                              top_k=2) is None


def test_summed_rejects_pairs_or_weights_that_do_not_fit_the_rows():
    x, w_gu, w_d, _, weights_MK, order_Q, counts_E = _case(5, 32, 16, 4, 2, seed=2, absent=0.0)
    with torch.no_grad():
        with pytest.raises(InputError, match="at most"):
            ops.moe_mlp_summed(x[:4], w_gu, w_d, counts_E, order_Q=order_Q, weights_N=weights_MK[:4], top_k=2)
        with pytest.raises(InputError, match="flat pairs"):
            ops.moe_mlp_summed(x, w_gu, w_d, counts_E, order_Q=order_Q, weights_N=weights_MK[:, :1], top_k=2)
        if not CUDA:  # checked where the counts are host data
            with pytest.raises(InputError, match="sum to"):
                ops.moe_mlp_summed(x, w_gu, w_d, counts_E + 1, order_Q=order_Q, weights_N=weights_MK, top_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 768, 64, 8), (4096, 14336, 4, 2)])
def test_gpu_summed_on_model_shapes_matches_the_expanded_path(shape):
    """bfloat16 at Qwen3's and Mixtral's expert shapes (half the experts on this rank): the fused call
    against the expanded rows through moe_mlp and a float32 sum, within bfloat16 rounding."""
    D, I, E, K = shape
    M = 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    w_gu = (torch.randn(E, 2 * I, D, device="cuda", generator=gen) / D**0.5).bfloat16()
    w_d = (torch.randn(E, D, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    slot_MK = torch.randint(-E, E, (M, K), device="cuda", generator=gen).clamp(min=-1)
    weights_MK = torch.rand(M, K, device="cuda", generator=gen)
    flat = slot_MK.reshape(-1)
    here = (flat >= 0).nonzero().squeeze(1)
    order_Q = here[torch.argsort(flat[here], stable=True)]
    counts_E = torch.bincount(flat[here], minlength=E).cpu()
    with torch.no_grad():
        y = ops.moe_mlp_summed(x, w_gu, w_d, counts_E, order_Q=order_Q, weights_N=weights_MK, top_k=K)
        y_QD = ops.moe_mlp(x[order_Q // K], w_gu, w_d, counts_E)
        want = torch.zeros(M, D, device="cuda").index_add_(0, order_Q // K, y_QD.float() * weights_MK.reshape(-1)[
            order_Q].unsqueeze(1))
    err = ((y.float() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, err
