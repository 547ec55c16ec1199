"""The per-layer balancer state machine: Stable / Negotiate / Migrate.

Shape legend: E logical experts, R ranks of the EP group, S slots per rank, W int32 words of a
balancer record (2 when stable, 3 + E when negotiating).

Protocol (per MoE layer, per step t; lag-1)
-------------------------------------------
`machine.mode` for step t is known to every rank before step t starts (decided at the end of t - 1):

* STABLE: each rank's balancer record is its 8-byte load fingerprint (`fingerprint.py`), taken
  relative to the baseline it sent at the last negotiation. The same exchange carries every rank's
  split sizes (rows per destination slot), so every rank also knows each rank's total rows under
  the plan in effect, `rank_load_R`, at no extra byte; their max / mean is the step's *realized
  imbalance*. An alarm - step t + 1 negotiates - needs the realized imbalance over `threshold` and
  news: a fingerprint off the agreed baseline (the loads moved), or a realized imbalance above the
  believed one (from the last negotiated loads) by more than `margin`. A changed fingerprint while
  the realized imbalance is within threshold is a *re-baseline* (the profile moved, the plan still
  holds; nothing else is sent): each probe takes its rounded EMA as its new baseline loads, locally
  (`LoadProbe.commit(rebase=True)`), and the fingerprints of step t + 1 - relative to those - are
  adopted as the agreed baseline without being compared (a change in that one step is still caught
  by the realized imbalance). Unchanged fingerprints over threshold leave the machine Stable only
  while it already believes that imbalance (it negotiated it and no trade helped; the slow window
  is running). Without `rank_load_R` every mismatch is an alarm.
* NEGOTIATE: each rank's record is its fingerprint, its load vector (int32 [E]: the rank's fast
  EMA of its per-expert pair counts) and its measured bandwidth (one word holding a 16-bit code,
  `measure.py`; 0 before the rank has measured). Every rank then computes the same imbalance (max
  rank load / mean rank load) of the plan in effect and, over `threshold - margin`, the same new
  `TradePlan` (`plan_trade`), and takes the same agreed bandwidth: the smallest measured code (the
  slowest link), kept until a later negotiation brings a measurement. The fingerprints of this step
  become the new baseline; the next step is STABLE (a negotiation right after an alarm is confirmed
  by one more, `settle` steps later).
* MIGRATE: when the imbalance the current placement can reach has stayed over `threshold - margin` for
  `slow_window` consecutive steps, at least `min_dwell` steps after the last migration, `plan_placement`
  proposes a new Placement; it is taken if it lowers the predicted imbalance by `migrate_gain` and the
  time it saves over the expected stable period exceeds the time to move the weights (cost check):

      saving_s = (believed - predicted) * mean pairs per rank * seconds_per_pair * horizon
      cost_s   = moved slots * bytes_per_expert / bandwidth

  horizon = max(slow_window, steps since the regime began). `bandwidth` is *measured*: the agreed
  value of the last negotiation (a migration is only planned on negotiated loads, so on the
  measurements of the same exchange or a later one), or the configured constant until any rank has
  measured. `bytes_per_expert` is the layer's real slot size (weights plus the optimizer state that
  moves with them; a constant only without a layer). `seconds_per_pair` is a configured assumption.
  Loads negotiated before a re-baseline no longer describe the profile: then the machine first
  negotiates once more (not an alarm: the EMAs are kept) and plans the migration on the fresh loads.

Realized vs true imbalance: the realized imbalance of step t is the plan in effect at step t applied
to the pairs routed at step t; the evaluation's oracle (`evaluate.py`) applies the same plan to the
expected pairs of step t, so the two differ only by sampling noise (about 1 / sqrt(rows per rank),
1% at 8192 rows; the max over R ranks biases the realized value up by about that). Both judge the
plan that step t ran with, which is also what decides step t's speed.

Every decision is a pure function of the exchanged records (the rank totals are exact integer sums
of exchanged split sizes), so all ranks take it without a leader or an extra round. Decisions made
at the end of step t take effect from step t + 1; forward never waits for them.

Integration recipe (what is exchanged when)
-------------------------------------------
    probe = cfg.probe(E)                                    # per layer, rank-local (LoadProbe)
    meter = LinkMeter(cfg.ema_alpha)                        # per layer, rank-local (measure.py)
    machine = BalanceMachine(placement, cfg)                # per layer, the same on every rank

    # forward of step t, where the dispatcher knows this rank's counts_E, before its exchange:
    rec = probe.record(counts_E, machine.negotiating)      # pure: safe under recomputation
    words_W = encode_record(rec, meter.code)                # int32 [machine.record_words]
    #   append words_W to the split-size record; after the exchange keep every rank's words: rows_RW,
    #   and every rank's total rows under the plan in effect: rank_load_R (sums of the split sizes)
    slots_N = machine.trade.assign(my_rank, ids_TK)         # instead of placement.slot_table(me)[ids]

    # step boundary (after the optimizer step; after each generated token in inference):
    decision = machine.step(*decode_records(rows_RW, E), rank_load_R)
    probe.commit(rec, reset=decision.alarm, rebase=decision.rebaselined)  # an alarm restarts the EMA
    meter.observe_stats(layer_stats)                        # this step's all-to-all bytes and seconds
    if decision.migrated:   # every rank, same step: move weights of decision.moved_slots (migrate.py)
        ...
    # from step t + 1 use machine.placement, machine.trade, machine.record_words

Costs: a Stable step adds 8 bytes per rank per layer to a record that is exchanged anyway (the rank
totals are sums of split sizes every rank already receives: 0 bytes more); a Negotiate step adds
4 + 4 * E more (the bandwidth word and the load vector). With waves, counts_E is the sum over the
waves and the record rides in the one exchange of `Dispatcher.plan`. The split sizes of a negotiate
step already hold every source rank's per-expert counts of that step (summed over an expert's
slots); a runtime may pass those as load_RE instead of the exchanged loads (the probe still records
with negotiate=True, so that its baseline moves): the decisions only need the same numbers on every
rank, not their origin.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import ConfigError
from .balancer_config import BalancerConfig
from .measure import agreed_code, decode_bandwidth
from .placement import Placement, TradePlan
from .planner import moved_slots, plan_placement, plan_trade
from .records import decode_records, encode_record  # the records' home; importable from here as before

__all__ = [
    "BalanceMachine",
    "BalancerConfig",
    "Decision",
    "Mode",
    "decode_records",
    "encode_record",
    "realized_imbalance",
]


class Mode(enum.Enum):
    """What every rank's balancer record carries this step."""

    STABLE = "stable"        # fingerprint only: 8 bytes
    NEGOTIATE = "negotiate"  # fingerprint + int32 load vector + bandwidth word: 12 + 4 E bytes


@dataclass(frozen=True)
class Decision:
    """What one step decided (identical on every rank).

    state: the mode of this step's records ("stable" or "negotiate").
    alarm: a fingerprint differed from the baseline: the next step negotiates.
    traded / migrated: a new TradePlan / Placement is used from the next step.
    imbalance: the believed imbalance of the plan in effect this step (from the last exchanged loads;
        1.0 before any); predicted: the same for the plan in effect from the next step.
    placement, trade: the plan in effect from the next step.
    moved_slots: global slots whose expert changes at the boundary (non-empty only when migrated);
        bytes_moved = len(moved_slots) * bytes_per_expert.
    next_mode: the record mode of the next step; record_bytes: balancer bytes per rank this step.
    realized: max / mean of the rank totals the plan in effect produced this step (None when the
        runtime passed none); rebaselined: a Stable step whose changed fingerprints were adopted as
        the baseline because the realized imbalance was within threshold (no negotiation).
    bandwidth: the B/s the cost check uses from the next step: the agreed measurement (measured
        True) or the configured constant (measured False, until any rank has measured).
    """

    step: int
    state: str
    alarm: bool
    traded: bool
    migrated: bool
    imbalance: float
    predicted: float
    placement: Placement
    trade: TradePlan
    moved_slots: tuple[int, ...]
    bytes_moved: int
    next_mode: Mode
    record_bytes: int
    realized: float | None = None
    rebaselined: bool = False
    bandwidth: float = 0.0
    measured: bool = False


def realized_imbalance(rank_load_R: "Sequence[int] | torch.Tensor", ep_size: int) -> float:
    """max / mean of R rank totals (1.0 when all are zero), from exact integers so that every rank
    computes the same float. rank_load_R: R non-negative integers (a tensor is rounded to int64)."""
    if isinstance(rank_load_R, torch.Tensor):
        t = rank_load_R.detach().to("cpu")
        loads = (t.round() if t.is_floating_point() else t).to(torch.int64).reshape(-1).tolist()
    else:
        loads = [int(v) for v in rank_load_R]
    if len(loads) != ep_size or min(loads) < 0:
        raise ConfigError(f"rank_load_R must be {ep_size} non-negative rank totals, got {loads[:8]}")
    total = sum(loads)
    return max(loads) * ep_size / total if total > 0 else 1.0


@dataclass
class _State:
    step: int = 0
    mode: Mode = Mode.NEGOTIATE
    baseline_R: tuple[int, ...] | None = None
    load_RE: torch.Tensor | None = None
    believed: float = 1.0
    above: int = 0
    last_migration: int | None = None
    last_negotiation: int = 0
    next_check: int = 0
    regime_start: int = 0
    settle_at: int | None = None
    young: bool = True
    adopt: bool = False
    stale: bool = False
    bandwidth_code: int = 0  # the agreed measured bandwidth (measure.py); 0: the configured constant
    counters: dict = field(default_factory=lambda: {"stable": 0, "negotiate": 0, "alarm": 0,
                                                     "trade": 0, "migrate": 0, "rebaseline": 0})


class BalanceMachine:
    """The replicated half of one layer's balancer (see the module docstring).

    placement: the Placement in effect at step 0 (the TradePlan starts as its identity).
    `step(fingerprints_R, load_RE)` is called once per step at the step boundary with the records of
    all R ranks; it is deterministic, so every rank's machine stays identical.
    """

    def __init__(self, placement: Placement, config: BalancerConfig = BalancerConfig()):
        if not isinstance(placement, Placement):
            raise ConfigError(f"BalanceMachine needs a Placement, got {type(placement).__name__}")
        self.config = config
        self.placement = placement
        self.trade = TradePlan.identity(placement)
        self._s = _State()

    # -- what the runtime reads

    @property
    def mode(self) -> Mode:
        return self._s.mode

    @property
    def negotiating(self) -> bool:
        return self._s.mode is Mode.NEGOTIATE

    @property
    def record_words(self) -> int:
        """int32 words of this step's balancer record (2, or 3 + E when negotiating)."""
        return 2 + (1 + self.placement.num_experts if self.negotiating else 0)

    @property
    def bandwidth(self) -> tuple[float, bool]:
        """(B/s the cost check uses, whether it is measured): the agreed measurement of the last
        negotiation that had one, else the configured constant."""
        measured = decode_bandwidth(self._s.bandwidth_code)
        return (self.config.bandwidth, False) if measured is None else (measured, True)

    @property
    def counters(self) -> dict:
        """Steps by kind so far: stable, negotiate, alarm, trade, migrate, rebaseline."""
        return dict(self._s.counters)

    # -- the transition

    def step(self, fingerprints_R: Sequence[int], load_RE: torch.Tensor | None = None,
             bandwidth_R: Sequence[int] | None = None,
             rank_load_R: "Sequence[int] | torch.Tensor | None" = None) -> Decision:
        """Consume this step's exchanged records; return the Decision for the next step.
        `step(*decode_records(rows_RW, E), rank_load_R)` passes the first three.

        fingerprints_R: R unsigned 64-bit fingerprints, indexed by rank.
        load_RE: int [R, E] exchanged loads; required when `negotiating`, ignored otherwise.
        bandwidth_R: R exchanged 16-bit bandwidth codes (0: that rank has not measured), read when
            `negotiating` (None: no rank measured), ignored otherwise.
        rank_load_R: R non-negative ints, the pairs each rank computes this step under the plan in
            effect (the column sums of the exchanged split sizes; any common unit). With them an
            alarm needs a realized imbalance over threshold; without them every fingerprint change
            is an alarm (see the module docstring).
        """
        s, cfg, R = self._s, self.config, self.placement.ep_size
        fps = tuple(int(f) for f in fingerprints_R)
        if len(fps) != R:
            raise ConfigError(f"step() got {len(fps)} fingerprints for an EP group of {R} ranks")
        realized = None if rank_load_R is None else realized_imbalance(rank_load_R, R)
        alarm = traded = rebaselined = False
        act = cfg.threshold - cfg.margin
        if s.mode is Mode.NEGOTIATE:
            before, traded = self._negotiate(fps, *self._negotiated(load_RE, bandwidth_R))
            next_mode = Mode.STABLE
        else:
            before = s.believed
            alarm, rebaselined, next_mode = self._watch(fps, realized)
        s.above = s.above + 1 if s.believed > act else 0
        moved: tuple[int, ...] = ()
        if not alarm and s.load_RE is not None and self._may_migrate():
            if not s.stale:
                moved = self._try_migrate()
            else:  # the loads predate a re-baseline: a migration is planned on fresh ones only
                next_mode = Mode.NEGOTIATE
        s.counters[s.mode.value] += 1
        s.counters["alarm"] += alarm
        s.counters["trade"] += traded
        s.counters["migrate"] += bool(moved)
        s.counters["rebaseline"] += rebaselined
        bandwidth, measured = self.bandwidth
        decision = Decision(
            step=s.step, state=s.mode.value, alarm=alarm, traded=traded, migrated=bool(moved),
            imbalance=before, predicted=s.believed, placement=self.placement, trade=self.trade,
            moved_slots=moved, bytes_moved=int(len(moved) * cfg.slot_bytes), next_mode=next_mode,
            record_bytes=4 * self.record_words, realized=realized, rebaselined=rebaselined,
            bandwidth=bandwidth, measured=measured)
        s.mode = next_mode
        s.step += 1
        return decision

    def _negotiated(self, load_RE, bandwidth_R) -> tuple[torch.Tensor, int]:
        """A negotiate step's exchanged loads, checked (int64 [R, E] on the CPU), and the agreed
        bandwidth code of its exchanged codes."""
        R, E = self.placement.ep_size, self.placement.num_experts
        if not isinstance(load_RE, torch.Tensor) or tuple(load_RE.shape) != (R, E):
            got = tuple(load_RE.shape) if isinstance(load_RE, torch.Tensor) else load_RE
            raise ConfigError(f"a negotiate step needs the exchanged load_RE [{R}, {E}], got {got}")
        if load_RE.is_floating_point():
            load_RE = load_RE.round()
        load_RE = load_RE.detach().to("cpu", torch.int64)
        if bandwidth_R is not None and len(bandwidth_R) != R:
            raise ConfigError(f"a negotiate step needs {R} bandwidth codes, got {len(bandwidth_R)}")
        return load_RE, agreed_code(bandwidth_R or ())

    def _negotiate(self, fps: tuple[int, ...], load_RE: torch.Tensor, agreed: int) -> tuple[float, bool]:
        """A Negotiate step: the exchanged loads become the believed ones, and a better TradePlan is
        taken. Returns (the imbalance of the plan in effect this step, whether a new plan was taken)."""
        s, cfg = self._s, self.config
        if s.young and cfg.settle:  # loads of young EMAs (first step, after an alarm): confirm later
            s.settle_at = s.step + cfg.settle
        s.young = False
        s.baseline_R, s.load_RE, s.last_negotiation = fps, load_RE, s.step
        s.stale = s.adopt = False
        if agreed:  # a negotiation without any measurement keeps the last agreed one
            s.bandwidth_code = agreed
        current = self.trade.imbalance(load_RE)
        s.believed, traded = current, False
        if current > cfg.threshold - cfg.margin:
            candidate = plan_trade(load_RE, self.placement)
            predicted = candidate.imbalance(load_RE)
            if predicted <= current - cfg.trade_gain and candidate != self.trade:
                self.trade, s.believed, traded = candidate, predicted, True
        return current, traded

    def _watch(self, fps: tuple[int, ...], realized: float | None) -> tuple[bool, bool, Mode]:
        """A Stable step: compare the fingerprints with the baseline and the realized imbalance with
        the believed one. Returns (alarm, rebaselined, the next step's mode)."""
        s, cfg = self._s, self.config
        changed = fps != s.baseline_R and not s.adopt
        if s.adopt:  # the probes re-based their loads last step: these fingerprints are the baseline
            s.baseline_R, s.adopt = fps, False
        rebaselined = False
        if realized is None:  # no rank totals: a changed profile is all the machine can see
            alarm = changed
        else:  # alarm on a realized imbalance over threshold that is news: loads moved, or it is
            # worse than the machine believes by more than its noise allowance (the margin)
            alarm = realized > cfg.threshold and (changed or realized > s.believed + cfg.margin)
            rebaselined = changed and not alarm
            if rebaselined:  # the profile moved but the plan still holds: adopt, send nothing
                s.baseline_R, s.adopt, s.stale = fps, True, True
        if alarm:
            s.regime_start, s.settle_at, s.young = s.step, None, True
        refresh = cfg.refresh_every and s.step - s.last_negotiation >= cfg.refresh_every
        settle = s.settle_at is not None and s.step + 1 >= s.settle_at
        if settle:
            s.settle_at = None
        return alarm, rebaselined, Mode.NEGOTIATE if alarm or refresh or settle else Mode.STABLE

    def _may_migrate(self) -> bool:
        s, cfg = self._s, self.config
        dwelt = s.last_migration is None or s.step - s.last_migration >= cfg.min_dwell
        return s.above >= max(cfg.slow_window, 1) and dwelt and s.step >= s.next_check

    def _try_migrate(self) -> tuple[int, ...]:
        """Plan a placement on the last exchanged loads; take it if it pays. Returns the moved slots."""
        s, cfg, pl = self._s, self.config, self.placement
        load_RE = s.load_RE
        new = plan_placement(load_RE.sum(0).to(torch.float64), pl.ep_size, pl.slots_per_rank, pl)
        moved = moved_slots(pl, new)
        if moved:
            trade = plan_trade(load_RE, new)
            predicted = trade.imbalance(load_RE)
            mean_pairs = float(load_RE.sum()) / pl.ep_size
            horizon = max(cfg.slow_window, s.step - s.regime_start)
            saving_s = (s.believed - predicted) * mean_pairs * cfg.seconds_per_pair * horizon
            cost_s = len(moved) * cfg.slot_bytes / self.bandwidth[0]
            if predicted <= s.believed - cfg.migrate_gain and saving_s > cost_s:
                self.placement, self.trade, s.believed = new, trade, predicted
                s.last_migration, s.above = s.step, 0
                return moved
        s.next_check = s.step + max(cfg.slow_window, 1)
        return ()

    # -- checkpoints

    def state_dict(self) -> dict:
        """Everything needed to resume identically, as plain ints, floats, strings and lists."""
        s = self._s
        return {
            "num_experts": self.placement.num_experts,
            "slot_expert_RS": [list(row) for row in self.placement.slot_expert_RS],
            "quota_RP": [list(row) for row in self.trade.quota_RP],
            "step": s.step, "mode": s.mode.value,
            "baseline_R": None if s.baseline_R is None else list(s.baseline_R),
            "load_RE": None if s.load_RE is None else s.load_RE.tolist(),
            "believed": s.believed, "above": s.above, "last_migration": s.last_migration,
            "last_negotiation": s.last_negotiation, "next_check": s.next_check,
            "regime_start": s.regime_start, "settle_at": s.settle_at, "young": s.young, "adopt": s.adopt,
            "stale": s.stale, "bandwidth_code": s.bandwidth_code,
            "counters": dict(s.counters),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output (the config stays this machine's own)."""
        try:
            placement = Placement(state["num_experts"], tuple(tuple(r) for r in state["slot_expert_RS"]))
            trade = TradePlan(placement, tuple(tuple(r) for r in state["quota_RP"]))
            load = state["load_RE"]
            s = _State(
                step=state["step"], mode=Mode(state["mode"]),
                baseline_R=None if state["baseline_R"] is None else tuple(state["baseline_R"]),
                load_RE=None if load is None else torch.tensor(load, dtype=torch.int64),
                believed=state["believed"], above=state["above"], last_migration=state["last_migration"],
                last_negotiation=state["last_negotiation"], next_check=state["next_check"],
                regime_start=state["regime_start"], settle_at=state["settle_at"],
                young=state["young"], adopt=state.get("adopt", False), stale=state.get("stale", False),
                bandwidth_code=agreed_code([state.get("bandwidth_code", 0)]),  # older states: none
                counters={**_State().counters, **state["counters"]})
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a BalanceMachine state: {exc!r:.200}") from exc
        self.placement, self.trade, self._s = placement, trade, s

    def __repr__(self) -> str:
        return (f"BalanceMachine(step={self._s.step}, mode={self._s.mode.value}, "
                f"imbalance={self._s.believed:.3f}, {self.placement!r})")
