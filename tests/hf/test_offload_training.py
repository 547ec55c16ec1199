"""Training with offloaded experts (`from_pretrained(..., gpu_memory=...)`): the experts held in host memory
train frozen, and the gradients of everything else equal the plain transformers model's with its routed
experts frozen, at hot fractions 0, 0.5 and 1, cold experts forced onto either path, on 1 rank and on 2 and
4 gloo ranks in ep mode; what cannot train is refused by name. On CPU the device is the host."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import V, offload_budget, save_tiny  # noqa: E402

from thunderep.errors import ConfigError  # noqa: E402
from thunderep.moe.offload_cost import OffloadCosts  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
HOST_WINS = OffloadCosts(host_flops=1e12, device_flops=1e12, h2d_Bps=1.0)
STREAM_WINS = OffloadCosts(host_flops=1.0, device_flops=1e12, h2d_Bps=1e15)
ROUTED = re.compile(r"mlp\.experts\.")  # the routed experts' tensors (not deepseek's shared experts)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {f: save_tiny(f, tmp_path_factory.mktemp(f) / f, seed=3) for f in FAMILIES}


def _batch():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, V, (4, 7), generator=gen), torch.randn(4, 7, V, generator=gen)


def _reference_grads(path) -> dict:
    """The plain model's gradients of sum(logits * probe) over the whole batch, routed experts frozen."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    for name, p in ref.named_parameters():
        p.requires_grad_(not ROUTED.search(name))
    ids, probe = _batch()
    (ref(input_ids=ids).logits * probe).sum().backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}


def _grads(tm, rows: slice, **run) -> dict:
    ids, probe = _batch()
    tm.train()
    (tm(input_ids=ids[rows], **run).logits * probe[rows]).sum().backward()
    grads = {n: p.grad for n, p in tm.model.named_parameters() if p.requires_grad}
    assert not any(p.requires_grad for p in tm.offloaded_parameters())
    return grads


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_trains_like_transformers_with_frozen_experts(family, checkpoints):
    from thunderep.hf import ThunderMoE
    from thunderep.train.trainable import select_trainable

    path = checkpoints[family]
    want = _reference_grads(path)
    for fraction, costs in ((0.0, HOST_WINS), (0.5, STREAM_WINS), (0.5, HOST_WINS), (1.0, HOST_WINS)):
        tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, fraction), offload_costs=costs)
        trainable = select_trainable(tm, None)  # full fine-tuning: the offloaded experts stay frozen
        assert {id(p) for p in trainable}.isdisjoint(id(p) for p in tm.offloaded_parameters())
        got = _grads(tm, slice(None))
        assert got.keys() == want.keys(), (family, fraction, sorted(set(got) ^ set(want))[:4])
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * max(1.0, g.abs().max().item()),
                                       msg=lambda m: f"{family} hot {fraction}, {name}: {m}")
        stats = tm.offload_stats()  # forward: the path the costs choose; backward: cold slots streamed
        assert (stats["rows_host"] > 0) == (costs is HOST_WINS and fraction < 1), (family, fraction, stats)
        assert (stats["rows_streamed"] > 0) == (fraction < 1), (family, fraction, stats)


def _ranks(rank, world, path):
    import torch.distributed as dist

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    out = []
    for fraction, costs in ((0.0, HOST_WINS), (0.5, STREAM_WINS)):
        tm = ThunderMoE.from_pretrained(path, ep, gpu_memory=offload_budget(path, fraction, world), offload_costs=costs)
        for p in tm.offloaded_parameters():
            assert not p.requires_grad
        per = 4 // world
        grads = _grads(tm, slice(rank * per, (rank + 1) * per), mode="ep")
        for g in grads.values():  # replicated weights: each rank's part, summed as data parallelism does
            dist.all_reduce(g)
        out.append((fraction, grads))
    ep.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ep_ranks_train_like_transformers_with_frozen_experts(world, checkpoints):
    path = checkpoints["qwen3_moe"]
    want = _reference_grads(path)
    for rank, results in enumerate(run_ranks(_ranks, world, path, timeout=300)):
        for fraction, got in results:
            assert got.keys() == want.keys()
            for name, g in want.items():
                torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * max(1.0, g.abs().max().item()),
                                           msg=lambda m: f"rank {rank}, hot {fraction}, {name}: {m}")


def test_what_cannot_train_is_refused(checkpoints):
    from thunderep.hf import ThunderMoE
    from thunderep.train.lora import apply_lora

    path = checkpoints["mixtral"]
    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.5))
    with pytest.raises(ConfigError, match="expert tensor held in host memory .* train frozen"):
        apply_lora(tm.model, ["experts"], rank=2)
    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.5))
    tm.offloaded_parameters()[0].requires_grad_(True)
    with pytest.raises(ConfigError, match=r"offloaded experts \(gpu_memory=...\) train frozen"):
        tm.train()(input_ids=_batch()[0])
