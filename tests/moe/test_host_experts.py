"""The host path of offloaded experts (`thunderep.moe.host_experts`) and its cost model (`moe.offload_cost`):
the lean host function against the plain-PyTorch experts reference (`expert_mlp`) in every gated layout it
covers, its float32 products for 16-bit weights, the per-slot fallback; its weighted sum in one TorchScript
call (`HostExperts.summed`, `thunderep.moe.host_summed`) bit-equal to the products one by one; the affine
calibration's invariants; the hot set's re-choosing rule (swaps that pay for their copy, none for near-equal
loads)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from thunderep.config import ExpertsConfig
from thunderep.errors import ConfigError
from thunderep.moe.experts import expert_mlp
from thunderep.moe.host_experts import NEVER, GatedLayout, HostExperts, calibrate_upcast, per_slot, time_host_fn
from thunderep.moe.host_summed import summed_fn
from thunderep.moe.offload_cost import (OffloadCosts, calibrate_host, calibrate_stream, decode_paths, fit_affine,
                                       predicted_rates, split_cold)
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig, TierStats

S, D, I = 6, 16, 8


def _experts(bias: bool, dtype=torch.float32, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    host = {"gate_up_proj": torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5,
            "down_proj": torch.randn(S, D, I, generator=gen) * I ** -0.5}
    if bias:
        host |= {"gate_up_proj_bias": torch.randn(S, 2 * I, generator=gen), "down_proj_bias": torch.randn(S, D, generator=gen)}
    return {n: t.to(dtype) for n, t in host.items()}


def _reference(host: dict, slots, x_MD, counts, config: ExpertsConfig) -> torch.Tensor:
    """expert_mlp over every slot, the slots not asked for given no rows, in the order asked."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    pieces = x_MD.split(counts)
    counts_S = torch.zeros(S, dtype=torch.int64)
    for i in order:
        counts_S[slots[i]] = counts[i]
    y = expert_mlp(torch.cat([pieces[i] for i in order]), counts_S, host["gate_up_proj"], host["down_proj"], config,
                   host.get("gate_up_proj_bias"), host.get("down_proj_bias"))
    ys = dict(zip(order, y.split([counts[i] for i in order])))
    return torch.cat([ys[i] for i in range(len(slots))])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_lean_host_function_equals_the_experts_reference(interleaved, bias, activation):
    host = _experts(bias)
    config = ExpertsConfig(num_experts=S, hidden_size=D, intermediate_size=I, activation=activation, bias=bias,
                           interleaved=interleaved, backend="loop")
    layout = GatedLayout(gate_up_bias="gate_up_proj_bias" if bias else None,
                         down_bias="down_proj_bias" if bias else None, interleaved=interleaved)
    lean = HostExperts(F.silu if activation == "silu" else F.gelu, layout)
    slots, counts = [4, 1, 3], [2, 1, 5]  # any order: the outputs follow the rows' groups
    x_MD = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1))
    want = _reference(host, slots, x_MD, counts, config)
    torch.testing.assert_close(lean(host, slots, x_MD, counts), want, rtol=1e-6, atol=1e-6)
    out = torch.empty(sum(counts), D, dtype=torch.float64)  # the tiers' pinned buffer: filled, cast
    assert lean(host, slots, x_MD, counts, out=out) is out
    torch.testing.assert_close(out, want.double(), rtol=1e-6, atol=1e-6)


def test_per_slot_fallback_equals_the_lean_function():
    host = _experts(False)
    config = ExpertsConfig(num_experts=S, hidden_size=D, intermediate_size=I, backend="loop")

    def compute(weights, x_nD, slot_n):  # an experts function on a one-slot view, as the class path runs
        assert next(iter(weights.values())).shape[0] == 1 and not slot_n.any()
        return expert_mlp(x_nD, torch.tensor([x_nD.shape[0]]), weights["gate_up_proj"], weights["down_proj"], config)

    slots, counts = [0, 5], [3, 2]
    x_MD = torch.randn(5, D)
    assert torch.equal(per_slot(compute)(host, slots, x_MD, counts), HostExperts(F.silu)(host, slots, x_MD, counts))


def test_16_bit_weights_upcast_from_the_set_row_count():
    host16, host32 = _experts(False, torch.bfloat16), None
    host32 = {n: t.float() for n, t in host16.items()}
    x_MD = torch.randn(7, D).to(torch.bfloat16)
    slots, counts = [2, 3], [1, 6]
    exact = HostExperts(F.silu)(host32, slots, x_MD.float(), counts)
    lean = HostExperts(F.silu, upcast_rows=4)  # slot 2 (1 row) in bfloat16, slot 3 (6 rows) in float32
    y = lean(host16, slots, x_MD, counts)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[1:], exact[1:].to(torch.bfloat16))
    assert torch.equal(y[:1], HostExperts(F.silu)(host16, [2], x_MD[:1], [1]))
    assert calibrate_upcast(HostExperts(F.silu), host32, rows=(1, 2)) == NEVER  # float32 weights never convert
    assert [HostExperts(F.silu, upcast_rows=n).line_rows() for n in (NEVER, 1, 2, 3, 8, 33)] == [32, 32, 32, 2, 7, 32]
    assert calibrate_upcast(lean, host16, rows=(1, 64)) in (1, 64, NEVER) and lean.upcast_rows in (1, 64, NEVER)


def test_affine_fit_invariants():
    assert fit_affine(1, 3e-3, 33, 7e-3) == pytest.approx((2.875e-3, 1.25e-4))  # exact on a line
    call_s, row_s = fit_affine(1, 5e-3, 32, 4e-3)  # noise: a falling line is no line
    assert (call_s, row_s) == (5e-3, 0.0)
    call_s, row_s = fit_affine(4, 1e-3, 8, 9e-3)  # a negative intercept clips to zero
    assert call_s == 0.0 and row_s == pytest.approx(2e-3)
    for a, b in ((1e-3, 1e-2), (2e-3, 2e-3), (1e-2, 1e-3)):
        call_s, row_s = fit_affine(1, a, 32, b)
        assert call_s >= 0 and row_s >= 0 and call_s + row_s <= max(a, b) + 1e-12


def test_calibration_measures_a_host_function_as_an_affine_cost():
    """A host function taking 2 ms per expert and 0.25 ms per row calibrates to about that; the costs then
    rise with the rows, and the host path wins at 1 row and loses where streaming is cheaper."""
    host = _experts(False)

    def sleepy(host, slots, x_MD, counts, out=None):
        for n in counts:
            time.sleep(2e-3 + n * 0.25e-3)
        return x_MD

    base = OffloadCosts(host_flops=1e9, device_flops=1e12, h2d_Bps=1e9)
    costs = calibrate_host(base, sleepy, host, D, torch.float32, rows=(1, 16))
    assert costs.calibrated and not base.calibrated
    assert 1.5e-3 <= costs.host_call_s <= 4e-3 and 0.15e-3 <= costs.host_row_s <= 0.5e-3, costs
    assert 0 < time_host_fn(sleepy, host, 1, D, torch.float32, slots=2, repeats=1) < 0.05
    P, B, row = 3 * D * I, 3 * D * I * 4, D * 4
    seconds = [costs.host_seconds(n, P, row) for n in (1, 2, 8, 64)]
    assert seconds == sorted(seconds) and seconds[0] == pytest.approx(costs.host_call_s + costs.host_row_s + 2 * row / 1e9)
    cheap_copy = replace(costs, h2d_Bps=1e12)  # 1.5 KB of weights in nanoseconds: streaming wins at once
    assert costs.cold_path(1, P, row, 10**7) == "host" and cheap_copy.cold_path(1, P, row, B) == "stream"
    assert costs.cold_seconds(0.25, P, row, B, "host") == pytest.approx(0.25 * costs.host_seconds(1, P, row))


def test_calibration_floors_the_host_cost_at_many_rows():
    """A host function whose rows cost 0.25 ms each up to 32 and 2 ms each past it (a CPU whose products,
    not its weight reads, bound a prefill's rows): the affine fit at 1 and 16 rows alone would price 256 rows
    at about 66 ms; past 16 rows the line through the bulk timing puts them at about 512 ms, and up to 16
    rows the cost stays the first line's."""
    host = _experts(False)

    def knee(host, slots, x_MD, counts, out=None):
        for n in counts:
            time.sleep(2e-3 + n * 0.25e-3 if n <= 32 else n * 2e-3)
        return x_MD

    base = OffloadCosts(host_flops=1e9, device_flops=1e12, h2d_Bps=1e12)
    costs = calibrate_host(base, knee, host, D, torch.float32, rows=(1, 16), bulk=256)
    assert 1.9e-3 <= costs.host_bulk_row_s <= 3e-3, costs
    P, row = 3 * D * I, D * 4
    assert costs.host_seconds(256, P, row) >= 0.45 and "past 16 rows" in costs.host_text
    affine = replace(costs, host_bulk_row_s=None)
    assert affine.host_seconds(256, P, row) < 0.15
    assert costs.host_seconds(1, P, row) == affine.host_seconds(1, P, row)
    assert costs.host_seconds(16, P, row) == affine.host_seconds(16, P, row) and costs.host_bulk_from == 16
    assert calibrate_host(base, knee, host, D, torch.float32, rows=(1, 16), bulk=0).host_bulk_row_s is None


def _decode_by_enumeration(E, S, H, K, host, bus, mapped_slots, handoff):
    """Slow reference of the decode prediction's cold seconds: every K-subset of the E experts (slots 0..S-1
    local, 0..H-1 hot, the last `mapped_slots` cold ones mapped) equally likely; the unmapped cold ones on the
    host (handed off) or split as `split_cold` splits them; host and device at once."""
    import itertools
    subsets = list(itertools.combinations(range(E), K))
    mapped = set(range(S - mapped_slots, S))
    total = 0.0
    for picks in subsets:
        cold = [e for e in picks if H <= e < S]
        m = sum(1 for e in cold if e in mapped)
        h = len(cold) - m
        on_host = h if handoff else split_cold([host] * h, [bus] * h, True).count("host")
        total += max(on_host * host, (m + h - on_host) * bus)
    return total / len(subsets)


@pytest.mark.parametrize("E,S,H,K", [(8, 8, 2, 2), (16, 8, 1, 4), (12, 12, 0, 3)])
@pytest.mark.parametrize("handoff,q", [(True, 0.0), (True, 0.45), (False, 0.0), (False, 0.5)])
def test_decode_prediction_equals_the_enumerated_expectation(E, S, H, K, handoff, q):
    """One token's cold seconds over the hypergeometric counts of cold and mapped slots hit equal the average
    over every set of K experts the token can pick (a rank holding S of E, H hot): handed off, the unmapped
    cold slots all on the host; in line, split as a call splits them; mapped ones on the device."""
    P, B, row = 1000, 4000, 64
    costs = OffloadCosts(host_flops=1e9, device_flops=1e30, h2d_Bps=1e30, host_call_s=2e-3, host_row_s=0.0,
                         stream_call_s=3e-3)
    host, bus = costs.host_seconds(1, P, row), costs.stream_seconds(1, P, B)
    expected = _decode_by_enumeration(E, S, H, K, host, bus, round(q * (S - H)), handoff)
    rate = predicted_rates(costs, [(E, S, H, P, B)], K, row, prefill_tokens=64, overlap=True, handoff=handoff,
                           mapped_share=q)["decode"]
    assert 1.0 / rate == pytest.approx(expected, rel=1e-9)


def test_a_handed_off_decode_runs_every_unmapped_cold_slot_on_the_host():
    """Handed off without mapping, the expected cold seconds are the expected cold slots hit times the host's
    seconds, however fast the stream (the job takes them all); in line the same call splits them."""
    P, B, row = 1000, 4000, 64
    costs = OffloadCosts(host_flops=1e9, device_flops=1e30, h2d_Bps=1e30, host_call_s=5e-3, host_row_s=0.0,
                         stream_call_s=5e-3)
    layers = [(8, 8, 2, P, B)]  # 6 cold of 8, top 2: 1.5 cold slots hit on average
    handed = predicted_rates(costs, layers, 2, row, 64, overlap=True, handoff=True)["decode"]
    assert 1.0 / handed == pytest.approx(1.5 * 5e-3, rel=1e-9)
    in_line = predicted_rates(costs, layers, 2, row, 64, overlap=True)["decode"]
    assert in_line > handed


def test_decode_paths_follow_the_tiers_rules():
    """Handed off where host_thread is "on", or "auto" with the host at most HANDOFF_SLOWER times the stream
    at one row (or the host path forced); never on a CPU or with the stream forced. The mapped share is
    host / (host + bus) on CUDA with mapping on, 1 forced, 0 otherwise."""
    P, B, row = 1000, 4000, 64
    costs = OffloadCosts(host_flops=1e9, device_flops=1e30, h2d_Bps=1e30, host_call_s=2e-3, host_row_s=0.0,
                         stream_call_s=3e-3)
    host, bus = costs.host_seconds(1, P, row), costs.stream_seconds(1, P, B)
    assert decode_paths(costs, P, row, B, True) == (True, pytest.approx(host / (host + bus)))
    assert decode_paths(costs, P, row, B, True, mapped=False) == (True, 0.0)
    assert decode_paths(costs, P, row, B, False) == (False, 0.0)
    assert decode_paths(costs, P, row, B, True, host_thread="off") == (False, pytest.approx(host / (host + bus)))
    assert decode_paths(costs, P, row, B, True, cold_path="stream") == (False, 0.0)
    assert decode_paths(costs, P, row, B, True, cold_path="mapped")[1] == 1.0
    slow = replace(costs, host_call_s=100 * 3e-3)
    assert not decode_paths(slow, P, row, B, True)[0] and decode_paths(slow, P, row, B, True, host_thread="on")[0]
    assert decode_paths(slow, P, row, B, True, cold_path="host") == (True, 0.0)


def test_predicted_rates_split_cold_slots_as_a_call_does():
    """Uniform routing, one layer of 8 slots, none hot: at decode (1 token, top 2 of 8: a quarter of the
    slots, 1 row each) and prefill. Host and stream at the same seconds a slot: without overlap the cold
    seconds add up; with it they split in half and the rate doubles. Where the stream is far slower nothing
    streams, so overlap changes nothing."""
    P, B, row = 1000, 4000, 64
    even = OffloadCosts(host_flops=1e9, device_flops=1e30, h2d_Bps=1e30, host_call_s=1e-3, host_row_s=0.0,
                        stream_call_s=1e-3)
    layers = [(8, 8, 0, P, B)]
    alone = predicted_rates(even, layers, 2, row, prefill_tokens=64)
    both = predicted_rates(even, layers, 2, row, prefill_tokens=64, overlap=True)
    assert alone["decode"] == pytest.approx(1 / (2 * 1e-3), rel=1e-6)  # 2 slots of 1 ms each, one after another
    assert both["decode"] == pytest.approx(2 * alone["decode"], rel=1e-6)
    assert alone["prefill"] == pytest.approx(64 / (8 * 1e-3), rel=1e-3) and both["prefill"] == pytest.approx(
        2 * alone["prefill"], rel=1e-3)
    slow_stream = replace(even, stream_call_s=1.0)
    assert predicted_rates(slow_stream, layers, 2, row, 64, overlap=True) == predicted_rates(slow_stream, layers, 2,
                                                                                            row, 64)


def test_cold_split_overlaps_host_and_stream_on_cuda():
    """Each slot on its cheaper path where nothing overlaps; with overlap the split that ends first, never
    later than the per-slot choice (itself one of the splits tried)."""
    assert split_cold([1, 3], [2, 2], overlap=False) == ["host", "stream"]
    assert split_cold([1.0] * 4, [1.2] * 4, overlap=True).count("host") == 2  # max(2, 2.4) beats max(4, 0)
    assert split_cold([1.0] * 3, [1e9] * 3, overlap=True) == ["host"] * 3
    assert split_cold([1e9] * 3, [1.0] * 3, overlap=True) == ["stream"] * 3
    assert split_cold([], [], overlap=True) == []
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        host_s, stream_s = (torch.rand(6, generator=gen).add(0.01).tolist() for _ in range(2))

        def length(paths):
            return max(sum(h for h, p in zip(host_s, paths) if p == "host"),
                       sum(t for t, p in zip(stream_s, paths) if p == "stream"))

        assert length(split_cold(host_s, stream_s, True)) <= length(split_cold(host_s, stream_s, False)) + 1e-12


def _tiers(costs: OffloadCosts, hot: int, **config) -> ExpertTiers:
    host = _experts(False)

    def compute(weights, x_MD, slot_M):
        return torch.cat([HostExperts(F.silu).slot(weights, int(s), x[None]) for s, x in zip(slot_M, x_MD)])

    return ExpertTiers(host, hot, torch.device("cpu"), compute, costs, Staging(host, torch.device("cpu")),
                       TierConfig(**config))


def test_stream_calibration_prices_the_experts_call_each_streamed_slot_makes():
    """An experts function taking 3 ms a call: the stream path's measured seconds per slot include it (the
    copy alone is microseconds here), `calibrate_stream` carries them into stream_seconds, and a one-row cold
    slot then goes to a 1 ms host path, which the copy-only estimate would have streamed; timing leaves the
    telemetry as it was."""
    host = _experts(False)

    def slow(weights, x_MD, slot_M):
        time.sleep(3e-3)
        return x_MD.clone()

    costs = OffloadCosts(host_flops=1e9, device_flops=1e12, h2d_Bps=1e12, host_call_s=1e-3, host_row_s=1e-5)
    tiers = ExpertTiers(host, 1, torch.device("cpu"), slow, costs, Staging(host, torch.device("cpu")),
                        TierConfig())
    P, B, row = tiers.slot_params, tiers.slot_bytes, D * 4
    assert costs.cold_path(1, P, row, B) == "stream"  # 1.5 KB at 1 TB/s: the copy-only estimate streams
    per_slot = tiers.time_stream(D, torch.float32, slots=2, repeats=2)
    assert 3e-3 <= per_slot < 0.1 and tiers.stats == TierStats()
    timed = calibrate_stream(costs, lambda: per_slot)
    assert timed.stream_call_s == per_slot and timed.stream_seconds(1, P, B) == per_slot
    assert timed.stream_seconds(9, P, B) == pytest.approx(per_slot + 8 * 2 * P / 1e12)
    assert timed.cold_path(1, P, row, B) == "host" and "ms per expert at one row" in timed.stream_text


def _call(tiers: ExpertTiers, counts: list[int]) -> torch.Tensor:
    x_MD = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(sum(counts)))
    return tiers.sorted(x_MD, torch.tensor(counts))


def test_rechoosing_needs_the_gain_to_pay_for_the_copy():
    """Host expert 1 ms + 0.1 ms a row, a slot's copy 0.1 ms: a slot with rows in every call replaces one
    with none (gain 1.1 ms a call over 6 calls >> 2 x 0.1 ms, and 6 calls of rows are more than counting
    noise); near-equal loads move nothing; the margin
    scales the bar. Outputs as the host function's throughout."""
    costs = OffloadCosts(host_flops=1e9, device_flops=1e15, h2d_Bps=3 * D * I * 4 / 1e-4, host_call_s=1e-3,
                         host_row_s=1e-4)
    tiers = _tiers(costs, 2, cold_path="host", calibration_calls=1, interval=6, ema=0.8)
    lean = HostExperts(F.silu)
    for call in range(12):  # the first choice (after 1 call) keeps slots 0 and 1; then 4 and 5 are the busy ones
        counts = [1, 1, 0, 0, 0, 0] if call == 0 else [0, 0, 0, 0, 2, 1]
        y = _call(tiers, counts)
        x_MD = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(sum(counts)))
        used = [s for s in range(S) if counts[s]]
        assert torch.allclose(y, lean(tiers.host, used, x_MD, [counts[s] for s in used]), atol=1e-6)
    assert set(tiers.hot_slots) == {4, 5} and tiers.stats.hot_changes == 1  # both swaps in one re-choice
    assert tiers.stats.bytes_promoted == 2 * tiers.slot_bytes
    even = _tiers(costs, 2, cold_path="host", calibration_calls=1, interval=6, ema=0.8)
    for call in range(40):  # every slot busy in turn: the loads differ by noise alone
        _call(even, [1 if (s + call) % 3 else 2 for s in range(S)])
    assert even.stats.hot_changes <= 1  # the first choice only
    strict = _tiers(costs, 2, cold_path="host", calibration_calls=1, interval=6, ema=0.8, margin=1e6)
    for call in range(12):
        _call(strict, [1, 1, 0, 0, 0, 0] if call == 0 else [0, 0, 0, 0, 2, 1])
    assert set(strict.hot_slots) == {0, 1}  # no swap pays a million times over


def test_rechoosing_at_decode_moves_little_on_noise_and_still_finds_busy_slots(monkeypatch):
    """One row per layer call: under uniform routing a slot's recent row is noise, and without the counting
    test (confidence 0) the rule moves hundreds of slots for nothing; with it, several times fewer. Under
    skewed routing (Zipf 0.8) the hot set it keeps serves more rows than uniform's 25% and no fewer than
    without the test."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from rechoice_noise import moves  # the decode simulation the benchmark record prints
    E = 128
    uniform = torch.ones(E)
    zipf = (1.0 / torch.arange(1, E + 1).float() ** 0.8)[torch.randperm(E, generator=torch.Generator().manual_seed(1))]
    noisy, _ = moves(0.0, uniform)
    calm, share = moves(2.0, uniform)
    assert noisy >= 200 and calm * 4 <= noisy and 0.2 <= share <= 0.3, (noisy, calm, share)
    moved_noisy, share_noisy = moves(0.0, zipf)
    moved, share = moves(2.0, zipf)
    assert share >= 0.5 and share >= share_noisy - 0.01 and moved * 4 <= moved_noisy, (share, share_noisy, moved)


def test_tier_config_refusals():
    for bad in ({"margin": -1.0}, {"interval": 0}, {"ema": 1.0}, {"cold_path": "disk"}, {"confidence": -1.0}):
        with pytest.raises(ConfigError):
            TierConfig(**bad)


def test_the_planner_calibrates_on_random_experts_of_the_shape_or_leaves_the_costs():
    """`calibrate_gated`: the host path timed on random gated experts of D x I (params 3 D I) where two or
    more fit the budget; the GEMM-rate costs as they were where the shape is not gated or nothing fits."""
    import torch

    from thunderep.moe.offload_cost import OffloadCosts, calibrate_gated

    costs = OffloadCosts(host_flops=1e9, device_flops=1e12, h2d_Bps=1e10)
    D, I = 64, 32
    params = 3 * D * I
    timed = calibrate_gated(costs, D, params, torch.float32, budget_bytes=10**8)
    assert timed.calibrated and timed.host_call_s >= 0 and timed.host_row_s >= 0
    assert timed.host_flops == costs.host_flops and timed.device_flops == costs.device_flops
    assert calibrate_gated(costs, D, params + 1, torch.float32, 10**8) is costs  # not 3 D I
    assert calibrate_gated(costs, D, params, torch.float32, budget_bytes=params * 4) is costs  # fewer than 2 fit


HOST = OffloadCosts(host_flops=1e12, device_flops=1.0, h2d_Bps=1e15)  # cold rows on the host
STREAM = OffloadCosts(host_flops=1.0, device_flops=1e12, h2d_Bps=1e15)  # cold slots streamed


@pytest.mark.parametrize("few_pairs", [8, 0], ids=["apart", "one-launch"])
@pytest.mark.parametrize("costs", [HOST, STREAM], ids=["host", "stream"])
@pytest.mark.parametrize("hot_path", ["lean", "compute", "pairs"])
def test_partial_equals_the_weighted_sum_over_the_pairs_this_rank_holds(costs, hot_path, few_pairs, monkeypatch):
    """`ExpertTiers.partial` (a decode step from token rows): float32 [T, D] = sum over k of w_tk * expert(x_t)
    for the pairs whose local slot is >= 0 (-1: another rank's), against a float64 reference; slots with
    rows of several tokens, hot and cold; the hot pairs through each way (two products apart, one experts
    call, the pair kernels' stand-in, which gets each pair's hot entry or -1), the device's outputs added
    one by one or in one launch; rows counted per path and per slot; None where the call is too big or
    needs gradients."""
    host = _experts(False, seed=3)
    lean = HostExperts(F.silu)
    calls = []

    def pairs(weights, x_TD, entry_TK, weights_TK):  # the pair kernels: hot entries only, weighted and summed
        calls.append(entry_TK.clone())
        y = torch.zeros(x_TD.shape, dtype=torch.float64)
        for (t, k), e in zip(torch.cartesian_prod(torch.arange(x_TD.shape[0]), torch.arange(entry_TK.shape[1])),
                             entry_TK.reshape(-1).tolist()):
            if e >= 0:
                y[t] += weights_TK[t, k] * lean.slot(weights, e, x_TD[t:t + 1])[0].double()
        return y.to(x_TD.dtype)

    def compute(weights, x_MD, slot_M):
        return torch.cat([lean.slot(weights, int(s), x[None]) for s, x in zip(slot_M, x_MD)])

    tiers = ExpertTiers(host, 2, torch.device("cpu"), compute, costs, Staging(host, torch.device("cpu")),
                        TierConfig(calibration_calls=100), host_fn=lean, lean_hot=hot_path == "lean",
                        pairs=pairs if hot_path == "pairs" else None)
    if hot_path == "compute":
        monkeypatch.setattr(ExpertTiers, "LEAN_HOT_SLOTS", 0)
    monkeypatch.setattr(ExpertTiers, "FEW_PAIRS", few_pairs)
    tiers.set_hot([4, 1], count=False)
    gen = torch.Generator().manual_seed(5)
    local_TK = torch.tensor([[4, 0, -1], [0, 2, 4], [-1, 5, 1], [3, -1, -1]])  # hot 4 and 1; 0 and 4 twice
    x_TD, w_TK = torch.randn(4, D, generator=gen), torch.rand(4, 3, generator=gen)
    want = torch.zeros(4, D, dtype=torch.float64)
    for t, k in torch.cartesian_prod(torch.arange(4), torch.arange(3)).tolist():
        s = int(local_TK[t, k])
        if s >= 0:
            want[t] += w_TK[t, k].double() * lean.slot({n: v.double() for n, v in host.items()}, s, x_TD[t:t + 1].double())[0]
    got = tiers.partial(x_TD, local_TK, w_TK)
    assert got.dtype == torch.float32 and got.shape == (4, D)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if hot_path == "pairs":
        assert torch.equal(calls[0], torch.tensor([[0, -1, -1], [-1, -1, 0], [-1, -1, 1], [-1, -1, -1]]))
    s = tiers.stats
    assert (s.rows_hot, s.rows_host + s.rows_streamed) == (3, 5)
    assert (s.rows_host if costs is HOST else s.rows_streamed) == 5
    assert tiers.rows_S.tolist() == [2, 1, 1, 1, 2, 1]
    assert tiers.partial(torch.randn(43, D), torch.zeros(43, 3, dtype=torch.int64), torch.rand(43, 3)) is None
    assert tiers.partial(x_TD.requires_grad_(), local_TK, w_TK) is None


@pytest.mark.parametrize("ema", [0.0, 0.5, 0.9])
def test_the_counts_and_their_ema_equal_the_per_call_formula(ema):
    """`_observe` keeps the rows per slot and their EMA as lists and a scale, updating only the slots a call
    has rows on: over 3000 calls (the scale folded back many times at ema 0.5; every call at ema 0) the
    totals equal the plain sums, and the EMA the per-call formula ema x past + (1 - ema) x rows, whichever
    form the counts come in (a tensor, a list, {slot: rows})."""
    costs = OffloadCosts(host_flops=1e9, device_flops=1e15, h2d_Bps=1e9, host_call_s=1e-3, host_row_s=1e-4)
    tiers = _tiers(costs, 2, cold_path="host", ema=ema)
    gen = torch.Generator().manual_seed(3)
    want_rows, want_ema = torch.zeros(S, dtype=torch.int64), torch.zeros(S, dtype=torch.float64)
    for call in range(3000):
        counts = torch.randint(0, 3, (S,), generator=gen) * (torch.rand(S, generator=gen) < 0.3)
        form = call % 3
        tiers._observe(counts if form == 0 else counts.tolist() if form == 1 else
                       {s: int(n) for s, n in enumerate(counts.tolist()) if n})
        want_rows += counts
        want_ema = want_ema * ema + counts.double() * (1 - ema)
    assert tiers.calls == 3000 and torch.equal(tiers.rows_S, want_rows)
    torch.testing.assert_close(tiers.ema_S, want_ema, rtol=1e-12, atol=1e-12)


def _one_by_one(lean: HostExperts, host: dict, slots, counts, tokens, weights, x_TD) -> torch.Tensor:
    """The Python path of `ExpertTiers._summed_on_host`: the host function's products, then the weighted sum."""
    w_M = torch.tensor(weights, dtype=torch.float32)
    out = torch.zeros(x_TD.shape, dtype=torch.float32)
    if x_TD.shape[0] == 1:
        return out.addmm_(w_M[None], lean(host, slots, x_TD.expand(len(tokens), -1), counts).float())
    token_M = torch.tensor(tokens)
    return out.index_add_(0, token_M, lean(host, slots, x_TD[token_M], counts).float() * w_M[:, None])


def _summed_call(T: int, seed: int = 2):
    """A call's cold slots, rows per slot, and each row's token and weight, in slot order."""
    gen = torch.Generator().manual_seed(seed)
    slots = [4, 1, 3] if T > 1 else [0, 2, 5]
    counts = [1, 1, 1] if T == 1 else [3, 1, 4]
    tokens = [0] * sum(counts) if T == 1 else torch.randint(0, T, (sum(counts),), generator=gen).tolist()
    weights = torch.rand(sum(counts), generator=gen).tolist()
    return slots, counts, tokens, weights


@pytest.mark.skipif(summed_fn() is None, reason="this torch cannot script the function")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("layout", ["plain", "interleaved+bias"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_the_scripted_sum_equals_the_products_one_by_one_bit_for_bit(dtype, T, layout, act):
    bias, interleaved = layout != "plain", layout != "plain"
    host = _experts(bias, dtype)
    act_fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}[act]
    lay = GatedLayout(gate_up_bias="gate_up_proj_bias" if bias else None,
                      down_bias="down_proj_bias" if bias else None, interleaved=interleaved)
    slots, counts, tokens, weights = _summed_call(T)
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    for upcast_rows in (NEVER, 2):  # never in float32; from 2 rows on (the 16-bit slots of 3 and 4 rows upcast)
        lean = HostExperts(act_fn, lay, upcast_rows=upcast_rows)
        assert lean.act == act
        out = torch.full((T, D), float("nan"))  # set, not added to
        assert lean.summed(host, slots, counts, tokens, weights, x_TD, out) is out
        torch.testing.assert_close(out, _one_by_one(lean, host, slots, counts, tokens, weights, x_TD), rtol=0, atol=0)


def test_an_activation_without_a_name_leaves_the_python_path():
    lean = HostExperts(lambda x: x * torch.sigmoid(1.702 * x))  # gpt-oss-like: no scripted counterpart
    assert lean.act is None
    host, x_TD = _experts(False), torch.randn(1, D)
    out = torch.zeros(1, D)
    assert lean.summed(host, [0], [1], [0], [1.0], x_TD, out) is None
    assert not out.any()  # nothing done
