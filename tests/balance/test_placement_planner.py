"""TradePlan and the pure planners (plan_trade, plan_placement) on hand-made loads."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import pytest
import torch

from thunderep import ConfigError, Placement
from thunderep.balance.placement import QUOTA_ONE, TradePlan
from thunderep.balance.planner import moved_slots, plan_placement, plan_trade, water_fill


def _ids(E: int, T: int, K: int, seed: int, p: torch.Tensor | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = torch.ones(E) if p is None else p
    return torch.multinomial(p.expand(T, E), K, replacement=False, generator=gen)


def _subset_bound(load_E: list[float], placement: Placement) -> float:
    """The optimal min-max rank load: max over rank sets U of (load of experts living only in U) / |U|."""
    R, S = placement.ep_size, placement.slots_per_rank
    ranks_E = [{p // S for p in placement.replicas(e)} for e in range(placement.num_experts)]
    best = 0.0
    for k in range(1, R + 1):
        for U in itertools.combinations(range(R), k):
            inside = sum(load for load, ranks in zip(load_E, ranks_E) if ranks <= set(U))
            best = max(best, inside / k)
    return best


# -- TradePlan


@pytest.mark.parametrize("E,R,S", [(8, 2, 4), (8, 2, 5), (6, 4, 2), (16, 4, 5)])
def test_identity_trade_reproduces_slot_table(E, R, S):
    placement = Placement.contiguous(E, R, S)
    plan = TradePlan.identity(placement)
    ids = _ids(E, 37, 2, seed=E + R)
    for r in range(R):
        assert torch.equal(plan.assign(r, ids), placement.slot_table(r)[ids.reshape(-1)])
    assert plan.is_identity and not any(plan.split_experts(r) for r in range(R))


def test_plan_trade_without_replicas_is_the_slot_table():
    placement = Placement.contiguous(8, 4)
    load_RE = torch.randint(0, 100, (4, 8))
    plan = plan_trade(load_RE, placement)
    assert plan == TradePlan.identity(placement)
    ids = _ids(8, 50, 2, seed=1)
    for r in range(4):
        assert torch.equal(plan.assign(r, ids), placement.slot_table(r)[ids.reshape(-1)])


def _two_rank_plan() -> TradePlan:
    # rank 0 holds experts (0, 2), rank 1 holds (1, 2): expert 2 has replicas in slots 1 and 3
    placement = Placement(3, ((0, 2), (1, 2)))
    quota = [[QUOTA_ONE, QUOTA_ONE // 4, QUOTA_ONE, 3 * QUOTA_ONE // 4], [QUOTA_ONE, 0, QUOTA_ONE, QUOTA_ONE]]
    return TradePlan(placement, tuple(tuple(row) for row in quota))


def test_assign_realizes_the_quotas_in_token_order():
    plan = _two_rank_plan()
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 1], [1, 0], [2, 0]])  # five pairs of expert 2
    slots = plan.assign(0, ids)
    # expert 2's pairs in (t, k) order: the first ceil(5 / 4) = 2 go to slot 1, the other 3 to slot 3
    assert slots.tolist() == [1, 0, 1, 2, 0, 3, 3, 2, 2, 0, 3, 0]
    assert plan.assign(1, ids).tolist() == [3, 0, 3, 2, 0, 3, 3, 2, 2, 0, 3, 0]
    assert plan.split(0, 2) == {1: 0.25, 3: 0.75} and plan.split_experts(0) == (2,)
    assert plan.assign(0, torch.zeros(0, 2, dtype=torch.int64)).numel() == 0


@pytest.mark.parametrize("few", [True, False])
def test_assign_fractions_on_many_pairs(few, monkeypatch):
    if not few:  # force the sort-based path
        monkeypatch.setattr("thunderep.balance.placement._FEW_SPLIT", -1)
    E, R, S = 16, 4, 5
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -1.2
    load_RE = (p / p.sum() * 8000).expand(R, E).round().to(torch.int64)
    placement = plan_placement(load_RE.sum(0), R, S)
    plan = plan_trade(load_RE, placement)
    ids = _ids(E, 20000, 2, seed=3, p=p.float())
    for r in range(R):
        slots = plan.assign(r, ids)
        flat = ids.reshape(-1)
        for e in range(E):
            n = int((flat == e).sum())
            got = torch.bincount(slots[flat == e], minlength=placement.num_slots)
            for slot, frac in plan.split(r, e).items():
                assert abs(int(got[slot]) - frac * n) <= 1, (r, e, slot)
            assert int(got.sum()) == n and set(got.nonzero().flatten().tolist()) <= set(placement.replicas(e))


def test_trade_plan_is_frozen_hashable_and_comparable():
    a, b = _two_rank_plan(), _two_rank_plan()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != TradePlan.identity(a.placement)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.quota_RP = ()


def test_trade_plan_validation():
    placement = Placement(3, ((0, 2), (1, 2)))
    with pytest.raises(ConfigError, match=r"expert 2's replicas \[1, 3\] for source rank 0 sum to 100"):
        TradePlan(placement, ((QUOTA_ONE, 50, QUOTA_ONE, 50), (QUOTA_ONE, 0, QUOTA_ONE, QUOTA_ONE)))
    with pytest.raises(ConfigError, match=r"must be 2 x 4"):
        TradePlan(placement, ((QUOTA_ONE,) * 4,))
    with pytest.raises(ConfigError, match=r"src_rank \(2\)"):
        TradePlan.identity(placement).assign(2, torch.zeros(1, 1, dtype=torch.int64))


def test_slot_loads_exact_for_integers():
    plan = _two_rank_plan()
    load_RE = torch.tensor([[10, 0, 8], [0, 6, 4]])
    assert plan.slot_loads(load_RE).tolist() == [10 * QUOTA_ONE, 2 * QUOTA_ONE, 6 * QUOTA_ONE, 10 * QUOTA_ONE]
    assert plan.rank_loads(load_RE.double()).tolist() == [12.0, 16.0]
    assert plan.imbalance(load_RE) == pytest.approx(16 / 14)


# -- plan_trade


def test_plan_trade_local_first_and_water_filled():
    placement = Placement(3, ((0, 2), (1, 2)))
    load_RE = torch.tensor([[100, 0, 50], [0, 20, 50]])
    plan = plan_trade(load_RE, placement)
    # levels before expert 2: (100, 20); pouring its 100 pairs gives (110, 110): rank 0 computes 10,
    # all from its own 50 (local first), the other 40 go to rank 1, which keeps all of its own.
    assert plan.split(0, 2) == pytest.approx({1: 0.2, 3: 0.8}, abs=1 / QUOTA_ONE)
    assert plan.split(1, 2) == {3: 1.0}
    assert plan.imbalance(load_RE) == pytest.approx(1.0, abs=1e-5)  # quotas are multiples of 2^-16
    assert plan.rank_loads(load_RE.double()).tolist() == pytest.approx([110.0, 110.0], abs=1e-3)


def test_plan_trade_source_without_load_keeps_local_replica():
    placement = Placement(3, ((0, 2), (1, 2)))
    plan = plan_trade(torch.tensor([[10, 0, 0], [0, 10, 30]]), placement)
    assert plan.split(0, 2) == {1: 1.0}  # rank 0 sends no pairs of expert 2: it would use its own


@pytest.mark.parametrize("seed", range(6))
def test_water_fill_reaches_the_subset_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    R, S = 4, 3
    E = R * S - int(torch.randint(1, 5, (1,), generator=gen))
    flat = list(range(E)) + torch.randint(0, E, (R * S - E,), generator=gen).tolist()
    flat = [flat[i] for i in torch.randperm(R * S, generator=gen).tolist()]
    placement = Placement(E, tuple(tuple(flat[q * S:(q + 1) * S]) for q in range(R)))
    load_E = (torch.rand(E, generator=gen) ** 3 * 1000).tolist()
    _, level = water_fill(load_E, placement)
    assert max(level) <= _subset_bound(load_E, placement) * (1 + 1e-6) + 1e-9
    assert sum(level) == pytest.approx(sum(load_E))


def test_plan_trade_is_deterministic_and_dtype_independent():
    placement = Placement.contiguous(8, 2, 5)
    load = torch.tensor([[50, 9, 3, 1, 7, 2, 4, 8], [40, 1, 30, 2, 1, 6, 2, 1]])
    plans = {plan_trade(load, placement), plan_trade(load.to(torch.int32), placement),
             plan_trade(load.double(), placement)}
    assert len(plans) == 1


def test_plan_trade_rejects_bad_loads():
    placement = Placement.contiguous(4, 2)
    with pytest.raises(ConfigError, match=r"shape \[2, 4\]"):
        plan_trade(torch.ones(4), placement)
    with pytest.raises(ConfigError, match=r"non-negative"):
        plan_trade(-torch.ones(2, 4), placement)


# -- plan_placement


def test_plan_placement_replicates_the_hottest_and_balances():
    load_E = torch.tensor([100.0, 10, 10, 10, 10, 10, 10, 10])
    placement = plan_placement(load_E, 2, 5)
    assert len(placement.replicas(0)) == 2 and {p // 5 for p in placement.replicas(0)} == {0, 1}
    assert len(placement.replicas(1)) == 2  # the second redundant slot: expert 0 already has R replicas
    assert max(water_fill(load_E.tolist(), placement)[1]) == pytest.approx(85.0)
    assert plan_trade(torch.stack([load_E / 2, load_E / 2]), placement).imbalance(
        torch.stack([load_E / 2, load_E / 2])) == pytest.approx(1.0)


def test_plan_placement_zipf_one_redundant_slot_per_rank():
    for E, R in ((8, 2), (16, 4), (64, 4)):
        p = torch.arange(1, E + 1, dtype=torch.float64) ** -1.2
        load_E = p / p.sum() * 10000
        placement = plan_placement(load_E, R, E // R + 1)
        assert max(water_fill(load_E.tolist(), placement)[1]) * R / 10000 <= 1.02, (E, R)


def test_plan_placement_keeps_what_stays():
    E, R, S = 16, 4, 5
    gen = torch.Generator().manual_seed(0)
    load_E = torch.rand(E, generator=gen) * 100 + 10
    first = plan_placement(load_E, R, S)
    # the same load, a little noisy: nothing moves
    assert plan_placement(load_E * (1 + 0.01 * torch.randn(E, generator=gen)), R, S, first) == first
    # one expert becomes very hot: few slots move, and every expert that stays on a rank keeps its slot
    hot = load_E.clone()
    hot[int(load_E.argmin())] = 600.0
    second = plan_placement(hot, R, S, first)
    moved = moved_slots(first, second)
    assert len(moved) == 3  # the hot expert needs a replica on each of the 3 other ranks: no more
    for q in range(R):
        for s, e in enumerate(first.experts_of(q)):
            if e in second.experts_of(q):
                assert second.experts_of(q)[s] == e or first.experts_of(q).count(e) > 1
    fresh = plan_placement(hot, R, S)
    assert max(water_fill(hot.tolist(), second)[1]) <= max(water_fill(hot.tolist(), fresh)[1]) * 1.02 + 1e-9


def test_plan_placement_rejects_bad_arguments():
    with pytest.raises(ConfigError, match=r"slots_per_rank \(2\) x ep_size \(2\) = 4 slots cannot hold 5"):
        plan_placement(torch.ones(5), 2, 2)
    with pytest.raises(ConfigError, match=r"previous placement has 4 experts on 2 x 2"):
        plan_placement(torch.ones(4), 2, 3, Placement.contiguous(4, 2))
    with pytest.raises(ConfigError, match=r"non-negative"):
        plan_placement(torch.tensor([1.0, math.nan, 1.0, 1.0]), 2, 2)
    with pytest.raises(ConfigError, match=r"ep_size must be a positive integer"):
        plan_placement(torch.ones(4), 0, 2)


def test_assign_cost_on_100k_pairs():
    torch.set_num_threads(1)
    E, R = 64, 4
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -1.2
    load_RE = (p / p.sum() * 8192).expand(R, E)
    plan = plan_trade(load_RE, plan_placement(load_RE.sum(0), R, E // R + 1))
    ids = torch.multinomial(p.float(), 100_000, replacement=True).view(-1, 2)
    plan.assign(0, ids)
    started = time.perf_counter()
    for r in range(R):
        plan.assign(r, ids)
    per_call = (time.perf_counter() - started) / R
    assert per_call < 0.05, f"assign takes {per_call * 1e3:.1f} ms for 100k pairs"
