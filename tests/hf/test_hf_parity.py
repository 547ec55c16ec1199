"""Router and experts against the installed Hugging Face transformers modules themselves.

Skipped when transformers (the `hf` extra) is not installed.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import init_module

from thunderep import ExpertsConfig, FusedExperts, Routing, RouterConfig, TopKRouter

pytest.importorskip("transformers")

E, K, D, I = 16, 4, 32, 16

# family -> (module path, config class, router class, config kwargs, our overrides)
FAMILIES = {
    "mixtral": ("mixtral", "MixtralConfig", "MixtralTopKRouter", dict(num_local_experts=E), {}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeTopKRouter", dict(num_experts=E, norm_topk_prob=False), {}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter", dict(num_experts=E, norm_topk_prob=True), {}),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeTopKRouter", dict(num_experts=E, norm_topk_prob=False), {}),
    "jamba": ("jamba", "JambaConfig", "JambaTopKRouter", dict(num_experts=E), {}),
    "deepseek_v3": (
        "deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter",
        dict(n_routed_experts=E, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
        dict(n_group=4, topk_group=2, scaling_factor=2.5),
    ),
    "glm4_moe": (
        "glm4_moe", "Glm4MoeConfig", "Glm4MoeTopkRouter",
        dict(n_routed_experts=E, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True),
        dict(n_group=2, topk_group=1, scaling_factor=1.5),
    ),
    "deepseek_v2": (
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter",
        dict(n_routed_experts=E, n_group=4, topk_group=2, routed_scaling_factor=16.0,
             topk_method="group_limited_greedy"),
        dict(n_group=4, topk_group=2, scaling_factor=16.0),
    ),
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssTopKRouter", dict(num_local_experts=E), {}),
    "granitemoe": ("granitemoe", "GraniteMoeConfig", "GraniteMoeTopKRouter", dict(num_local_experts=E), {}),
}


def _unpack(outputs, T):
    """(weights_TK, ids_TK) from a router's outputs, whatever their order in this transformers."""
    pairs = [o for o in outputs if isinstance(o, torch.Tensor) and o.shape == (T, K)]
    ids = next(o for o in pairs if not o.is_floating_point())
    weights = next(o for o in pairs if o.is_floating_point())
    return weights, ids


def _hf_router(family):
    path, config_cls, router_cls, kwargs, overrides = FAMILIES[family]
    module = importlib.import_module(f"transformers.models.{path}.modeling_{path}")
    if not hasattr(module, router_cls):
        pytest.skip(f"this transformers has no {router_cls} (its router lives inside the MoE block)")
    config_mod = importlib.import_module(f"transformers.models.{path}.configuration_{path}")
    hf_config = getattr(config_mod, config_cls)(
        hidden_size=D, num_experts_per_tok=K, intermediate_size=I, **kwargs
    )
    hf = getattr(module, router_cls)(hf_config)
    return hf, overrides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_equals_hf(family, dtype):
    hf, overrides = _hf_router(family)
    init_module(hf, 11)
    ours = TopKRouter(RouterConfig.for_family(family, num_experts=E, top_k=K, hidden_size=D, **overrides))
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    if family not in ("deepseek_v3", "glm4_moe", "deepseek_v2"):  # those keep an fp32 router weight
        hf.to(dtype)
        ours.to(dtype)
    x = torch.randn(13, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    hf_w, hf_ids = _unpack(hf(x), x.shape[0])
    routing = ours(x)
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, our_order = routing.ids_TK.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    assert routing.weights_TK.dtype == hf_w.dtype
    # Same operations; only the order of the k-term sums may differ (HF's unsorted top-k).
    torch.testing.assert_close(routing.weights_TK.gather(1, our_order), hf_w.gather(1, order), rtol=2e-7, atol=0)


def _routing(T, gen):
    logits = torch.randn(T, E, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    ids[0] = torch.arange(K)  # make sure at least the low ids appear; the top ones may get none
    return Routing(w, ids, torch.bincount(ids.flatten(), minlength=E), logits)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_experts_equal_hf_mixtral(backend):
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    hf = init_module(MixtralExperts(MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E)), 3)
    ours = FusedExperts(ExpertsConfig(E, D, I, backend=backend))
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(21, D, generator=gen)
    routing = _routing(21, gen)
    want = hf(x, routing.ids_TK, routing.weights_TK)
    torch.testing.assert_close(ours(x, routing), want, rtol=1e-5, atol=1e-6)


def test_experts_equal_hf_gpt_oss():
    """GPT-OSS stores [E, D, 2I] / [E, I, D] (transposed, gate/up interleaved, with biases)."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf_config = GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E)
    hf = init_module(GptOssExperts(hf_config), 7)
    with torch.no_grad():
        hf.gate_up_proj.mul_(4.0)  # push some activations past the clamp limit
    ours = FusedExperts(
        ExpertsConfig(E, D, I, activation="gpt_oss_swiglu", interleaved=True, bias=True,
                      swiglu_alpha=hf.alpha, swiglu_limit=hf.limit)
    )
    with torch.no_grad():
        ours.gate_up_proj.copy_(hf.gate_up_proj.transpose(1, 2))
        ours.down_proj.copy_(hf.down_proj.transpose(1, 2))
        ours.gate_up_bias.copy_(hf.gate_up_proj_bias)
        ours.down_bias.copy_(hf.down_proj_bias)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(17, D, generator=gen) * 3
    routing = _routing(17, gen)
    want = hf(x, routing.ids_TK, routing.weights_TK)
    torch.testing.assert_close(ours(x, routing), want, rtol=1e-5, atol=1e-5)
