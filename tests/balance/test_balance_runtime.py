"""The balancer inside the runtime, on real processes: decisions agree across ranks, trading and
migration never change the layer's math, and a migration moves weights exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from distributed import run_ranks

from thunderep import EPConfig, LayerConfig, ThunderMoELayer

D, I, E = 16, 8, 8


def _run(rank, world, steps, probes="auto", measure=True, records=False):
    import torch.distributed as dist

    from conftest import init_module
    from thunderep.balance import BalancerConfig, plan_placement
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    if records:  # split sizes and rider written by the counting kernel (the interpreter; host memory as the segment)
        from thunderep.comm.control_records import RecordExchange

        ep.dispatcher.records = RecordExchange.for_group(ep.config.record_bytes, ep.groups.ep_group, device="cpu")
    config = LayerConfig.build(family="mixtral", hidden_size=D, intermediate_size=I, num_experts=E, top_k=2)
    full = init_module(ThunderMoELayer(config), 0)
    placement = plan_placement(torch.ones(E), world, E // world + 1)  # one redundant slot per rank
    hot = max(e for e in range(E) if len(placement.replicas(e)) == 1)  # a hot expert with no replica yet
    with torch.no_grad():  # `hot` is every token's first choice: a skew the balancer must see
        full.router.weight[:, 0] = 0.0
        full.router.weight[hot, 0] = 5.0
    # The cost check divides the real size of one slot (the layer fills it in: bytes_per_expert left
    # None) by the bandwidth the ranks measured on their all-to-alls and agreed on (the configured 1e12
    # only until a measurement exists).
    cfg = BalancerConfig(slow_window=4, min_dwell=6, settle=2, seconds_per_pair=1e-3, bandwidth=1e12, probes=probes,
                         measure=measure)
    layer = ThunderMoELayer(config, ep=ep, placement=placement, balancer=cfg)
    assert layer.balancer.replicated == (probes == "all" or (probes == "auto" and records))
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)  # lr 0: weights stay equal to `full`'s
    out = {"decisions": [], "max_err": 0.0, "max_grad_err": 0.0}
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(24, D, generator=gen)
        x[:, 0] = 10.0
        x.requires_grad_(True)
        y = layer(x)
        y.sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        y_ref = full(x_ref)
        y_ref.sum().backward()
        out["max_err"] = max(out["max_err"], (y - y_ref).abs().max().item())
        out["max_grad_err"] = max(out["max_grad_err"], (x.grad - x_ref.grad).abs().max().item())
        opt.step()
        opt.zero_grad()
        full.zero_grad()
        d = layer.balance_step(opt)
        out["decisions"].append((d.state, d.alarm, d.traded, d.migrated, d.placement.slot_expert_RS,
                                 round(d.imbalance, 6), d.bandwidth, d.measured))
    # After migrations every local slot still holds exactly its logical expert's weights.
    local = torch.tensor(layer.local_experts)
    out["weights_ok"] = bool(torch.equal(layer.experts.gate_up_proj, full.experts.gate_up_proj[local])
                             and torch.equal(layer.experts.down_proj, full.experts.down_proj[local]))
    out["imbalance_first_last"] = (layer.stats.loads_R[0], layer.stats.loads_R[-1])
    out["slot_bytes"] = (layer.balancer.config.bytes_per_expert,
                         sum(p[0].numel() * p.element_size() for p in full.experts.parameters()))
    out["rounds"] = None if ep.dispatcher.records is None else ep.dispatcher.records.round
    dist.barrier()
    ep.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_balancer_trades_and_migrates_without_changing_the_math(world):
    """Each rank's own probe (CPU ranks: "auto"); replicated probes: the two tests below."""
    results = run_ranks(_run, world, 40, timeout=240)
    first = results[0]["decisions"]
    for res in results:
        assert res["decisions"] == first, "every rank must reach the same decisions"
        assert res["max_err"] < 1e-5 and res["max_grad_err"] < 1e-5
        assert res["weights_ok"]
        used, real = res["slot_bytes"]
        assert used == real, "the cost check must use the layer's real slot size (SGD: no state)"
    states = [d[0] for d in first]
    assert "negotiate" in states and any(d[2] for d in first), "the skew must be negotiated and traded"
    assert any(d[3] for d in first), "a persistent skew must end in a migration"
    assert sum(d[3] for d in first) <= 40 // 6 + 1, "no more migrations than the dwell allows"
    assert not first[0][7] and first[0][6] == 1e12, "before any measurement: the configured bandwidth"
    assert first[-1][7] and first[-1][6] < 1e12, "later negotiations agree on a measured bandwidth"
    assert all(d[7] for d in first if d[3]), "migrations were checked against the measured bandwidth"


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_probes_decide_as_each_ranks_own(world):
    """Every rank running every rank's probe on the counts read off the split sizes makes the decisions each
    rank's own probe and its exchanged fingerprints make, step for step (bandwidth not measured, so that
    nothing timed enters); and the runs negotiate, trade and migrate, so the comparison covers each."""
    own = run_ranks(_run, world, 40, "own", False, timeout=240)
    replicated = run_ranks(_run, world, 40, "all", False, timeout=240)
    for a, b in zip(own, replicated):
        assert a["decisions"] == b["decisions"] == own[0]["decisions"]
        assert a["imbalance_first_last"] == b["imbalance_first_last"]
    decisions = own[0]["decisions"]
    assert any(d[1] for d in decisions) and any(d[2] for d in decisions) and any(d[3] for d in decisions)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("world", [2, 4])
def test_balancer_words_ride_in_the_records_the_counting_kernel_writes(world):
    """Records written by the counting kernel (the interpreter here, host memory standing in for the mapped
    segment): with the balancer on, the probes are replicated ("auto") and each step's record, with its
    bandwidth word on Negotiate steps, goes through the segment; the decisions are those of each rank's own
    probe with fingerprints through the host; with bandwidth measured, the ranks agree on it through the
    words the kernel wrote."""
    steps = 24
    own = run_ranks(_run, world, steps, "own", False, timeout=240)
    written = run_ranks(_run, world, steps, "auto", False, True, timeout=480)
    for a, b in zip(own, written):
        assert b["rounds"] == steps and b["max_err"] < 1e-5 and b["max_grad_err"] < 1e-5
        assert a["decisions"] == b["decisions"]
    assert any(d[0] == "negotiate" for d in own[0]["decisions"]) and any(d[2] for d in own[0]["decisions"])
    measured = run_ranks(_run, world, steps, "auto", True, True, timeout=480)
    assert all(r["decisions"] == measured[0]["decisions"] for r in measured)
    assert measured[0]["decisions"][-1][7], "a later negotiation agreed on a bandwidth the ranks measured"


def test_slot_bytes_count_weights_and_optimizer_state():
    """What a slot's migration moves: its weights, plus optimizer state shaped like them (Adam: 2x)."""
    config = LayerConfig.build(family="mixtral", hidden_size=D, intermediate_size=I, num_experts=E, top_k=2)
    layer = ThunderMoELayer(config)
    weights = sum(p[0].numel() * p.element_size() for p in layer.experts.parameters())
    assert layer.slot_bytes() == weights == (2 * I * D + D * I) * 4
    opt = torch.optim.Adam(layer.parameters())
    assert layer.slot_bytes(opt) == weights  # no state before the first step
    layer(torch.randn(5, D)).sum().backward()
    opt.step()
    assert layer.slot_bytes(opt) == 3 * weights  # exp_avg and exp_avg_sq move along
