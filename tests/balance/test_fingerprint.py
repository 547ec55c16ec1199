"""Load fingerprints: bucketing, robustness to sampling noise, sensitivity, the rank-local probe."""

from __future__ import annotations

import time

import pytest
import torch
import xxhash

from thunderep import ConfigError
from thunderep.balance.fingerprint import (
    Baseline,
    LoadProbe,
    ema_update,
    ema_variance,
    fingerprint,
    load_profile,
)


def _zipf_counts(E: int, pairs: float, s: float = 1.0) -> torch.Tensor:
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    return p / p.sum() * pairs


def test_fingerprint_is_xxh3_of_the_int16_codes():
    c = torch.tensor([10, 0, 300, 45, 45, 7, 1000, 2])
    codes = load_profile(c)
    assert codes.dtype == torch.int16 and codes.shape == (8,)
    assert fingerprint(c) == xxhash.xxh3_64_intdigest(codes.numpy().tobytes())
    assert 0 <= fingerprint(c) < 2**64
    assert fingerprint(c, seed=3) != fingerprint(c)


def test_plain_code_is_floor_of_octaves_over_width():
    # E = 4, N = 4094: x = log2((c + 0.5) * 4 / 4096); a cold expert is clipped at -4 octaves
    c = torch.tensor([2047.5, 1023.5, 1022.5, 0.5])
    assert load_profile(c).tolist() == [2, 0, -1, -8]
    assert load_profile(c, width=1.0).tolist() == [1, 0, -1, -4]


def test_relative_to_itself_equals_plain_and_scale_does_not_matter():
    c = _zipf_counts(64, 8192).round()
    assert fingerprint(c, c) == fingerprint(c)
    base = Baseline.of(c, variance=0.2)
    assert fingerprint(c * 3, base, variance=0.2) == fingerprint(c)
    assert fingerprint(c.to(torch.int32), base, variance=0.2) == fingerprint(c)


@pytest.mark.parametrize("E", [8, 64])
def test_sampling_noise_keeps_the_baseline_fingerprint(E):
    gen = torch.Generator().manual_seed(E)
    expected = _zipf_counts(E, 8192, s=1.2)
    base = Baseline.of(expected, variance=0.0)  # the exact profile: only the current counts are noisy
    want = fingerprint(expected)
    flips = sum(fingerprint(torch.poisson(expected, generator=gen), base) != want for _ in range(300))
    assert flips <= 6, f"{flips} of 300 noisy samples changed the fingerprint"


def test_a_real_shift_changes_the_fingerprint():
    c = _zipf_counts(16, 8192).round()
    base = Baseline.of(c, variance=0.2)
    for e, factor in ((0, 1.5), (5, 2.0), (3, 0.5), (15, 4.0)):
        moved = c.clone()
        moved[e] *= factor
        assert fingerprint(moved, base, variance=0.2) != fingerprint(c), (e, factor)


def test_cold_experts_and_empty_steps():
    c = torch.tensor([4000.0, 4000.0, 0.0, 0.0])
    base = Baseline.of(c)
    warmer = torch.tensor([4000.0, 4000.0, 3.0, 0.0])  # still far under 1/16 of a uniform share
    assert fingerprint(warmer, base) == fingerprint(c)
    assert fingerprint(torch.zeros(4), base) == fingerprint(c)  # no pairs: no evidence of change


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match=r"1-D tensor"):
        fingerprint(torch.zeros(2, 3))
    with pytest.raises(ConfigError, match=r"has 3 experts but the baseline has 4"):
        fingerprint(torch.ones(3), torch.ones(4))
    with pytest.raises(ConfigError, match=r"width=0"):
        load_profile(torch.ones(4), width=0)
    with pytest.raises(ConfigError, match=r"alpha \(1.5\)"):
        ema_variance(1.5)
    with pytest.raises(ConfigError, match=r"num_experts"):
        LoadProbe(0)


def test_ema_and_its_variance():
    a = ema_update(None, torch.tensor([1.0, 2.0]), 0.5)
    assert a.tolist() == [1.0, 2.0]
    assert ema_update(a, torch.tensor([3.0, 0.0]), 0.5).tolist() == [2.0, 1.0]
    assert ema_variance(0.3) == pytest.approx(0.3 / 1.7)


def test_probe_record_is_pure_and_commit_sets_the_baseline():
    probe = LoadProbe(8, alpha=0.5)
    c = torch.tensor([100, 50, 50, 20, 20, 10, 5, 0])
    first = probe.record(c, negotiate=True)
    again = probe.record(c, negotiate=True)
    assert first.fingerprint == again.fingerprint and probe.ema_E is None and probe.baseline is None
    assert first.load_E.dtype == torch.int32 and first.load_E.tolist() == c.tolist()
    assert first.fingerprint == fingerprint(c)
    probe.commit(first)
    stable = probe.record(c, negotiate=False)
    assert stable.load_E is None and stable.fingerprint == first.fingerprint
    assert stable.variance == pytest.approx(0.25 * 1.0 + 0.25)  # (1 - a)^2 v + a^2
    probe.commit(stable)
    shifted = torch.tensor([10, 50, 50, 20, 20, 10, 5, 100])
    alarm = probe.record(shifted, negotiate=False)
    assert alarm.fingerprint != first.fingerprint
    probe.commit(alarm, reset=True)  # an alarm restarts the EMA from this step's counts
    assert probe.ema_E.tolist() == shifted.tolist() and probe.variance == 1.0
    negotiated = probe.record(shifted, negotiate=True)
    assert negotiated.load_E.tolist() == shifted.tolist()


def test_fingerprint_cost_per_call():
    torch.set_num_threads(1)
    for E in (64, 256):
        c = _zipf_counts(E, 8192)
        base = Baseline.of(c, variance=0.2)
        fingerprint(c, base)
        started = time.perf_counter()
        for _ in range(200):
            fingerprint(c, base, variance=0.2)
        per_call = (time.perf_counter() - started) / 200
        assert per_call < 2e-3, f"fingerprint takes {per_call * 1e6:.0f} us for E={E}"
