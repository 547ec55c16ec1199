"""The balancer's knobs (`BalancerConfig`), their defaults and why; `machine.py` describes the protocol
they tune."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .fingerprint import NOISE_Z, WIDTH_OCTAVES, LoadProbe

__all__ = ["DEFAULT_BYTES_PER_EXPERT", "PROBES", "BalancerConfig"]

PROBES = ("auto", "own", "all")  # BalancerConfig.probes

DEFAULT_BYTES_PER_EXPERT = 12.6e6  # one bf16 OLMoE-1B-7B-sized expert: 3 x 2048 x 1024 x 2 B


@dataclass(frozen=True)
class BalancerConfig:
    """Balancer knobs; the defaults and why.

    threshold 1.10: the imbalance to stay under; below 10% excess on the slowest rank, the PCIe bytes
        a trade adds (pairs sent to a remote replica) cost about what they save.
    margin 0.02: the machine acts (plans a trade, counts toward a migration) from threshold - margin:
        its imbalance estimates carry about 1% of sampling noise, and a plan estimated at 1.099 but
        truly at 1.104 would otherwise never be revisited. On a Stable step it is also the noise
        allowance of the realized imbalance: with unchanged fingerprints, a realized imbalance over
        threshold is an alarm only if it exceeds the believed one by more than the margin.
    settle 8: at step 0 and after an alarm the probes' EMAs are young (after an alarm they restart),
        so the loads negotiated then are noisy (variance factor 1 or 0.58 instead of 0.18); the
        machine negotiates once more `settle` steps later, when the EMAs have settled (0: never).
        One extra load record per alarm.
    trade_gain 0.02: a new TradePlan replaces the current one only if it lowers the predicted
        imbalance by 2 points, so sampling noise never churns plans.
    ema_alpha 0.3: the fast EMA of each rank's counts (effective memory ~6 steps): 2.4x less noise than
        one step, while a shift is 66% visible after 3 steps.
    slow_window 32: a migration needs the reachable imbalance over threshold in each of 32 consecutive
        steps: bursts shorter than that are traded, never migrated; and a shift is followed within
        about 35 steps (seconds in inference, a minute or so in training).
    min_dwell 100: steps between migrations: at most one weight move per 100 steps whatever the
        trace does (hysteresis against oscillation, with migrate_gain and the cost check).
    migrate_gain 0.05: a new Placement must lower the predicted imbalance by 5 points.
    bytes_per_expert None: the bytes one slot's migration moves. None: a `ThunderMoELayer` fills in its
        real slot size (the expert weights, plus the optimizer state shaped like them once
        `balance_step(optimizer)` has seen it: `migrate.py` moves that state along); without a layer
        (the evaluation harness) DEFAULT_BYTES_PER_EXPERT, one bf16 expert of an OLMoE-1B-7B-sized
        layer (3 x 2048 x 1024 x 2 B = 12.6e6). A number overrides both.
    bandwidth 12e9 B/s: PCIe 4.0 x16 staged through host memory (no P2P); docs/BENCHMARKS.md,
        "Balancer: fingerprints, trading and migration on routing traces (CPU)". The fallback: the
        cost check uses the agreed *measured* bandwidth (`measure.py`) once any rank has measured
        one, and this value until then (or always, with measure=False).
    measure True: ranks measure their all-to-all bandwidth and send it on Negotiate steps (with
        False they send code 0, the record keeps its size).
    seconds_per_pair 0.6e-6: what one extra pair costs the slowest rank (its 8 KB round trip over
        PCIe plus the expert GEMMs) for the same layer. A configured assumption: the marginal cost
        of a pair is not measured (per-step wall time / rows would fold fixed costs into it, and host
        clocks do not see asynchronous GPU work).
    refresh_every 0: force a negotiation every N steps (0: never; fingerprints suffice).
    fingerprint_width / fingerprint_z: the bucketing of `fingerprint.load_profile`.
    probes "auto": where the probes run. "own": each rank probes its own per-expert counts in the forward
        and sends its fingerprint (on Negotiate steps also its load vector) in the split-size record, which
        then goes to the host for that. "all": every rank runs every rank's probe at the step boundary
        from the exchanged split sizes (they hold each rank's per-expert counts, summed over an expert's
        slots): the record carries only the bandwidth word, on Negotiate steps, so the kernel that counts
        the split sizes can write it straight into host memory (`comm/control_records.py`); R probes of
        host time per rank at the boundary instead of one in the forward. "auto": "all" where the runtime
        exchanges its records that way (CUDA ranks of one host), else "own". The decisions are the same.
    """

    threshold: float = 1.10
    margin: float = 0.02
    settle: int = 8
    trade_gain: float = 0.02
    ema_alpha: float = 0.3
    slow_window: int = 32
    min_dwell: int = 100
    migrate_gain: float = 0.05
    bytes_per_expert: float | None = None
    bandwidth: float = 12e9
    measure: bool = True
    seconds_per_pair: float = 0.6e-6
    refresh_every: int = 0
    fingerprint_width: float = WIDTH_OCTAVES
    fingerprint_z: float = NOISE_Z
    probes: str = "auto"

    @property
    def slot_bytes(self) -> float:
        """Bytes one slot's migration moves (bytes_per_expert, or the default without a layer)."""
        return DEFAULT_BYTES_PER_EXPERT if self.bytes_per_expert is None else self.bytes_per_expert

    def probe(self, num_experts: int, seed: int = 0) -> LoadProbe:
        """The rank-local `LoadProbe` matching this config (EMA weight, bucketing)."""
        return LoadProbe(num_experts, alpha=self.ema_alpha, width=self.fingerprint_width,
                         z=self.fingerprint_z, seed=seed)

    def __post_init__(self) -> None:
        if self.probes not in PROBES:
            raise ConfigError(f"probes must be one of {', '.join(PROBES)}, got {self.probes!r}")
        if not self.threshold >= 1.0:
            raise ConfigError(f"threshold ({self.threshold!r}) is a max/mean imbalance and must be >= 1.0")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError(f"ema_alpha ({self.ema_alpha!r}) must be in (0, 1]")
        if not isinstance(self.measure, bool):
            raise ConfigError(f"measure must be True or False, got {self.measure!r}")
        for name in ("slow_window", "min_dwell", "refresh_every", "settle"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {v!r}")
        for name in ("margin", "trade_gain", "migrate_gain", "bytes_per_expert", "seconds_per_pair"):
            if name == "bytes_per_expert" and self.bytes_per_expert is None:
                continue
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.bandwidth > 0 or not self.fingerprint_width > 0 or not self.fingerprint_z >= 0:
            raise ConfigError(f"bandwidth ({self.bandwidth!r}) and fingerprint_width "
                              f"({self.fingerprint_width!r}) must be > 0, fingerprint_z >= 0")
