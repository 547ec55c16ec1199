"""Mode "auto": the rule (`mode_seconds`, `reach_per_rank`) against hand-computed cases, and on 2 and 4
real processes (gloo) a layer call that picks the same mode on every rank, for both outcomes, with
outputs and gradients equal to one process."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_ranks
from test_layer_ep import _check, _full_layer

from thunderep import EPConfig, ThunderMoELayer
from thunderep.balance.placement import Placement
from thunderep.moe.ep import COSTS, ModeCosts, mode_seconds, reach_per_rank

D = 16


def test_reach_is_the_chance_that_k_distinct_experts_hit_a_rank():
    # 8 experts on 2 ranks, top-2: a rank is missed when both experts are among the other 4: 6 of 28 pairs
    assert reach_per_rank(Placement.contiguous(8, 2), 2) == [22 / 28, 22 / 28]
    # top-8 of 16 on 4 ranks of 4: missed with C(12, 8) / C(16, 8) = 495 / 12870
    assert reach_per_rank(Placement.contiguous(16, 4), 8) == pytest.approx([1 - 495 / 12870] * 4, abs=1e-15)
    assert reach_per_rank(Placement.contiguous(8, 2), 5) == [1.0, 1.0]  # 5 of 8 always reach both halves
    # a rank holding a replica counts its distinct experts: rank 1 holds {2, 3} (3 twice)
    uneven = Placement(4, ((0, 1), (2, 3), (3, 3)))
    assert reach_per_rank(uneven, 1) == [0.5, 0.5, 0.25]


COSTS_1 = ModeCosts(a2a_us=10.0, ring_us=20.0, link_GBps=1.0, local_GBps=2.0, ep_extra_us=100.0,
                    ep_extra_backward_us=30.0)


def test_mode_seconds_by_hand():
    # T 1000, R 2, reach 0.75 each, K 2, D 4, 16-byte rows, 4-byte elements
    got = mode_seconds(1000, [0.75, 0.75], 2, 4, 16, 4, COSTS_1)
    ep_link = 1000 * 0.75 * (2 * 16 + 8 * 2)  # 36000 B: rows out with side rows, rows back
    ep_local = 2 * 1000 * 0.75 * 2 * 4 * 4  # 48000 B of float32 pair rows
    assert got["ep"] == pytest.approx(100e-6 + 3 * 10e-6 + ep_link / 1e9 + ep_local / 2e9)
    ag_link = 1 * 1000 * (2 * 4 * 4 + 12 * 2)  # x and rows back, weights and ids: 56000 B
    ag_local = 2 * 1000 * 2 * 4 * 4  # 64000 B
    assert got["allgather"] == pytest.approx(4 * 20e-6 + ag_link / 1e9 + ag_local / 2e9)
    back = mode_seconds(1000, [0.75, 0.75], 2, 4, 16, 4, COSTS_1, backward=True)
    assert back["ep"] == pytest.approx(130e-6 + 6 * 10e-6 + 2 * (ep_link / 1e9 + ep_local / 2e9))
    assert back["allgather"] == pytest.approx(7 * 20e-6 + 2 * (ag_link / 1e9 + ag_local / 2e9))


def test_mode_seconds_counts_the_busiest_rank():
    # reach [1, 0.5, 0.25]: the busiest sender (home rank 2) sends 1.5 rows per token, the busiest receiver
    # fills R T 1.0 K rows; every collective over 3 ranks costs 2 messages
    got = mode_seconds(10, [1.0, 0.5, 0.25], 1, 2, 8, 4, COSTS_1)
    ep_link, ep_local = 10 * 1.5 * (2 * 8 + 8), 3 * 10 * 1.0 * 1 * 2 * 4
    assert got["ep"] == pytest.approx(100e-6 + 3 * 2 * 10e-6 + ep_link / 1e9 + ep_local / 2e9)
    ag_link, ag_local = 2 * 10 * (2 * 2 * 4 + 12), 3 * 10 * 1 * 2 * 4
    assert got["allgather"] == pytest.approx(4 * 2 * 20e-6 + ag_link / 1e9 + ag_local / 2e9)


def test_the_shipped_constants_choose_as_documented():
    """docs/benchmarks/2026-12-05-auto-mode.md. NCCL without P2P, 2 ranks: decode-sized batches in
    all-gather mode, large Mixtral-shaped ones in ep mode; top-8 of 128 sends the same bytes either way,
    so all-gather mode's smaller fixed cost keeps it. 4 ranks: ep mode (4 ring collectives of 3
    messages cost more than ep mode's 3 all-to-alls and its extra). CPU ranks (gloo): ep mode."""
    def choice(costs, T, R, E, K, D_, element, backward=False):
        est = mode_seconds(T, reach_per_rank(Placement.contiguous(E, R), K), K, D_, element * D_, element, costs,
                           backward)
        return min(est, key=est.get)

    nccl, gloo = COSTS["nccl"], COSTS["gloo"]
    assert choice(nccl, 8, 2, 8, 2, 4096, 2) == choice(nccl, 64, 2, 128, 8, 2048, 2) == "allgather"
    assert choice(nccl, 1024, 2, 8, 2, 4096, 2) == "allgather"
    assert choice(nccl, 2048, 2, 8, 2, 4096, 2) == choice(nccl, 512, 2, 8, 2, 4096, 2, True) == "ep"
    assert choice(nccl, 8192, 2, 128, 8, 2048, 2, backward=True) == "allgather"
    for T in (1, 64, 4096):
        assert choice(nccl, T, 4, 8, 2, 4096, 2) == choice(nccl, T, 4, 128, 8, 2048, 2) == "ep"
        for R in (2, 4):
            assert choice(gloo, T, R, 8, 2, 256, 4) == choice(gloo, T, R, 128, 8, 256, 4, True) == "ep"


FORCE = {  # costs that make one mode win for every T
    "allgather": ModeCosts(a2a_us=1.0, ring_us=1.0, link_GBps=1e9, local_GBps=1e9, ep_extra_us=1e9),
    "ep": ModeCosts(a2a_us=1.0, ring_us=1e9, link_GBps=1e9, local_GBps=1e9, ep_extra_us=0.0),
}


def _auto_calls(rank, world, cases):
    """Per case (layer kind, tokens per rank, forced winner or None: the shipped constants): the mode
    each call ran in, the rule's estimate, and outputs / gradients against one process."""
    import torch.distributed as dist

    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    groups = init_expert_parallel()
    out = {}
    for key, (name, tokens, forced) in cases.items():
        ep = ExpertParallel(groups, EPConfig(control="collective"))
        full = _full_layer(name)
        total = sum(tokens)
        gen = torch.Generator().manual_seed(5)
        x_all, g_all = torch.randn(total, D, generator=gen), torch.randn(total, D, generator=gen)
        layer = ThunderMoELayer(full.config, ep=ep)
        layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
        if forced is not None:
            layer.core.costs = FORCE[forced]
        x_ref = x_all.clone().requires_grad_(True)
        full(x_ref).backward(g_all)
        start = sum(tokens[:rank])
        x = x_all[start:start + tokens[rank]].clone().requires_grad_(True)
        # the decision reads shapes only, never the routing ids: on the meta device (no data) it is the same
        K = full.config.router.top_k
        on_meta = layer.core.choose_mode(x.detach(), torch.empty(tokens[rank], K, dtype=torch.long, device="meta"))
        y = layer(x)  # mode "auto"
        y.backward(g_all[start:start + tokens[rank]])
        checks = {"y": (y.detach(), full(x_all)[start:start + tokens[rank]].detach()),
                  "dx": (x.grad, x_ref.grad[start:start + tokens[rank]])}
        for n, p in layer.named_parameters():
            ref = dict(full.named_parameters())[n].grad
            if n.startswith("experts."):
                checks[n] = (p.grad, ref[torch.tensor(layer.local_experts)])
            else:
                grad = p.grad.clone()
                dist.all_reduce(grad)
                checks[n] = (grad, ref)
        out[key] = (checks, {"calls": dict(layer.core.calls), "estimate": layer.core.last_estimate,
                             "on_meta": on_meta})
        ep.close()
    return out


CASES = {  # name: (layer, tokens per rank at 2 / 4 ranks, forced winner)
    "forced_allgather": ("top8", {2: [6, 6], 4: [5, 5, 5, 5]}, "allgather"),
    "forced_ep": ("mixtral", {2: [6, 6], 4: [5, 5, 5, 5]}, "ep"),
    "unequal_never_allgather": ("mixtral", {2: [6, 7], 4: [5, 5, 6, 5]}, "allgather"),
    "measured_constants": ("top8", {2: [12, 12], 4: [12, 12, 12, 12]}, None),
}


@pytest.mark.parametrize("world", [2, 4])
def test_auto_mode_picks_the_same_mode_on_every_rank_and_equals_one_process(world):
    cases = {k: (name, t[world], forced) for k, (name, t, forced) in CASES.items()}
    results = run_ranks(_auto_calls, world, cases, timeout=240)
    for key, (_, _, forced) in CASES.items():
        per_rank = [r[key] for r in results]
        _check(per_rank)
        calls = [info["calls"] for _, info in per_rank]
        assert all(c == calls[0] for c in calls), f"{key}: ranks chose differently: {calls}"
        assert sum(calls[0].values()) == 1 and calls[0]["latency"] == 0
        chosen = "ep" if calls[0]["ep"] else "allgather"
        assert all(info["on_meta"] == chosen for _, info in per_rank)
        if key == "unequal_never_allgather":
            assert chosen == "ep" and per_rank[0][1]["estimate"] is None  # unequal T: no estimate made
            continue
        estimates = [info["estimate"] for _, info in per_rank]
        assert all(e == estimates[0] for e in estimates)  # from shared data only: bit-identical
        assert chosen == min(estimates[0], key=estimates[0].get)
        if forced is not None:
            assert chosen == forced
        else:  # 12 equal tokens, top-8: the gloo constants' estimate, worked out here
            reach = reach_per_rank(Placement.contiguous(16, world), 8)
            assert estimates[0] == mode_seconds(12, reach, 8, D, D * 4, 4, COSTS["gloo"], backward=True)
    assert math.isfinite(results[0]["measured_constants"][1]["estimate"]["ep"])


def _bounded(rank, world):
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective", allgather_max_tokens=4))
    # the rule says all-gather at every T; the bound says no above 4 tokens
    modes = [ep.auto_mode(T, allgather_wins=lambda T: True) for T in (4, 5)]
    ep.close()
    return modes


def test_the_bound_still_caps_allgather_mode():
    assert run_ranks(_bounded, 2) == [["allgather", "ep"]] * 2
