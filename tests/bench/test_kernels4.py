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
