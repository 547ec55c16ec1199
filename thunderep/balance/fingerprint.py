"""Load fingerprints: a rank's per-expert load -> quantized load profile -> XXH3-64 (8 bytes).

Shape legend: E logical experts. Counts are (token, k) pairs this rank routed to each expert in one
step of one MoE layer.

Why a fingerprint: while every rank's fingerprint equals the one it sent at the last negotiation, the
load profile has not moved enough to matter and nothing else needs to be exchanged (`machine.py`).
When it moves while the plan in effect is still balanced, the machine re-baselines: each probe takes
its current EMA as its baseline without sending it (`LoadProbe.commit(rebase=True)`).
Token order never matters to balance, so the *profile* is hashed, not the routing.

Bucketing
---------
Each expert's load is measured in octaves of a uniform share, with half a pair of pseudo-count so
that an idle expert is finite:

    x_e = log2(E * (c_e + 1/2) / (N + E/2)),   N = sum_e c_e,   clipped below at -4

(an expert under 1/16 of a uniform share is "cold"; how cold does not matter to balance). The *code*
of a profile is floor(x_e / W) per expert, W = 0.5 octave (a factor 1.41): the coarse identity of
the profile.

Fixed bucket edges alone would make the fingerprint flip on sampling noise: with 64 experts some
expert always sits next to an edge. So a fingerprint is taken *relative to a baseline* - the profile
this rank sent at the last negotiation - and an expert's code moves off the baseline's code only
when its count has moved both significantly (beyond sampling noise) and materially (beyond half a
bucket):

    n_e     = nb_e * N / Nb                       the count the baseline predicts at this step's total
    s_e     = 2 (sqrt(c_e + 3/8) - sqrt(n_e + 3/8)) / sqrt(v + vb * N / Nb)
    d_e     = x_e - xb_e
    moved_e = |s_e| > Z  and  |d_e| > W / 2
    code_e  = floor(xb_e / W) + sign(d_e) * moved_e

s_e is the Anscombe (variance-stabilized) difference of a Poisson count from its prediction: about
a standard normal under pure sampling noise, whatever the count (even 0 or 1), so with Z = 4.5 an
expert's code flips on noise with probability about 1e-5 per step (Z = 4: 6e-5, which with 64
experts on 4 ranks cost 2 points of Stable fraction in the evaluation harness, for no gain in
detection). v and vb are the variance factors (var / mean) of the current and the baseline counts:
1 for one step's counts, alpha / (2 - alpha) for a long-running EMA with weight alpha
(`ema_variance`); `LoadProbe` tracks the exact value of its EMA. The W / 2 floor (19%) keeps large
experts, whose noise is tiny, from flagging changes too small to matter. Properties:
fingerprint(c, baseline=c) == fingerprint(c); the same profile at another batch size has the same
fingerprint; a step with no pairs keeps the baseline's fingerprint (no evidence of change); the
computation is local to the rank that sends it (peers only compare 8-byte
values), so floating-point differences between hosts cannot make ranks disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from .probe_math import COLD_OCTAVES, ProbeMath, host_counts, octaves

__all__ = [
    "COLD_OCTAVES",
    "Baseline",
    "NOISE_Z",
    "WIDTH_OCTAVES",
    "LoadProbe",
    "ProbeRecord",
    "ema_update",
    "ema_variance",
    "fingerprint",
    "load_profile",
]

WIDTH_OCTAVES = 0.5   # W: bucket width; a factor 1.41 per bucket
NOISE_Z = 4.5         # Z: tolerance in standard deviations of sampling noise


def _check_counts(name: str, counts_E: torch.Tensor, num_experts: int | None = None) -> np.ndarray:
    """counts_E as float64 numpy [E] on the host (a ConfigError naming `name` when it is no [E] tensor)."""
    if not isinstance(counts_E, torch.Tensor) or counts_E.dim() != 1 or counts_E.numel() == 0:
        shape = tuple(counts_E.shape) if isinstance(counts_E, torch.Tensor) else type(counts_E).__name__
        raise ConfigError(f"{name} must be a non-empty 1-D tensor of per-expert counts [E], got {shape}")
    if num_experts is not None and counts_E.numel() != num_experts:
        raise ConfigError(f"{name} has {counts_E.numel()} experts, expected {num_experts}")
    return counts_E.detach().to("cpu", torch.float64).numpy()


def _check_params(variance: float, width: float, z: float) -> None:
    if not (width > 0 and z >= 0 and variance >= 0):
        raise ConfigError(f"fingerprint parameters need width > 0, z >= 0, variance >= 0; got "
                          f"width={width!r}, z={z!r}, variance={variance!r}")


@dataclass(frozen=True, eq=False)
class Baseline:
    """One baseline profile, precomputed once per negotiation (`Baseline.of`).

    counts_E: float64 [E] the baseline counts; xb_E: their octaves; code_E: float64 floor(xb / W);
    variance: vb, the variance factor of the baseline counts; total: Nb; width: W; z: Z. The tensors
    are contiguous on the CPU (the probe's native loops read them).
    """

    counts_E: torch.Tensor
    xb_E: torch.Tensor
    code_E: torch.Tensor
    variance: float
    total: float
    width: float
    z: float

    @classmethod
    def of(cls, baseline_E: torch.Tensor, *, variance: float = 1.0, width: float = WIDTH_OCTAVES,
           z: float = NOISE_Z) -> "Baseline":
        """baseline_E: [E] counts; variance: their variance factor vb (1 for one step's counts)."""
        _check_params(variance, width, z)
        cb_E = host_counts("baseline_E", baseline_E).to(torch.float64, copy=True)
        xb_E, total = octaves(cb_E.numpy())
        return cls(cb_E, torch.from_numpy(xb_E), torch.from_numpy(np.floor(xb_E / width)),
                   float(variance), total, float(width), float(z))


def _profile(counts_E: torch.Tensor, baseline: torch.Tensor | Baseline | None, variance: float,
             width: float, z: float, seed: int) -> tuple[int, ProbeMath]:
    """(fingerprint, the math holding its codes) after checking `load_profile`'s arguments."""
    c_E = host_counts("counts_E", counts_E).to(torch.float64, copy=True)
    math_ = ProbeMath(c_E.numel())
    if baseline is None:
        _check_params(variance, width, z)
        return math_.fingerprint(c_E, width, seed), math_
    if not isinstance(baseline, Baseline):
        baseline = Baseline.of(baseline, variance=variance, width=width, z=z)
    if baseline.counts_E.numel() != c_E.numel():
        raise ConfigError(f"counts_E has {c_E.numel()} experts but the baseline has {baseline.counts_E.numel()}")
    if not variance >= 0:
        raise ConfigError(f"variance ({variance!r}) must be >= 0")
    return math_.fingerprint(c_E, baseline.width, seed, baseline, variance), math_


def load_profile(counts_E: torch.Tensor, baseline: "torch.Tensor | Baseline | None" = None, *,
                 variance: float = 1.0, width: float = WIDTH_OCTAVES, z: float = NOISE_Z) -> torch.Tensor:
    """Quantized load profile (see the module docstring).

    counts_E: [E] counts (any real dtype, any device; read on the CPU).
    baseline: [E] the counts the profile is compared with (then with the same variance, width and
        z), or their precomputed `Baseline` (whose own variance, width and z apply), or None for the
        plain code floor(x / W).
    variance: variance factor v of counts_E (1 for one step's counts; `LoadProbe` passes its EMA's).
    Returns int16 [E] bucket codes on the CPU.
    """
    return _profile(counts_E, baseline, variance, width, z, 0)[1].codes_E


def fingerprint(counts_E: torch.Tensor, baseline: "torch.Tensor | Baseline | None" = None, *,
                variance: float = 1.0, width: float = WIDTH_OCTAVES, z: float = NOISE_Z,
                seed: int = 0) -> int:
    """XXH3-64 of `load_profile(...)`: an unsigned 64-bit int (8 bytes on the wire).

    Same arguments as `load_profile`; `seed` is XXH3's seed (e.g. to separate layers)."""
    return _profile(counts_E, baseline, variance, width, z, seed)[0]


def ema_variance(alpha: float) -> float:
    """Variance of an EMA with weight `alpha` of Poisson counts, as a fraction of the counts' mean:
    alpha / (2 - alpha) (0.18 for alpha = 0.3, i.e. noise 2.4x smaller than one step's counts)."""
    if not 0 < alpha <= 1:
        raise ConfigError(f"EMA weight alpha ({alpha!r}) must be in (0, 1]")
    return alpha / (2.0 - alpha)


def _ema(ema_E: np.ndarray | None, c_E: np.ndarray, alpha: float) -> np.ndarray:
    return c_E.copy() if ema_E is None else ema_E * (1.0 - alpha) + c_E * alpha


def ema_update(ema_E: torch.Tensor | None, counts_E: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * counts + (1 - alpha) * ema, float64 [E] on the CPU (the counts themselves if ema is None)."""
    c_E = _check_counts("counts_E", counts_E, None if ema_E is None else ema_E.numel())
    return torch.from_numpy(_ema(None if ema_E is None else ema_E.numpy(), c_E, alpha))


@dataclass(frozen=True, eq=False)
class ProbeRecord:
    """What one rank contributes to one step's control record for one layer.

    fingerprint: XXH3-64 of this step's profile (relative to the baseline; when negotiating, of the
        sent load itself, which becomes the new baseline).
    load_E: int32 [E] the rounded EMA load, present only when negotiating.
    counts_E / ema_E: float64 [E] this step's counts and the EMA including them; variance: the EMA's
        variance factor (committed at the step boundary).
    """

    fingerprint: int
    load_E: torch.Tensor | None
    counts_E: torch.Tensor
    ema_E: torch.Tensor
    variance: float


class LoadProbe:
    """The rank-local half of the balancer for one layer: this rank's fast EMA of its expert loads,
    the EMA's variance factor, and the baseline load it last sent.

    `record(counts_E, negotiate)` is pure (it may run inside forward, and again under activation
    recomputation); `commit(record, reset)` applies it at the step boundary. reset=True (after an
    alarm: the profile moved) restarts the EMA from this step's counts, so that the next step's
    negotiation sends loads of the new regime only instead of an EMA still half in the old one.
    """

    def __init__(self, num_experts: int, *, alpha: float = 0.3, width: float = WIDTH_OCTAVES,
                 z: float = NOISE_Z, seed: int = 0, native: bool | None = None):
        """native: the per-call math in the native loops (True: required), in the numpy / torch
        reference (False), or native when available (None); bit-identical results either way
        (`probe_math.py`)."""
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ConfigError(f"num_experts must be a positive integer, got {num_experts!r}")
        _check_params(ema_variance(alpha), width, z)
        self.num_experts = num_experts
        self.alpha, self.width, self.z, self.seed = alpha, width, z, seed
        self.ema_E: torch.Tensor | None = None
        self.variance = 1.0
        self.baseline: Baseline | None = None
        self._math = ProbeMath(num_experts, native)

    @property
    def native(self) -> bool:
        """True when this probe's per-call math runs in the native loops."""
        return self._math.native

    def record(self, counts_E: torch.Tensor, negotiate: bool) -> ProbeRecord:
        """counts_E: [E] pairs this rank routed to each expert this step. Does not change the probe."""
        counts_t, ema_t = self._math.ema(counts_E, self.ema_E, self.alpha)
        a = self.alpha
        v = 1.0 if self.ema_E is None else (1.0 - a) ** 2 * self.variance + a * a
        if negotiate or self.baseline is None:
            load_E, load_f_E = self._math.load(ema_t)
            fp = self._math.fingerprint(load_f_E, self.width, self.seed)
            return ProbeRecord(fp, load_E if negotiate else None, counts_t, ema_t, v)
        fp = self._math.fingerprint(ema_t, self.width, self.seed, self.baseline, v)
        return ProbeRecord(fp, None, counts_t, ema_t, v)

    def state_dict(self) -> dict:
        """The EMA, its variance factor and the baseline, as plain floats and lists."""
        b = self.baseline
        return {"ema_E": None if self.ema_E is None else self.ema_E.tolist(), "variance": self.variance,
                "baseline_E": None if b is None else b.counts_E.tolist(),
                "baseline_variance": None if b is None else b.variance}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output."""
        ema, base = state["ema_E"], state["baseline_E"]
        self.ema_E = None if ema is None else torch.from_numpy(_check_counts("ema_E", torch.tensor(ema), self.num_experts))
        self.variance = float(state["variance"])
        self.baseline = None if base is None else Baseline.of(
            torch.tensor(base, dtype=torch.float64), variance=state["baseline_variance"],
            width=self.width, z=self.z)

    def commit(self, record: ProbeRecord, reset: bool = False, rebase: bool = False) -> None:
        """At the step boundary: keep the EMA (or, with reset, restart it from this step's counts);
        a sent load becomes the new baseline, and so does, with rebase (the machine re-baselined:
        the profile moved, the plan still holds), the rounded EMA that was not sent."""
        if reset:
            self.ema_E, self.variance = record.counts_E, 1.0
        else:
            self.ema_E, self.variance = record.ema_E, record.variance
        load_E = record.load_E
        if load_E is None and rebase:
            load_E = record.ema_E.round().clamp_(0, 2**31 - 1).to(torch.int32)
        if load_E is not None:
            self.baseline = Baseline.of(load_E, variance=record.variance, width=self.width, z=self.z)
