"""Measured bandwidth on real processes (gloo): every rank measures its own all-to-all bandwidth (or
is given a different one), the codes ride in the Negotiate records of the dispatcher's one control
exchange, and every rank's machine agrees on the same value: the smallest one."""

from __future__ import annotations

import pytest
from distributed import run_ranks

E, T, K, D = 8, 512, 2, 64
STEPS = 14


def _run(rank, world, forced):
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
    balancer = LayerBalancer(placement, BalancerConfig(refresh_every=3, settle=0))
    core = ExpertParallelMoE(ep, placement, balancer)
    gen = torch.Generator().manual_seed(7 + rank)
    out = []
    for step in range(STEPS):
        ids_TK = torch.randint(0, E, (T, K), generator=gen)
        sent = balancer.meter.code if balancer.machine.negotiating else None
        core.placement = balancer.machine.placement
        meta = core.plan([ids_TK], [torch.full((T, K), 1.0 / K)])[0]
        x_TD = torch.randn(T, D, generator=gen)
        pending = ep.dispatcher.dispatch_async(x_TD, meta)
        rows_QD = pending.wait()
        ep.dispatcher.combine_async(rows_QD, pending.received).wait()  # identity experts: the rows go back
        if forced:  # this rank's link moves (rank + 1) GB/s: every rank measured a different value
            balancer.meter.observe((rank + 1) * 1e6, 1e-3)
            d = balancer.step()
        else:  # measured: the dispatcher's bytes and seconds of this step's all-to-alls
            d = balancer.step(ep.dispatcher.stats)
        out.append({"sent": sent, "decision": (d.step, d.state, d.next_mode.value, d.bandwidth, d.measured,
                                               d.record_bytes)})
    dist.barrier()
    ep.close()
    return out


@pytest.mark.parametrize("forced", [True, False], ids=["given", "measured"])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_the_slowest_measured_bandwidth(world, forced):
    from thunderep.balance.measure import agreed_code, decode_bandwidth

    results = run_ranks(_run, world, forced, timeout=240)
    decisions = [[s["decision"] for s in r] for r in results]
    assert all(d == decisions[0] for d in decisions[1:]), "every rank must agree on the bandwidth"
    first = decisions[0]
    assert first[0][1] == "negotiate" and not first[0][4], "step 0: nothing measured, the constant"
    assert first[0][3] == 12e9 and first[0][5] == 12 + 4 * E
    assert all(d[5] == 8 for d in first if d[1] == "stable"), "a Stable step still costs 8 bytes"
    expected = None
    for t, d in enumerate(first):
        if d[1] == "negotiate":
            codes = [r[t]["sent"] for r in results]
            assert None not in codes  # every rank knew it negotiated, before the exchange
            expected = agreed_code(codes) or expected
        assert d[3] == (12e9 if expected is None else decode_bandwidth(expected)), f"step {t}"
    assert expected and first[-1][4], "later negotiations carry measurements"
    if forced:  # the ranks measured 1, 2, .. world GB/s: all use rank 0's, the slowest
        last = max(t for t, d in enumerate(first) if d[1] == "negotiate")
        assert len({r[last]["sent"] for r in results}) == world  # different local values, one agreed
        assert abs(first[-1][3] / 1e9 - 1.0) < 1e-3
