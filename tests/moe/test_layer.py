"""ThunderMoELayer against the slow reference: output and the gradients of input and every parameter."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, grads_of, init_module

from thunderep import LayerConfig, ThunderMoELayer
from thunderep.moe.reference import reference_layer

LAYERS = {
    "mixtral": dict(family="mixtral", num_experts=8, top_k=2),
    "qwen2_moe_shared_gated": dict(family="qwen2_moe", num_experts=8, top_k=4, shared_intermediate_size=12,
                                   shared_gated=True),
    "qwen3_moe_64x8": dict(family="qwen3_moe", num_experts=64, top_k=8),
    "deepseek_v3_grouped_shared": dict(family="deepseek_v3", num_experts=16, top_k=4, n_group=4, topk_group=2,
                                       scaling_factor=2.5, shared_intermediate_size=16),
    "deepseek_v2_grouped": dict(family="deepseek_v2", num_experts=16, top_k=3, n_group=4, topk_group=2,
                                scaling_factor=4.0, shared_intermediate_size=8),
    "gpt_oss": dict(family="gpt_oss", num_experts=8, top_k=2),
    "granitemoe_k1": dict(family="granitemoe", num_experts=4, top_k=1),
}


def make_layer(name: str, backend: str, D: int = 16, I: int = 8, seed: int = 0) -> ThunderMoELayer:
    config = LayerConfig.build(hidden_size=D, intermediate_size=I, **LAYERS[name]).with_backend(backend)
    return init_module(ThunderMoELayer(config), seed)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("shape", [(1, 1), (3, 7)])  # T = 1 and odd T = 21
def test_layer_fp32_matches_reference(name, backend, shape):
    layer = make_layer(name, backend)
    x = torch.randn(*shape, 16, generator=torch.Generator().manual_seed(1))
    g = torch.randn(*shape, 16, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, reference_layer(layer, x), rtol=1e-5, atol=1e-6)
    got = grads_of(layer, x, lambda m, x: m(x), g)
    want = grads_of(layer, x, reference_layer, g)
    assert_grads_close(got, want, rtol=1e-5, atol=1e-6)
    rc = layer.router.config
    if not (rc.scoring == "topk_softmax" and rc.top_k == 1):  # a softmax over one logit is constant
        assert got["router.weight"].abs().sum() > 0, "the router must receive a gradient"
    if layer.router.bias is not None:
        assert got["router.bias"].abs().sum() > 0


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3_grouped_shared", "qwen2_moe_shared_gated"])
def test_layer_bf16_within_documented_tolerance(name, backend):
    """bf16 layer vs the fp32 reference on the bf16-rounded weights, fed the routing the bf16 router
    chose (a near-tie may legitimately pick another expert in bf16). Tolerance as in test_experts."""
    layer = make_layer(name, backend, D=32, I=16)
    ref = make_layer(name, backend, D=32, I=16)
    layer.to(torch.bfloat16)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    x = torch.randn(19, 32).to(torch.bfloat16)
    y, routing = layer(x, return_routing=True)
    from thunderep.moe.reference import reference_experts

    e = ref.experts
    want = reference_experts(x.float(), routing.ids_TK, routing.weights_TK.float(), e.gate_up_proj,
                             e.down_proj, e.config)
    if ref.shared_experts is not None:
        want = want + ref.shared_experts(x.float())
    scale = want.abs().max().item()
    torch.testing.assert_close(y.float(), want, rtol=0, atol=2e-2 * scale + 2e-2)


def test_zero_tokens():
    layer = make_layer("deepseek_v3_grouped_shared", "auto")
    x = torch.zeros(0, 16, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert layer.experts.down_proj.grad is not None


def test_return_routing_counts():
    layer = make_layer("mixtral", "auto")
    y, routing = layer(torch.randn(2, 5, 16), return_routing=True)
    assert routing.ids_TK.shape == (10, 2)
    assert int(routing.counts_E.sum()) == 20


def test_wrong_routing_changes_output():
    """Sanity: the comparison above would notice a routing mistake (swapping two experts' weights)."""
    layer = make_layer("mixtral", "loop")
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))  # fixed: not the global RNG state
    y = layer(x)
    with torch.no_grad():
        layer.experts.down_proj[[0, 1]] = layer.experts.down_proj[[1, 0]].clone()
    assert not torch.allclose(layer(x), y, rtol=1e-3, atol=1e-4)
