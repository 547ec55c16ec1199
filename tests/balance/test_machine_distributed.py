"""The balancer's decisions on real processes (gloo): every rank routes its own tokens, the records
and split sizes go through the dispatcher's one control exchange, and every rank's machine must take
the same decisions, including the realized imbalance it computes from the exchanged split sizes."""

from __future__ import annotations

import pytest
from distributed import run_ranks

E, T, K = 8, 2048, 2
STEPS, SKEW_AT = 70, 50


def _p_E(placement, step: int):
    """Until SKEW_AT: on every rank the first two local experts swap most of their joint mass every
    10 steps (the profile drifts, every rank's total stays even). From SKEW_AT: rank 0's experts
    take three times their share (the plan in effect is over threshold, nothing can be traded)."""
    import torch

    w_E = torch.ones(E, dtype=torch.float64)
    for r in range(placement.ep_size):
        a, b = placement.slot_expert_RS[r][:2]
        hot, cold = (a, b) if (step // 10) % 2 == 0 else (b, a)
        w_E[hot], w_E[cold] = 1.75, 0.25
    if step >= SKEW_AT:
        w_E[list(placement.slot_expert_RS[0])] *= 3.0
    return w_E / w_E.sum()


def _run(rank, world):
    import torch
    import torch.distributed as dist

    from thunderep import EPConfig, Placement
    from thunderep.balance import BalancerConfig
    from thunderep.balance.layer_balancer import LayerBalancer
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.moe.ep import ExpertParallelMoE

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    placement = Placement.contiguous(E, world)
    balancer = LayerBalancer(placement, BalancerConfig())
    core = ExpertParallelMoE(ep, placement, balancer)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank routes different tokens
    decisions = []
    for step in range(STEPS):
        ids_TK = torch.multinomial(_p_E(placement, step), T * K, replacement=True, generator=gen).view(T, K)
        core.placement = balancer.machine.placement
        core.plan([ids_TK], [torch.full((T, K), 1.0 / K)])
        d = balancer.step()
        decisions.append((d.step, d.state, d.alarm, d.rebaselined, d.traded, d.migrated, d.realized,
                          d.imbalance, d.predicted, d.next_mode.value, d.placement.slot_expert_RS))
    dist.barrier()
    ep.close()
    return decisions


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_realized_imbalance_and_rebaselines(world):
    results = run_ranks(_run, world, timeout=240)
    first = results[0]
    for other in results[1:]:
        assert other == first, "every rank must reach the same decisions from the same exchange"
    state, alarm, rebaselined, realized, next_mode = 1, 2, 3, 6, 9
    drifting = first[20:SKEW_AT]  # after the first negotiation and its settle negotiation
    assert all(d[state] == "stable" and not d[alarm] for d in drifting), "a balanced drift negotiated"
    assert all(d[realized] < 1.10 for d in drifting)
    assert sum(d[rebaselined] for d in first[:SKEW_AT]) >= 2, "the drifting profile must be re-baselined"
    alarms = [d[0] for d in first if d[alarm]]
    assert alarms and SKEW_AT <= alarms[0] <= SKEW_AT + 1, "the skew must leave Stable at once"
    assert first[alarms[0]][realized] > 1.10 and first[alarms[0]][next_mode] == "negotiate"
    assert first[alarms[0] + 1][state] == "negotiate"
    known = first[alarms[0] + 12:]  # negotiated and settled: no trade helps, the imbalance is known
    assert all(d[realized] > 1.10 for d in known)
    assert sum(d[state] == "stable" for d in known) >= 0.8 * len(known), "a known skew re-negotiated"
