"""ep mode through the kernels' fused expand and pre-sum (`LocalExperts.summed`: the received rows go to
the experts as they are; the down kernel's epilogue sums each row's pairs) on 2 and 4 real processes
(gloo, CPU; the kernels forced on in Triton's interpreter), against one single-process layer: top-1,
top-2, top-8 and group-limited routing, ranks with no tokens, every codec. With gradients the layer takes
the expanded rows instead (one case), and its gradients still match."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from thunderep import EPConfig, LayerConfig, ThunderMoELayer

pytest.importorskip("triton")

D, I = 16, 8
LAYERS = {
    "top1": dict(family="mixtral", num_experts=8, top_k=1),
    "mixtral": dict(family="mixtral", num_experts=8, top_k=2),
    "top8": dict(family="qwen3_moe", num_experts=16, top_k=8),
    "deepseek": dict(family="deepseek_v3", num_experts=8, top_k=3, n_group=4, topk_group=2, scaling_factor=2.0,
                     shared_intermediate_size=8),
}
CASES = {  # name: (layer, tokens per rank for 2 / 4 ranks, codec)
    "top1": ("top1", {2: [17, 5], 4: [1, 17, 0, 9]}, "none"),
    "mixtral_bf16": ("mixtral", {2: [9, 23], 4: [0, 11, 17, 6]}, "bf16"),
    "top8_fp8": ("top8", {2: [13, 6], 4: [3, 9, 0, 21]}, "fp8"),
    "deepseek_grouped": ("deepseek", {2: [0, 19], 4: [7, 0, 1, 19]}, "none"),
}
GRADIENTS = "mixtral_bf16"


def _on_rank(rank, world):
    from conftest import init_module

    import thunderep.moe.experts as experts_module
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.kernels import sorted_mlp

    groups = init_expert_parallel()
    experts_module._use_triton = lambda x, w, config: True  # the kernels in Triton's CPU interpreter
    calls = []
    real = sorted_mlp.forward_summed
    sorted_mlp.forward_summed = lambda *a: calls.append(1) or real(*a)
    out = {}
    for name, (kind, tokens, codec) in CASES.items():
        ep = ExpertParallel(groups, EPConfig(control="collective", compression=codec))
        full = init_module(ThunderMoELayer(LayerConfig.build(hidden_size=D, intermediate_size=I, **LAYERS[kind])), 0)
        x_all = torch.randn(sum(tokens[world]), D, generator=torch.Generator().manual_seed(7))
        start = sum(tokens[world][:rank])
        x = x_all[start:start + tokens[world][rank]]
        layer = ThunderMoELayer(full.config, ep=ep)
        layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
        before = len(calls)
        with torch.no_grad():
            y, want = layer(x, mode="ep"), full(x_all)[start:start + x.shape[0]]
        fused_calls = len(calls) - before
        out[name] = {"y": (y, want)}
        if name == GRADIENTS:  # the expanded rows, not the fused call (one case: the interpreter is slow)
            x_grad = x.clone().requires_grad_()
            layer(x_grad, mode="ep").square().sum().backward()
            x_ref = x_all.clone().requires_grad_()
            full(x_ref).square().sum().backward()
            dx = x_grad.grad if x_grad.grad is not None else torch.zeros_like(x)
            out[name]["dx"] = (dx.contiguous(), x_ref.grad[start:start + x.shape[0]].contiguous())
        out[name]["calls"] = (fused_calls, len(calls) - before - fused_calls)
        ep.close()
    return out


TOLERANCE = {"none": 1e-5, "bf16": 2e-2, "fp8": 1.5e-1}


@pytest.mark.parametrize("world", [2, 4])
def test_ep_mode_through_the_fused_kernels_equals_one_process(world):
    for rank, out in enumerate(run_ranks(_on_rank, world, timeout=300)):
        for name, got in out.items():
            assert got["calls"] == (1, 0), (rank, name, got["calls"])  # fused once without gradients, never with
            tol = TOLERANCE[CASES[name][2]]
            for what in ("y", "dx") if name == GRADIENTS else ("y",):
                have, want = got[what]
                scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
                torch.testing.assert_close(have, want, rtol=tol, atol=tol * scale,
                                           msg=lambda m: f"rank {rank}, {name}, {what}: {m}")
