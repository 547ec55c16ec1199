"""The load balancer on a wrapped Hugging Face model, on real processes (gloo, CPU): with a skewed
router the ranks negotiate, trade and migrate experts, reach the same decisions, and training takes
exactly the steps of the same model without a balancer."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")

STEPS = 8  # trades from the first step; on 4 ranks a migration at step 5


def _train(rank, world):
    import copy

    import torch.distributed as dist
    from hf_tiny import V, tiny_model

    from thunderep import EPConfig, Placement
    from thunderep.balance import BalancerConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    model = tiny_model("mixtral", seed=2)
    E = model.config.num_local_experts
    hot = E // world - 1  # the last expert of rank 0's block: a skew the balancer must see
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[hot] += 3.0 * layer.mlp.gate.weight.abs().mean()
    placement = Placement.contiguous(E, world, E // world + 1)  # a spare slot per rank
    # measure=False: the cost check uses the configured bandwidth, not this machine's timings, so the
    # decisions (the 4-rank migration included) do not depend on how busy the machine is
    config = BalancerConfig(slow_window=4, min_dwell=6, settle=2, seconds_per_pair=1e-3, bandwidth=1e12, measure=False)
    runs = {}
    for name, balancer in (("plain", None), ("balanced", config)):
        tm = ThunderMoE.wrap(copy.deepcopy(model), ep, placement=placement, balancer=balancer)
        opt = torch.optim.SGD(tm.parameters(), lr=0.05)
        losses, decisions = [], []
        for step in range(STEPS):
            ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            loss = tm(input_ids=ids, labels=ids).loss  # mode auto: ep mode for the balanced model
            (loss / world).backward()
            tm.all_reduce_grads(average=False)
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean / world)
            decisions.append([(d.state, d.traded, d.migrated, d.placement.slot_expert_RS) if d else None
                              for d in tm.balance_step(opt)])
        # every slot holds its logical expert's trained weights: equal to the plain run's copy of it
        experts = {f"{n}.{t}": (b.local_experts, getattr(tm.model.get_submodule(n), t).detach().clone())
                   for n, b in tm.bindings.items() for t in b.tensors}
        runs[name] = {"losses": torch.stack(losses), "decisions": decisions, "experts": experts,
                      "calls": [dict(b.calls) for b in tm.bindings.values()]}
    ep.close()
    return runs


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_wrapped_model_trains_like_the_plain_one(world):
    results = run_ranks(_train, world, timeout=300)
    first = results[0]["balanced"]["decisions"]
    states = [d[0] for step in first for d in step if d]
    assert "negotiate" in states and any(d[1] for step in first for d in step if d), "skew negotiated and traded"
    for rank, runs in enumerate(results):
        plain, balanced = runs["plain"], runs["balanced"]
        assert balanced["decisions"] == first, f"rank {rank}: every rank must reach the same decisions"
        assert all(c["allgather"] == 0 and c["ep"] == STEPS for c in balanced["calls"])
        torch.testing.assert_close(balanced["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    # after migrations, each rank's slot s holds expert local[s]: the same values as wherever the plain
    # run holds that expert
    owners = {}
    for runs in results:
        for key, (local, value) in runs["plain"]["experts"].items():
            for s, e in enumerate(local):
                owners.setdefault((key, e), value[s])
    assert any(d[2] for step in first for d in step if d) == (world == 4)  # the 4-rank run migrates
    for runs in results:
        for key, (local, value) in runs["balanced"]["experts"].items():
            for s, e in enumerate(local):
                torch.testing.assert_close(value[s], owners[key, e], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{key} {e}: {m}")
