"""The Stable / Negotiate / Migrate machine on simulated ranks (one probe and one machine per rank)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from thunderep import ConfigError, Placement
from thunderep.balance.balancer_config import BalancerConfig
from thunderep.balance.fingerprint import ProbeRecord
from thunderep.balance.machine import BalanceMachine, Mode, realized_imbalance
from thunderep.balance.measure import decode_bandwidth, encode_bandwidth
from thunderep.balance.placement import TradePlan
from thunderep.balance.records import decode_records, encode_record
from thunderep.balance.planner import plan_placement

PAIRS = 4096


def _zipf(E: int, s: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = torch.empty(E, dtype=torch.float64)
    p[torch.randperm(E, generator=gen)] = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    return p / p.sum()


def simulate(p_TE: torch.Tensor, R: int, placement: Placement, config: BalancerConfig = BalancerConfig(),
             seed: int = 0, totals: bool = True, bandwidth_R=None) -> list:
    """R ranks, each with its own probe and its own machine; records go through encode / decode like
    the control plane would carry them, and (totals=True) every rank sees every rank's total rows
    under the plan in effect, as the split sizes carry them. bandwidth_R: each rank's own measured
    bandwidth (B/s; None: not measured), sent on Negotiate steps. Asserts that every rank takes the
    same decision every step."""
    E = p_TE.shape[1]
    gen = torch.Generator().manual_seed(seed)
    probes = [config.probe(E) for _ in range(R)]
    machines = [BalanceMachine(placement, config) for _ in range(R)]
    decisions = []
    for p_E in p_TE:
        words = {m.record_words for m in machines}
        assert len(words) == 1
        counts_RE = torch.poisson(p_E.expand(R, E) * PAIRS, generator=gen)
        records = [probe.record(counts_RE[r], machines[r].negotiating) for r, probe in enumerate(probes)]
        codes_R = [encode_bandwidth(b) for b in bandwidth_R] if bandwidth_R else [0] * R
        rows_RW = torch.stack([encode_record(rec, code) for rec, code in zip(records, codes_R)])
        assert rows_RW.shape[1] == words.pop()
        rank_load_R = machines[0].trade.rank_loads(counts_RE.to(torch.int64)).tolist() if totals else None
        step = [m.step(*decode_records(rows_RW.clone(), E), rank_load_R) for m in machines]
        assert all(d == step[0] for d in step[1:]), "ranks disagree"
        for probe, rec in zip(probes, records):
            probe.commit(rec, reset=step[0].alarm, rebase=step[0].rebaselined)
        decisions.append(step[0])
    return decisions


def test_records_round_trip():
    for fp in (0, 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF):
        load = torch.tensor([5, 0, 7], dtype=torch.int32)
        rec = ProbeRecord(fp, load, torch.zeros(3), torch.zeros(3), 1.0)
        words = encode_record(rec)
        assert words.dtype == torch.int32 and words.numel() == 6
        fps, load_RE, codes = decode_records(torch.stack([words, encode_record(rec, 65535)]), 3)
        assert fps == (fp, fp) and load_RE.tolist() == [[5, 0, 7]] * 2 and codes == (0, 65535)
        stable = encode_record(dataclasses.replace(rec, load_E=None), 123)  # no code on a Stable record
        assert decode_records(stable.view(1, 2), 3) == ((fp,), None, None)
    with pytest.raises(ConfigError, match=r"bandwidth_code"):
        encode_record(rec, 1 << 16)
    with pytest.raises(ConfigError, match=r"\[R, 2\] or \[R, 6\]"):
        decode_records(torch.zeros(2, 4, dtype=torch.int32), 3)


@pytest.mark.parametrize("R", [2, 4])
def test_stationary_uniform_trace_stays_stable(R):
    E = 16
    placement = plan_placement(torch.ones(E), R, E // R + 1)
    decisions = simulate(torch.full((300, E), 1.0 / E, dtype=torch.float64), R, placement, seed=R)
    assert decisions[0].state == "negotiate" and decisions[0].next_mode is Mode.STABLE
    stable = sum(d.state == "stable" for d in decisions)
    assert stable >= 0.95 * len(decisions)
    assert not any(d.migrated or d.traded for d in decisions)
    assert all(d.record_bytes == 8 for d in decisions if d.state == "stable")
    assert all(d.record_bytes == 12 + 4 * E for d in decisions if d.state == "negotiate")


@pytest.mark.parametrize("R", [2, 4])
def test_forced_skew_negotiates_then_migrates(R):
    E = 8
    config = BalancerConfig()
    start = Placement.contiguous(E, R, E // R + 1)
    hot = 7  # contiguous(...) replicates experts 0.. R-1: expert 7 has a single slot
    assert len(start.replicas(hot)) == 1
    p_TE = torch.full((400, E), 1.0 / E, dtype=torch.float64)
    p_TE[100:] = 0.5 / (E - 1)
    p_TE[100:, hot] = 0.5
    decisions = simulate(p_TE, R, start, config, seed=R)
    before = decisions[:100]
    assert not any(d.migrated for d in before)
    alarms = [d.step for d in decisions if d.alarm]
    assert alarms and 100 <= alarms[0] <= 102
    assert decisions[alarms[0] + 1].state == "negotiate"
    assert decisions[alarms[0] + 1].imbalance > config.threshold  # everyone sees the same skew
    migrations = [d for d in decisions if d.migrated]
    assert len(migrations) == 1
    m = migrations[0]
    assert alarms[0] + config.slow_window <= m.step <= alarms[0] + config.slow_window + 10
    assert len(m.placement.replicas(hot)) >= 2 and m.moved_slots and m.bytes_moved > 0
    assert m.predicted <= config.threshold
    after = decisions[m.step + 20:]
    assert sum(d.state == "stable" for d in after) >= 0.95 * len(after)
    assert max(d.imbalance for d in after) <= config.threshold


def test_no_oscillation_on_a_stationary_skewed_trace():
    E, R = 16, 4
    p_TE = _zipf(E, 1.2).expand(1200, E)
    decisions = simulate(p_TE, R, plan_placement(torch.ones(E), R, E // R + 1), seed=5)
    migrations = [d for d in decisions if d.migrated]
    assert len(migrations) == 1
    assert sum(d.state == "stable" for d in decisions) >= 0.95 * len(decisions)
    assert max(d.imbalance for d in decisions[migrations[0].step + 5:]) <= 1.10


def test_cost_check_and_dwell():
    E, R = 8, 2
    start = Placement.contiguous(E, R, E // R + 1)
    p_TE = torch.full((300, E), 0.5 / (E - 1), dtype=torch.float64)
    p_TE[:, 7] = 0.5
    expensive = BalancerConfig(bytes_per_expert=1e15)  # moving a byte never pays
    assert not any(d.migrated for d in simulate(p_TE, R, start, expensive))
    # two shifts 60 steps apart with min_dwell 150: the second migration waits for the dwell
    config = BalancerConfig(min_dwell=150)
    first = [d for d in simulate(p_TE[:60], R, start, config) if d.migrated]
    assert len(first) == 1
    hot2 = next(e for e in range(E) if len(first[0].placement.replicas(e)) == 1)
    p_TE = torch.cat([p_TE[:60], torch.full((340, E), 0.5 / (E - 1), dtype=torch.float64)])
    p_TE[60:, hot2] = 0.5
    steps = [d.step for d in simulate(p_TE, R, start, config) if d.migrated]
    assert len(steps) == 2 and steps[1] - steps[0] >= 150


@pytest.mark.parametrize("R", [2, 4])
def test_cost_check_uses_the_agreed_measured_bandwidth(R):
    E = 8
    start = Placement.contiguous(E, R, E // R + 1)
    p_TE = torch.full((150, E), 0.5 / (E - 1), dtype=torch.float64)
    p_TE[:, 7] = 0.5  # expert 7 has one slot: only a migration balances it
    # What the first migration must save: 32 steps x ~0.5 x 4096 pairs x 0.6 us ~ 0.04 s; moving 1-2
    # slots of 12.6 MB takes 1-2 ms at the configured 12 GB/s, 1-2 s at a measured 12 MB/s.
    fast = [25e9 - 1e9 * r for r in range(R)]  # every rank measured its own (different) value
    slow = list(fast)
    slow[R - 1] = 12e6  # one slow link
    constant = simulate(p_TE, R, start)
    assert any(d.migrated for d in constant) and not any(d.measured for d in constant)
    assert all(d.bandwidth == 12e9 for d in constant)
    blocked = simulate(p_TE, R, start, bandwidth_R=slow)  # the slowest measurement decides, everywhere
    assert not any(d.migrated for d in blocked)
    agreed = decode_bandwidth(encode_bandwidth(12e6))
    assert all(d.measured and d.bandwidth == agreed for d in blocked)
    allowed = simulate(p_TE, R, start, bandwidth_R=fast)
    assert [d.migrated for d in allowed] == [d.migrated for d in constant]
    assert all(d.bandwidth == decode_bandwidth(encode_bandwidth(min(fast))) for d in allowed)
    # A constant that would block a move does not, once the ranks measured a fast link.
    pessimistic = BalancerConfig(bandwidth=1e6)
    assert not any(d.migrated for d in simulate(p_TE, R, start, pessimistic))
    assert any(d.migrated for d in simulate(p_TE, R, start, pessimistic, bandwidth_R=fast))
    # Measurement off (the runtime then sends code 0): the constant again.
    assert not any(d.measured for d in simulate(p_TE, R, start, bandwidth_R=[None] * R))


def test_lag_one_modes_and_words():
    E, R = 4, 2
    machine = BalanceMachine(Placement.contiguous(E, R), BalancerConfig())
    assert machine.negotiating and machine.record_words == 3 + E
    load = torch.tensor([[10, 10, 10, 10], [10, 10, 10, 10]])
    d = machine.step((1, 2), load)
    assert d.state == "negotiate" and d.next_mode is Mode.STABLE and machine.record_words == 2
    d = machine.step((1, 2))
    assert d.state == "stable" and not d.alarm and machine.mode is Mode.STABLE
    d = machine.step((1, 3))
    assert d.alarm and machine.negotiating and machine.record_words == 3 + E
    assert machine.counters == {"stable": 2, "negotiate": 1, "alarm": 1, "trade": 0, "migrate": 0,
                                "rebaseline": 0}


def _swapping_within_ranks(placement: Placement, steps: int, every: int) -> torch.Tensor:
    """p_TE where, on every rank, the first two local experts trade 3/4 of their joint mass every
    `every` steps: the load profile moves a lot, every rank's total stays the same."""
    E = placement.num_experts
    p_TE = torch.full((steps, E), 1.0 / E, dtype=torch.float64)
    for r in range(placement.ep_size):
        a, b = placement.slot_expert_RS[r][:2]
        for t in range(steps):
            hot, cold = (a, b) if (t // every) % 2 == 0 else (b, a)
            p_TE[t, hot], p_TE[t, cold] = 1.75 / E, 0.25 / E
    return p_TE


@pytest.mark.parametrize("R", [2, 4])
def test_drifting_but_balanced_load_rebaselines_without_negotiating(R):
    E = 8
    placement = Placement.contiguous(E, R)
    p_TE = _swapping_within_ranks(placement, 200, every=25)
    decisions = simulate(p_TE, R, placement, seed=R)
    late = decisions[20:]  # after the first negotiation and its settle negotiation
    assert all(d.state == "stable" and not d.alarm for d in late)
    assert all(d.realized is not None and d.realized < 1.10 for d in late)
    rebaselines = [d.step for d in decisions if d.rebaselined]
    assert len(rebaselines) >= 5 and all(d.next_mode is Mode.STABLE for d in decisions if d.rebaselined)
    assert all(d.record_bytes == 8 for d in late)
    # Without the rank totals the same trace negotiates on every profile change.
    blind = simulate(p_TE, R, placement, seed=R, totals=False)
    assert sum(d.alarm for d in blind[20:]) >= 5


def test_rebaseline_adopts_the_changed_fingerprints():
    machine = BalanceMachine(Placement.contiguous(4, 2), BalancerConfig(settle=0))
    machine.step((1, 2), torch.full((2, 4), 10))
    d = machine.step((1, 3), rank_load_R=(100, 98))
    assert d.rebaselined and not d.alarm and d.next_mode is Mode.STABLE
    assert d.realized == pytest.approx(200 / 198)
    d = machine.step((1, 3), rank_load_R=(100, 98))  # the adopted fingerprints are the baseline now
    assert not d.rebaselined and not d.alarm
    d = machine.step((1, 2), rank_load_R=(99, 101))  # back to the first profile: adopted again
    assert d.rebaselined and machine.counters["rebaseline"] == 2 and machine.counters["alarm"] == 0


def test_realized_imbalance_over_threshold_with_unchanged_fingerprints_alarms():
    config = BalancerConfig(settle=0)
    machine = BalanceMachine(Placement.contiguous(4, 2), config)
    d = machine.step((1, 2), torch.full((2, 4), 10))  # negotiated loads: balanced
    assert d.imbalance == 1.0
    d = machine.step((1, 2), rank_load_R=(104, 96))  # within threshold: nothing to do
    assert not d.alarm and d.next_mode is Mode.STABLE
    d = machine.step((1, 2), rank_load_R=(130, 70))  # 1.30: the stale baseline must not hide it
    assert d.alarm and d.realized == pytest.approx(1.3) and machine.negotiating
    d = machine.step((1, 2), torch.tensor([[30, 30, 10, 10], [30, 30, 10, 10]]))
    assert d.state == "negotiate" and d.imbalance == pytest.approx(1.5)
    # Without rank totals (fingerprints only) the same skew behind unchanged fingerprints goes unseen.
    blind = BalanceMachine(Placement.contiguous(4, 2), config)
    blind.step((1, 2), torch.full((2, 4), 10))
    assert not blind.step((1, 2)).alarm


def test_a_known_imbalance_is_not_renegotiated_every_step():
    machine = BalanceMachine(Placement.contiguous(4, 2), BalancerConfig(settle=0))
    d = machine.step((1, 2), torch.tensor([[30, 30, 10, 10], [30, 30, 10, 10]]))
    assert d.imbalance == pytest.approx(1.5) and not d.traded  # no replicas: nothing to trade
    for _ in range(5):  # realized as believed, fingerprints unchanged: the slow window runs
        d = machine.step((1, 2), rank_load_R=(121, 80))
        assert not d.alarm and d.state == "stable"
    d = machine.step((1, 2), rank_load_R=(160, 40))  # 1.6: worse than believed by more than the margin
    assert d.alarm
    machine.step((1, 2), torch.tensor([[40, 40, 5, 5], [40, 40, 5, 5]]))
    d = machine.step((1, 7), rank_load_R=(160, 40))  # over threshold and the loads moved: negotiate
    assert d.alarm


def test_probe_rebase_takes_its_ema_as_baseline():
    from thunderep.balance.fingerprint import LoadProbe, fingerprint

    probe = LoadProbe(4)
    probe.commit(probe.record(torch.tensor([100, 100, 100, 100]), True))
    first = probe.record(torch.tensor([100, 100, 100, 100]), False).fingerprint
    moved = torch.tensor([300, 30, 100, 100])
    for _ in range(20):
        rec = probe.record(moved, False)
        probe.commit(rec)
    assert rec.fingerprint != first
    probe.commit(rec, rebase=True)  # the machine re-baselined: nothing was sent
    assert probe.baseline.counts_E.tolist() == rec.ema_E.round().tolist()
    again = probe.record(moved, False).fingerprint  # what the machine adopts on the next step
    assert again == fingerprint(probe.baseline.counts_E) != rec.fingerprint


def test_loads_older_than_a_rebaseline_are_refreshed_before_a_migration():
    config = BalancerConfig(settle=0, slow_window=3, min_dwell=0, bandwidth=1e15, seconds_per_pair=1.0)
    skew = torch.tensor([[10, 10, 10, 200], [10, 10, 10, 200]])
    placement = Placement.contiguous(4, 2, 3)  # expert 3 has one slot: only a migration helps

    def run(fps, fresh_loads, rank_load_R=(420, 60)):
        machine = BalanceMachine(placement, config)
        machine.step((1, 2), skew)  # believed 1.68, slow window counting from here
        out = []
        for fp in fps:
            if machine.negotiating:
                out.append(machine.step((5, 5), fresh_loads))
                break
            out.append(machine.step(fp, rank_load_R=rank_load_R))
        return out

    known = run([(1, 2)] * 3, skew)  # the known skew persists: migrate on the negotiated loads
    assert [d.migrated for d in known[:2]] == [False, True] and not known[0].alarm
    # The profile moved, the plan holds (a re-baseline) before the slow window ran out: the loads the
    # migration would be planned on are stale, so negotiate first, then decide on the fresh ones.
    moved = run([(1, 9)] * 4, torch.full((2, 4), 50), rank_load_R=(250, 230))
    assert moved[0].rebaselined and not any(d.alarm or d.migrated for d in moved)
    assert moved[1].next_mode is Mode.NEGOTIATE
    assert moved[2].state == "negotiate" and not moved[2].migrated and moved[2].predicted <= 1.1


def test_realized_imbalance_is_exact_and_checked():
    assert realized_imbalance((3, 1), 2) == 1.5 and realized_imbalance([0, 0, 0], 3) == 1.0
    assert realized_imbalance(torch.tensor([5.0, 3.0]), 2) == realized_imbalance((5, 3), 2) == 1.25
    with pytest.raises(ConfigError, match=r"2 non-negative rank totals"):
        realized_imbalance((1, 2, 3), 2)
    with pytest.raises(ConfigError, match=r"2 non-negative rank totals"):
        BalanceMachine(Placement.contiguous(4, 2)).step((0, 0), torch.ones(2, 4), rank_load_R=(4, -1))


def test_refresh_every_forces_a_negotiation():
    machine = BalanceMachine(Placement.contiguous(4, 2), BalancerConfig(refresh_every=3))
    load = torch.ones(2, 4, dtype=torch.int64)
    modes = []
    for _ in range(8):
        modes.append(machine.step((0, 0), load if machine.negotiating else None).state)
    assert modes == ["negotiate", "stable", "stable", "stable", "negotiate", "stable", "stable", "stable"]


def test_young_loads_are_confirmed_by_a_settle_negotiation():
    machine = BalanceMachine(Placement.contiguous(4, 2), BalancerConfig(settle=3))
    load = torch.ones(2, 4, dtype=torch.int64)
    fps = [(0, 0)] * 5 + [(0, 9)] + [(0, 9)] * 6  # an alarm at step 5; the new baseline is (0, 9)
    states = [machine.step(fp, load if machine.negotiating else None).state for fp in fps]
    assert states == ["negotiate", "stable", "stable", "negotiate", "stable", "stable",
                      "negotiate", "stable", "stable", "negotiate", "stable", "stable"]


def test_trade_only_when_over_threshold_and_it_helps():
    placement = Placement(3, ((0, 2), (1, 2)))
    machine = BalanceMachine(placement, BalancerConfig())
    skewed = torch.tensor([[100, 0, 50], [0, 20, 50]])
    d = machine.step((0, 0), skewed)
    assert d.traded and d.imbalance > 1.1 and d.predicted == pytest.approx(1.0, abs=1e-4)
    assert machine.trade != TradePlan.identity(placement) and d.trade == machine.trade
    machine = BalanceMachine(placement, BalancerConfig())
    d = machine.step((0, 0), torch.tensor([[50, 0, 50], [0, 50, 50]]))
    assert not d.traded and d.imbalance == 1.0 and machine.trade == TradePlan.identity(placement)


def test_misuse_raises_config_errors():
    machine = BalanceMachine(Placement.contiguous(4, 2))
    with pytest.raises(ConfigError, match=r"got 3 fingerprints for an EP group of 2 ranks"):
        machine.step((0, 0, 0), torch.ones(2, 4))
    with pytest.raises(ConfigError, match=r"needs the exchanged load_RE \[2, 4\], got None"):
        machine.step((0, 0))
    with pytest.raises(ConfigError, match=r"threshold \(0.9\)"):
        BalancerConfig(threshold=0.9)
    with pytest.raises(ConfigError, match=r"slow_window must be a non-negative integer, got -1"):
        BalancerConfig(slow_window=-1)
    with pytest.raises(ConfigError, match=r"needs a Placement"):
        BalanceMachine("contiguous")


def test_state_dicts_resume_identically():
    import json

    E, R = 8, 4
    p_TE = _zipf(E, 1.2).expand(120, E)
    config = BalancerConfig()
    start = plan_placement(torch.ones(E), R, E // R + 1)
    gen = torch.Generator().manual_seed(0)
    counts = [torch.poisson(p_TE[t].expand(R, E) * PAIRS, generator=gen) for t in range(120)]

    def run(machine, probes, steps):
        out = []
        for t in steps:
            recs = [pr.record(counts[t][r], machine.negotiating) for r, pr in enumerate(probes)]
            d = machine.step(*decode_records(torch.stack([encode_record(x) for x in recs]), E))
            for pr, x in zip(probes, recs):
                pr.commit(x, reset=d.alarm)
            out.append(d)
        return out

    machine, probes = BalanceMachine(start, config), [config.probe(E) for _ in range(R)]
    whole = run(machine, probes, range(120))
    assert any(d.migrated for d in whole[:60])  # the saved state holds a placement of its own
    machine, probes = BalanceMachine(start, config), [config.probe(E) for _ in range(R)]
    run(machine, probes, range(60))
    saved = json.loads(json.dumps({"m": machine.state_dict(), "p": [p.state_dict() for p in probes]}))
    machine, probes = BalanceMachine(start, config), [config.probe(E) for _ in range(R)]
    machine.load_state_dict(saved["m"])
    for probe, state in zip(probes, saved["p"]):
        probe.load_state_dict(state)
    assert run(machine, probes, range(60, 120)) == whole[60:]
    with pytest.raises(ConfigError, match=r"not a BalanceMachine state"):
        machine.load_state_dict({"num_experts": 8})
