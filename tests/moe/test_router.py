"""TopKRouter against the slow per-token reference, with gradients, and its error on bad logits."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, grads_of, init_module

from thunderep import RouterConfig, RoutingError, TopKRouter
from thunderep.moe.reference import reference_route

# (family, extra fields): every scoring scheme of the HF 5.x families.
SCHEMES = [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"normalize": True}),
    ("qwen3_moe", {}),
    ("olmoe", {}),
    ("jamba", {}),
    ("deepseek_v3", {"n_group": 4, "topk_group": 2, "scaling_factor": 2.5}),
    ("deepseek_v3", {"normalize": False}),
    ("glm4_moe", {"n_group": 2, "topk_group": 1, "scaling_factor": 1.8}),
    ("deepseek_v2", {"n_group": 4, "topk_group": 3, "scaling_factor": 16.0}),
    ("deepseek_v2", {}),
    ("gpt_oss", {}),
    ("granitemoe", {}),
]


def _sorted_by_id(weights_TK: torch.Tensor, ids_TK: torch.Tensor):
    ids_sorted, order = ids_TK.sort(dim=-1)
    return weights_TK.gather(1, order), ids_sorted


def _make(family, extra, E, k, D=24, seed=0):
    groups = extra.get("n_group", 1)
    if groups > 1 and (E // groups < 2 or k > extra["topk_group"] * (E // groups)):
        pytest.skip("grouping needs at least 2 experts per group and top_k within the chosen groups")
    config = RouterConfig.for_family(family, num_experts=E, top_k=k, hidden_size=D, **extra)
    return init_module(TopKRouter(config), seed)


@pytest.mark.parametrize("family,extra", SCHEMES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(SCHEMES)])
@pytest.mark.parametrize("E,k,T", [(8, 2, 7), (64, 8, 5), (4, 1, 1)])
def test_router_matches_reference(family, extra, E, k, T):
    router = _make(family, extra, E, k)
    x = torch.randn(T, router.config.hidden_size, generator=torch.Generator().manual_seed(1))
    routing = router(x)
    w_ref, ids_ref = reference_route(
        x, router.weight, router.config, router.bias, router.e_score_correction_bias
    )
    w, ids = _sorted_by_id(routing.weights_TK, routing.ids_TK)
    w_ref, ids_ref = _sorted_by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    assert routing.weights_TK.dtype == w_ref.dtype
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(routing.counts_E, torch.bincount(ids_ref.flatten(), minlength=E))
    assert routing.logits_TE.shape == (T, E)


@pytest.mark.parametrize("family,extra", SCHEMES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(SCHEMES)])
def test_router_gradients_match_reference(family, extra):
    router = _make(family, extra, 16, 4)
    x = torch.randn(9, router.config.hidden_size, generator=torch.Generator().manual_seed(2))
    g = torch.randn(9, 4, generator=torch.Generator().manual_seed(3))

    def fast(m, x):
        routing = m(x)
        return _sorted_by_id(routing.weights_TK, routing.ids_TK)[0]

    def slow(m, x):
        w, ids = reference_route(x, m.weight, m.config, m.bias, m.e_score_correction_bias)
        return _sorted_by_id(w, ids)[0]

    got = grads_of(router, x, fast, g)
    want = grads_of(router, x, slow, g)
    assert_grads_close(got, want, rtol=1e-5, atol=1e-6)
    assert got["weight"].abs().sum() > 0
    if router.bias is not None:
        assert got["bias"].abs().sum() > 0


def test_group_limited_routing_only_uses_best_groups():
    config = RouterConfig.for_family(
        "deepseek_v3", num_experts=16, top_k=4, hidden_size=8, n_group=4, topk_group=1
    )
    router = init_module(TopKRouter(config), 5)
    routing = router(torch.randn(32, 8))
    groups = routing.ids_TK // 4
    assert torch.equal(groups, groups[:, :1].expand_as(groups)), "all experts of a token from one group"


def test_score_correction_bias_selects_but_does_not_weight():
    config = RouterConfig.for_family("deepseek_v3", num_experts=8, top_k=2, hidden_size=8, normalize=False)
    router = init_module(TopKRouter(config), 6)
    x = torch.randn(10, 8)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 10.0  # forces expert 5 into every token's choice
    routing = router(x)
    assert (routing.ids_TK == 5).any(dim=-1).all()
    sig = torch.sigmoid(routing.logits_TE)
    torch.testing.assert_close(routing.weights_TK, sig.gather(1, routing.ids_TK))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_raise(bad):
    router = init_module(TopKRouter(RouterConfig(num_experts=4, top_k=2, hidden_size=8)), 0)
    x = torch.randn(5, 8)
    x[3, 2] = bad
    with pytest.raises(RoutingError, match=r"NaN or inf for 1 of 5 tokens \(first token index 3\)"):
        router(x)


def test_wrong_hidden_size_raises():
    router = TopKRouter(RouterConfig(num_experts=4, top_k=2, hidden_size=8))
    with pytest.raises(RoutingError, match=r"router input must be \[T, 8\], got \(5, 6\)"):
        router(torch.randn(5, 6))


def test_bf16_router_returns_requested_dtypes():
    for family, want in [("mixtral", torch.float32), ("qwen3_moe", torch.bfloat16), ("deepseek_v3", torch.float32)]:
        config = RouterConfig.for_family(family, num_experts=8, top_k=2, hidden_size=16)
        router = init_module(TopKRouter(config), 0).to(torch.bfloat16)
        routing = router(torch.randn(4, 16, dtype=torch.bfloat16))
        assert routing.weights_TK.dtype == want
        assert routing.ids_TK.dtype == torch.int64
