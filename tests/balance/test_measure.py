"""Measured bandwidth: the 16-bit code, the rank-local meter, the agreement and old saved states."""

from __future__ import annotations

import json
import math

import pytest
import torch

from thunderep import ConfigError, Placement
from thunderep.balance.layer_balancer import LayerBalancer
from thunderep.balance.balancer_config import BalancerConfig
from thunderep.balance.machine import BalanceMachine
from thunderep.balance.measure import (BANDWIDTH_CODES, RELATIVE_ERROR, LinkMeter, agreed_code,
                                       decode_bandwidth, encode_bandwidth)
from thunderep.comm.stats import CommStats


def test_code_round_trips_within_its_documented_error():
    assert RELATIVE_ERROR == 2.0 ** -11
    gen = torch.Generator().manual_seed(0)
    values = [1.5, 1e3, 7.7e6, 1e9, 12e9, 25e9, 6.4e10, 1e15, 1.7e19]
    values += (10.0 ** (torch.rand(2000, generator=gen, dtype=torch.float64) * 18.0)).tolist()
    worst = 0.0
    for x in values:
        code = encode_bandwidth(x)
        assert 1 <= code < BANDWIDTH_CODES
        worst = max(worst, abs(decode_bandwidth(code) / x - 1.0))
        assert encode_bandwidth(decode_bandwidth(code)) == code  # decoded values are exact codes
    assert worst <= RELATIVE_ERROR
    assert worst > RELATIVE_ERROR / 2  # the bound is tight, not loose by orders of magnitude


def test_code_is_monotone_clamped_and_exact():
    codes = [encode_bandwidth(x) for x in (1e6, 1e6 * (1 + 2 ** -9), 2e6, 3e9, 3.01e9, 4e12)]
    assert codes == sorted(codes) and len(set(codes)) == len(codes)
    assert encode_bandwidth(None) == 0 and decode_bandwidth(0) is None
    assert encode_bandwidth(0.25) == 1 and encode_bandwidth(1e30) == encode_bandwidth(math.inf) == 65535
    assert decode_bandwidth(1) == 1 + 2 ** -10 and decode_bandwidth(65535) == (2 - 2 ** -10) * 2.0 ** 63
    assert decode_bandwidth(encode_bandwidth(2.0 ** 33)) == 2.0 ** 33  # powers of two are exact
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ConfigError, match="must be > 0 B/s"):
            encode_bandwidth(bad)
    with pytest.raises(ConfigError, match=r"\[0, 65535\]"):
        decode_bandwidth(65536)


def test_agreement_is_the_slowest_measurement():
    slow, fast = encode_bandwidth(3e9), encode_bandwidth(12e9)
    assert agreed_code([fast, slow, 0, fast]) == slow  # ranks without a measurement do not count
    assert agreed_code([0, 0]) == 0 and agreed_code([]) == 0
    with pytest.raises(ConfigError, match="bandwidth codes"):
        agreed_code([1, -1])


def test_meter_is_a_ratio_of_emas_of_the_dispatchers_bytes_and_seconds():
    meter = LinkMeter(alpha=0.5)
    assert meter.bandwidth is None and meter.code == 0
    meter.observe(0, 1e-3)  # nothing sent to another rank: no evidence
    assert meter.bandwidth is None
    meter.observe(8e6, 1e-3)
    assert meter.bandwidth == pytest.approx(8e9)
    meter.observe(8e6, 3e-3)  # bytes 8e6, seconds 2e-3 on average
    assert meter.bandwidth == pytest.approx(4e9) and meter.code == encode_bandwidth(4e9)
    stats = CommStats(world=2, rank=0)
    meter = LinkMeter(alpha=1.0)
    stats.record("dispatch", [999, 1000], 1e-3)  # the entry of rank 0 itself never crossed a link
    stats.record("combine_backward", [0, 3000], 1e-3)
    stats.record("control", [0, 10**9], 1.0)  # neither the control exchange nor migrations count
    stats.record("migration", [0, 10**9], 1.0)
    meter.observe_stats(stats)
    assert meter.bandwidth == pytest.approx(4000 / 2e-3)
    meter.observe_stats(stats)  # no new traffic: no sample, the measurement stays
    assert meter.bandwidth == pytest.approx(4000 / 2e-3)
    stats.record("combine", [0, 6000], 1e-3)
    meter.observe_stats(stats)  # only the difference since the last call
    assert meter.bandwidth == pytest.approx(6e6)
    stats.reset()
    stats.record("dispatch", [0, 10], 1.0)
    meter.observe_stats(stats)  # totals went down: restart from them, no sample
    assert meter.bandwidth == pytest.approx(6e6)
    saved = json.loads(json.dumps(meter.state_dict()))
    other = LinkMeter(alpha=1.0)
    other.load_state_dict(saved)
    assert other.bandwidth == meter.bandwidth
    with pytest.raises(ConfigError, match="not a LinkMeter state"):
        other.load_state_dict({"bytes_ema": 1.0, "seconds_ema": None})


# Saved by the balancer before it measured bandwidth (no "bandwidth_code", no "meter"), with the
# decisions that code took after the save; BalancerConfig(settle=0, slow_window=3, min_dwell=0,
# seconds_per_pair=1e-3), Placement.contiguous(4, 2, 3).
OLD_MACHINE = json.loads(
    '{"num_experts": 4, "slot_expert_RS": [[0, 1, 2], [3, 0, 1]], "quota_RP": [[65536, 65536, 65536, '
    '65536, 0, 0], [65536, 65536, 65536, 65536, 0, 0]], "step": 2, "mode": "stable", "baseline_R": [1, 2], '
    '"load_RE": [[10, 10, 10, 200], [10, 10, 10, 200]], "believed": 1.7391304347826086, "above": 2, '
    '"last_migration": null, "last_negotiation": 0, "next_check": 0, "regime_start": 0, "settle_at": null, '
    '"young": false, "adopt": false, "stale": false, "counters": {"stable": 1, "negotiate": 1, "alarm": 0, '
    '"trade": 1, "migrate": 0, "rebaseline": 0}}')
OLD_AFTER = [["stable", True, 1.0, [[0, 3, 2], [3, 0, 1]]], ["stable", False, 1.0, [[0, 3, 2], [3, 0, 1]]],
             ["negotiate", False, 1.0, [[0, 3, 2], [3, 0, 1]]], ["stable", False, 1.0, [[0, 3, 2], [3, 0, 1]]]]
OLD_LAYER_BALANCER = json.loads(
    '{"machine": {"num_experts": 4, "slot_expert_RS": [[0, 3, 2], [3, 0, 1]], "quota_RP": [[65536, 65425, '
    '65536, 111, 0, 65536], [0, 0, 65536, 65536, 65536, 65536]], "step": 3, "mode": "stable", "baseline_R": '
    '[8348894929916356817, 8348894929916356817], "load_RE": [[30, 27, 28, 589], [30, 27, 28, 589]], '
    '"believed": 1.0000035543470072, "above": 0, "last_migration": 2, "last_negotiation": 2, "next_check": 0, '
    '"regime_start": 1, "settle_at": null, "young": false, "adopt": false, "stale": false, "counters": '
    '{"stable": 1, "negotiate": 2, "alarm": 1, "trade": 1, "migrate": 1, "rebaseline": 0}}, "probe": '
    '{"ema_E": [30.199999999999996, 27.099999999999998, 27.6, 588.8], "variance": 0.58, "baseline_E": '
    '[30.0, 27.0, 28.0, 589.0], "baseline_variance": 0.58}}')
OLD_CONFIG = BalancerConfig(settle=0, slow_window=3, min_dwell=0, seconds_per_pair=1e-3)


def test_a_state_saved_before_measurement_loads_and_decides_as_before():
    skew = torch.tensor([[10, 10, 10, 200], [10, 10, 10, 200]])
    machine = BalanceMachine(Placement.contiguous(4, 2, 3), OLD_CONFIG)
    machine.load_state_dict(OLD_MACHINE)
    assert machine.bandwidth == (12e9, False)  # nothing measured yet: the configured constant
    after = []
    for _ in range(4):
        negotiating = machine.negotiating
        d = machine.step((1, 2), skew if negotiating else None, (0, 0) if negotiating else None,
                         rank_load_R=(420, 60))
        assert d.bandwidth == 12e9 and not d.measured
        slots = [list(r) for r in d.placement.slot_expert_RS]
        after.append([d.state, d.migrated, round(d.predicted, 6), slots])
    assert after == OLD_AFTER
    assert machine.state_dict()["bandwidth_code"] == 0

    balancer = LayerBalancer(Placement.contiguous(4, 2, 3), OLD_CONFIG)
    balancer.load_state_dict(OLD_LAYER_BALANCER)
    assert balancer.meter.bandwidth is None and balancer.machine.bandwidth == (12e9, False)
    assert balancer.machine.state_dict() == {**OLD_LAYER_BALANCER["machine"], "bandwidth_code": 0}
    resaved = json.loads(json.dumps(balancer.state_dict()))
    assert resaved["meter"] == {"bytes_ema": None, "seconds_ema": None}


def test_the_agreed_bandwidth_is_saved_and_restored():
    machine = BalanceMachine(Placement.contiguous(4, 2), BalancerConfig())
    code = encode_bandwidth(5e9)
    d = machine.step((1, 2), torch.full((2, 4), 10), (encode_bandwidth(9e9), code))
    assert d.measured and d.bandwidth == decode_bandwidth(code) and machine.bandwidth[0] == d.bandwidth
    d = machine.step((1, 2), rank_load_R=(40, 40))  # Stable: the agreed value stays
    assert d.measured and d.bandwidth == decode_bandwidth(code)
    restored = BalanceMachine(Placement.contiguous(4, 2), BalancerConfig())
    restored.load_state_dict(json.loads(json.dumps(machine.state_dict())))
    assert restored.bandwidth == machine.bandwidth
    restored.step((1, 3), rank_load_R=(60, 20))  # an alarm: negotiate next
    d = restored.step((1, 3), torch.full((2, 4), 10), (0, 0))  # nobody measured: keep the last agreed
    assert d.measured and d.bandwidth == decode_bandwidth(code)
    with pytest.raises(ConfigError, match="bandwidth codes"):
        restored.load_state_dict({**machine.state_dict(), "bandwidth_code": 1 << 16})
    with pytest.raises(ConfigError, match="needs 2 bandwidth codes"):
        BalanceMachine(Placement.contiguous(4, 2)).step((1, 2), torch.full((2, 4), 10), (1, 2, 3))
