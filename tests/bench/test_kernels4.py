"""transformers' own MXFP4 experts as a benchmark row (bench/kernels4.py), without a GPU: the routing made
from a set's ids and weights routes as the set does, a machine without the kernels gets an error naming
what is missing, and the CLI takes the row's name (and refuses unknown ones before importing torch)."""

from __future__ import annotations

import sys

import pytest
import torch

from thunderep.bench import kernels4
from thunderep.cli import main as cli
from thunderep.errors import ThunderError


@pytest.mark.parametrize("T,E,K", [(1, 128, 4), (7, 32, 4), (16, 8, 2)])
def test_routing_logits_route_as_the_set_does(T, E, K):
    """gpt-oss's routing (top-K of the logits, softmax over those K) of `routing_logits` gives back the
    set's experts and its weights (normalized), whatever the weights' spread."""
    gen = torch.Generator().manual_seed(T)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    weights = torch.softmax(3 * torch.randn(T, K, generator=gen), -1)
    logits = kernels4.routing_logits(ids, weights, E, torch.float32)
    top = logits.topk(K, dim=-1)
    routed = torch.zeros(T, E).scatter(1, top.indices, torch.softmax(top.values, -1))
    wanted = torch.zeros(T, E).scatter(1, ids, weights / weights.sum(-1, keepdim=True))
    assert torch.equal(routed > 0, wanted > 0)
    assert torch.allclose(routed, wanted, atol=1e-5)

def test_routing_logits_in_bfloat16_keep_the_chosen_experts_on_top():
    """In the hidden states' dtype (bfloat16, as transformers passes the router's logits) the experts not
    chosen stay below every chosen one, even for a weight of one in a million."""
    ids = torch.tensor([[3, 5], [0, 7]])
    weights = torch.tensor([[1.0, 1e-6], [0.5, 0.5]])
    logits = kernels4.routing_logits(ids, weights, 8)
    assert logits.dtype == torch.bfloat16
    for t in range(2):
        others = [e for e in range(8) if e not in ids[t].tolist()]
        assert logits[t, ids[t]].min() > logits[t, others].max()


def test_without_the_kernels_the_row_stops_naming_both_sources(monkeypatch):
    """No gpt_oss_triton_kernels package and transformers' get_kernel failing (no `kernels`, no Hub): a
    ThunderError naming the package, the Hub kernel and the reason, not a silent dequantization."""
    pytest.importorskip("transformers")
    import transformers.integrations.hub_kernels as hub_kernels

    monkeypatch.setitem(sys.modules, "gpt_oss_triton_kernels", None)  # import raises ImportError

    def no_hub(name, *args, **kwargs):
        raise ImportError("kernels is not installed")

    monkeypatch.setattr(hub_kernels, "get_kernel", no_hub)
    with pytest.raises(ThunderError, match=r"no gpt_oss_triton_kernels package .*kernels-community/gpt-oss-triton-"
                                           r"kernels \(ImportError: kernels is not installed\)"):
        kernels4.kernel_module()


def test_the_cli_refuses_unknown_implementations_and_takes_the_transformers_row(capsys):
    """An unknown name is refused by the CLI's own check (exit 2, the names it takes listed); the
    transformers row's name passes that check (and then needs a GPU here: exit 1 on a CPU machine)."""
    with pytest.raises(SystemExit) as exited:
        cli(["bench", "kernels", "--impls", "thunderep,bogus", "--tokens", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown implementation(s) ['bogus']" in err and kernels4.NAME in err
    if not torch.cuda.is_available():
        assert cli(["bench", "kernels", "--impls", f"thunderep:mxfp4,{kernels4.NAME}", "--shapes", "gptoss",
                    "--tokens", "1"]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_row_hands_transformers_the_mxfp4_bytes_and_routes_each_set_once(monkeypatch):
    """Without a GPU, transformers' layout step and kernels stood in for: the experts get the MXFP4 bytes of
    each matrix as a checkpoint's blocks [E, R, C / 32, 16] and its exponents, zero biases, and each
    routing set's routing data, made once per set (from logits that route as the set does) and used on
    every later call of that set."""
    pytest.importorskip("transformers")
    import types

    import transformers.integrations.mxfp4 as mx

    from thunderep.kernels.int4 import Int4Weight

    D, I, E, K = 64, 32, 4, 2
    gen = torch.Generator().manual_seed(0)
    w_gu = Int4Weight.quantize(torch.randn(E, 2 * I, D, generator=gen).to(torch.bfloat16), "mxfp4")
    w_d = Int4Weight.quantize(torch.randn(E, D, I, generator=gen).to(torch.bfloat16), "mxfp4")
    handed, routed, calls = {}, [], []

    def swizzle(blocks, scales, module, proj, device, tk):
        handed[proj] = (blocks.clone(), scales.clone())
        del module._parameters[proj]  # as transformers' own: the packed tensor replaces the placeholder
        setattr(module, proj, "swizzled")

    def routing(logits, k):
        routed.append((logits.clone(), k))
        return ("data", len(routed)), "gather", "scatter"

    tk = types.SimpleNamespace(routing=types.SimpleNamespace(routing=routing))
    monkeypatch.setattr(kernels4, "kernel_module", lambda: tk)
    monkeypatch.setattr(mx, "swizzle_mxfp4_convertops", swizzle)
    experts = mx.Mxfp4GptOssExperts
    method = "forward_routed" if hasattr(experts, "forward_routed") else "forward"

    def run(self, x, routing_data, gather, scatter=None, scatter_idx=None):
        calls.append((routing_data, gather, scatter or scatter_idx, self.gate_up_proj_bias, self.down_proj_bias))
        return x

    monkeypatch.setattr(experts, method, run)
    fn = kernels4.experts_fn(D, I, E, K, w_gu, w_d)
    for proj, w in (("gate_up_proj", w_gu), ("down_proj", w_d)):
        blocks, scales = handed[proj]
        assert blocks.shape == (E, w.shape[1], w.shape[2] // 32, 16) and torch.equal(blocks.flatten(2), w.packed)
        assert torch.equal(scales, w.scale)
    x = torch.randn(3, D)
    sets = [(torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])),
            (torch.tensor([[3, 2], [0, 2], [1, 3]]), torch.tensor([[0.6, 0.4], [0.2, 0.8], [0.5, 0.5]]))]
    for ids, weights in sets + sets:
        fn(x, ids, weights)
    assert len(routed) == 2 and [k for _, k in routed] == [K, K]
    for (logits, _), (ids, _) in zip(routed, sets):
        assert torch.equal(logits.float().topk(K).indices.sort(-1).values, ids.sort(-1).values)
    assert [c[0] for c in calls] == [("data", 1), ("data", 2)] * 2
    assert all(c[1:3] == ("gather", "scatter") for c in calls)
    bias_gu, bias_d = calls[0][3:]
    assert bias_gu.shape == (E, 2 * I) and bias_d.shape == (E, D) and not bias_gu.any() and not bias_d.any()
