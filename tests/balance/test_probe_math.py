"""The probe's native loops against its numpy / torch reference: bit-identical EMAs, codes, fingerprints
and balancer decisions, on random inputs and on inputs sitting on the codes' edges."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from thunderep import ConfigError
from thunderep.balance import probe_math
from thunderep.balance.balancer_config import BalancerConfig
from thunderep.balance.fingerprint import Baseline, LoadProbe
from thunderep.balance.machine import BalanceMachine, decode_records, encode_record
from thunderep.balance.placement import Placement
from thunderep.balance.probe_math import ProbeMath, native_available

needs_native = pytest.mark.skipif(not native_available(), reason="the probe extension is unavailable")


def _skewed(E: int, gen: torch.Generator) -> torch.Tensor:
    p_E = torch.rand(E, generator=gen, dtype=torch.float64) ** 4
    return p_E / p_E.sum()


def _both(c_E, width=0.5, seed=0, baseline=None, variance=1.0):
    """(native fingerprint, codes, reference fingerprint, codes, native calls handed to the reference)."""
    native, ref = ProbeMath(c_E.numel(), native=True), ProbeMath(c_E.numel(), native=False)
    fp_n = native.fingerprint(c_E, width, seed, baseline, variance)
    fp_r = ref.fingerprint(c_E, width, seed, baseline, variance)
    return fp_n, native.codes_E, fp_r, ref.codes_E, native.reference


@needs_native
def test_native_fingerprints_equal_the_reference_on_random_profiles():
    gen = torch.Generator().manual_seed(1)
    handed = cases = 0
    for _ in range(400):
        E = int(torch.randint(1, 400, (1,), generator=gen))
        pairs = float(torch.randint(1, 100_000, (1,), generator=gen))
        c_E = torch.poisson(_skewed(E, gen) * pairs, generator=gen)
        base = Baseline.of(torch.poisson(_skewed(E, gen) * pairs, generator=gen),
                           variance=float(torch.rand(1, generator=gen)),
                           width=[0.25, 0.5, 1.0][int(torch.randint(0, 3, (1,), generator=gen))],
                           z=[0.0, 2.0, 4.5][int(torch.randint(0, 3, (1,), generator=gen))])
        ema_E = c_E * 0.7 + torch.poisson(_skewed(E, gen) * pairs, generator=gen) * 0.3  # non-integer counts
        for counts, baseline in ((c_E, None), (ema_E, None), (c_E, base), (ema_E, base)):
            fp_n, codes_n, fp_r, codes_r, n_ref = _both(counts, 0.5, 7, baseline, 0.18)
            assert fp_n == fp_r and torch.equal(codes_n, codes_r)
            handed += n_ref
            cases += 1
    assert handed <= cases // 50, f"the native loops handed {handed} of {cases} calls to the reference"


@needs_native
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference on NaN
@pytest.mark.parametrize("case", ["uniform", "equal to baseline", "zeros", "z = 0", "huge", "negative",
                                  "NaN", "tiny width", "on an edge"])
def test_native_equals_the_reference_on_edges_and_degenerate_inputs(case):
    E = 64
    c_E = torch.poisson(torch.full((E,), 50.0, dtype=torch.float64), generator=torch.Generator().manual_seed(2))
    base, width = Baseline.of(c_E, variance=0.18), 0.5
    if case == "uniform":          # every octave exactly 0, on a bucket edge
        c_E = torch.full((E,), 100.0, dtype=torch.float64)
    elif case == "equal to baseline":
        c_E = base.counts_E.clone()
    elif case == "zeros":
        c_E = torch.zeros(E, dtype=torch.float64)
    elif case == "z = 0":          # a noise of 0: |0| > 0 sits on the significance edge
        base = Baseline.of(c_E, variance=0.18, z=0.0)
    elif case == "huge":           # a total the native loops leave to the reference
        c_E = c_E * 1e299
    elif case == "negative":
        c_E = c_E - 60.0
    elif case == "NaN":
        c_E[3] = float("nan")
    elif case == "tiny width":     # codes outside int16
        width = 1e-6
        base = Baseline.of(c_E, variance=0.18, width=width)
    elif case == "on an edge":     # octaves exactly on multiples of W: 2^k shares
        c_E = torch.tensor([2047.5, 1023.5, 1022.5, 0.5] * 16, dtype=torch.float64)
    for baseline in (None, base):
        fp_n, codes_n, fp_r, codes_r, _ = _both(c_E.contiguous(), width, 0, baseline, 0.3)
        assert fp_n == fp_r and torch.equal(codes_n, codes_r)


@needs_native
def test_native_ema_and_load_are_bit_identical_for_int64_and_float64_counts():
    gen = torch.Generator().manual_seed(3)
    native, ref = ProbeMath(256, native=True), ProbeMath(256, native=False)
    prev_E = torch.poisson(torch.full((256,), 30.0, dtype=torch.float64), generator=gen) * 0.37
    for counts in (torch.randint(0, 2**40, (256,), generator=gen), torch.rand(256, generator=gen) * 1e6,
                   torch.randint(0, 100, (256,), generator=gen, dtype=torch.int32)):
        for prev in (None, prev_E):
            (c_n, e_n), (c_r, e_r) = native.ema(counts, prev, 0.3), ref.ema(counts, prev, 0.3)
            assert torch.equal(c_n, c_r) and torch.equal(e_n, e_r)
            assert e_n.dtype == torch.float64 and e_n.is_contiguous()
            for ema_E in (e_n, e_n + 0.5, e_n * 1e6):  # halves round to even; loads clamp at 2^31 - 1
                (l_n, f_n), (l_r, f_r) = native.load(ema_E), ref.load(ema_E)
                assert torch.equal(l_n, l_r) and torch.equal(f_n, f_r) and l_n.dtype == torch.int32
    assert native.reference == 0


@needs_native
def test_native_and_reference_probes_make_the_same_decisions():
    """Two balancers, one per implementation, over a drifting skewed trace: same records, same decisions."""
    E, R = 64, 4
    gen = torch.Generator().manual_seed(4)
    cfg = BalancerConfig()
    runs = []
    for native in (True, False):
        machine = BalanceMachine(Placement.contiguous(E, R, E // R + 1), cfg)
        probes = [LoadProbe(E, alpha=cfg.ema_alpha, width=cfg.fingerprint_width, z=cfg.fingerprint_z,
                            native=native) for _ in range(R)]
        runs.append((machine, probes, []))
    p_E = _skewed(E, gen)
    for t in range(150):
        if t % 40 == 39:
            p_E = _skewed(E, gen)
        counts_RE = torch.poisson((p_E * 8192).expand(R, E), generator=gen).to(torch.int64)
        for machine, probes, log in runs:
            records = [probe.record(counts_RE[r], machine.negotiating) for r, probe in enumerate(probes)]
            rows_RW = torch.stack([encode_record(rec) for rec in records])
            d = machine.step(*decode_records(rows_RW, E), machine.trade.rank_loads(counts_RE))
            for probe, rec in zip(probes, records):
                probe.commit(rec, reset=d.alarm, rebase=d.rebaselined)
            log.append((rows_RW.tolist(), d.state, d.alarm, d.migrated, d.rebaselined, d.placement))
    assert runs[0][2] == runs[1][2]
    assert runs[0][1][0].native and not runs[1][1][0].native


def test_without_the_extension_probes_use_the_reference(monkeypatch):
    monkeypatch.setattr(probe_math, "_native", None)
    monkeypatch.setattr(probe_math, "_native_error", "the probe extension is missing (no module)")
    assert not probe_math.native_available()
    assert probe_math.native_unavailable_reason() == "the probe extension is missing (no module)"
    assert not LoadProbe(8).native
    with pytest.raises(ConfigError, match=r"native loops were requested but are unavailable: the probe "
                                          r"extension is missing \(no module\)"):
        LoadProbe(8, native=True)


def test_probes_can_be_copied_and_pickled():
    probe = LoadProbe(16)
    probe.commit(probe.record(torch.arange(16) * 10, True))
    counts_E = torch.arange(16).flip(0) * 10
    for twin in (copy.deepcopy(probe), pickle.loads(pickle.dumps(probe))):
        assert twin.native == probe.native
        assert twin.record(counts_E, False).fingerprint == probe.record(counts_E, False).fingerprint
