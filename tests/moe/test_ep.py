"""The expert-parallel core (thunderep/moe/ep.py): waves, and one view of "the MoE layers of this model"
for ThunderEP's own layers and a wrapped transformers model alike, on 1, 2 and 4 real processes."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from thunderep.moe.ep import MODES, wave_bounds

pytest.importorskip("transformers")


@pytest.mark.parametrize("T", [0, 1, 5, 16, 17])
@pytest.mark.parametrize("waves", [1, 2, 3, 4])
def test_waves_cover_the_tokens_in_order_and_differ_by_at_most_one(T, waves):
    bounds = wave_bounds(T, waves)
    assert len(bounds) == waves
    assert [b[0] for b in bounds] == [0] + [b[1] for b in bounds[:-1]] and bounds[-1][1] == T
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _views(model) -> list[dict]:
    from thunderep.moe.ep import moe_layers

    state = model.state_dict()
    out = []
    for layer in moe_layers(model):
        params = layer.parameters()
        out.append({
            "name": layer.name, "key": layer.key, "experts": layer.num_experts, "tensors": layer.tensors,
            "slots": layer.placement.slot_expert_RS, "core": layer.core is not None,
            # every expert-sharded parameter is the state dict's tensor of that name, one entry per local slot
            "in_state": all(state[f"{layer.name}.{t}"].data_ptr() == getattr(layer.module, t).data_ptr()
                            for t in layer.tensors),
            "leading": sorted({p.shape[0] for p in params}),
        })
    return out


def _both_models(rank, world):
    from hf_tiny import tiny_model

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE
    from thunderep.moe.ep import moe_layers
    from thunderep.moe.model import MoEModelConfig, MoETransformer

    torch.manual_seed(0)
    with ExpertParallel(init_expert_parallel(), EPConfig(control="collective")) as ep:
        own = MoETransformer(MoEModelConfig(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8), ep=ep)
        wrapped = ThunderMoE.wrap(tiny_model("mixtral"), ep)
        views = {"own": _views(own), "hf": _views(wrapped)}
        # Each call counts on its layer's core, in the mode it ran: the same bookkeeping for both models.
        ids = torch.randint(0, 12, (2, 3), generator=torch.Generator().manual_seed(rank))
        own(torch.randint(0, 256, (1, 4)), mode="ep")
        wrapped(input_ids=ids, mode="allgather")
        views["calls"] = {kind: [dict(layer.core.calls) for layer in moe_layers(m)]
                          for kind, m in (("own", own), ("hf", wrapped))}
        views["bindings"] = [(name, b.core is layer.core) for (name, b), layer
                             in zip(wrapped.bindings.items(), moe_layers(wrapped))]
    return views


@pytest.mark.parametrize("world", [2, 4])
def test_one_view_of_the_moe_layers_for_thunderep_and_transformers_models(world):
    results = run_ranks(_both_models, world, timeout=240)
    for rank, views in enumerate(results):
        own, hf = views["own"], views["hf"]
        assert [v["name"] for v in own] == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
        assert [v["key"] for v in own] == ["layers.0.mlp", "layers.1.mlp"]  # the checkpoint names of before
        assert hf and all(v["name"] == "model." + v["key"] for v in hf)  # ThunderMoE.model holds the HF model
        for v in own + hf:
            assert v["core"] and v["in_state"], v
            S = len(v["slots"][0])
            assert len(v["slots"]) == world and v["leading"] == [S], v
            assert sorted(e for row in v["slots"] for e in row) == list(range(v["experts"]))
        assert all(same for _, same in views["bindings"])
        assert all(c == {"ep": 1, "latency": 0, "allgather": 0} for c in views["calls"]["own"])
        assert all(c == {"ep": 0, "latency": 0, "allgather": 1} for c in views["calls"]["hf"])
    assert set(MODES) == {"auto", "ep", "latency", "allgather"}


def test_without_a_runtime_every_layer_is_local_with_the_whole_placement():
    from hf_tiny import tiny_model

    from thunderep.hf import ThunderMoE
    from thunderep.moe.model import MoEModelConfig, MoETransformer

    own = _views(MoETransformer(MoEModelConfig(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=4)))
    hf = _views(ThunderMoE.wrap(tiny_model("mixtral")))
    for v in own + hf:
        assert not v["core"] and v["in_state"]
        assert v["slots"] == (tuple(range(v["experts"])),) and v["leading"] == [v["experts"]]
