"""One MoE layer's balancer as the runtime drives it: a rank-local `LoadProbe` and `LinkMeter` plus
the replicated `BalanceMachine`, glued to the dispatcher's one control exchange per step.

Per step (see `machine.py` for the protocol):
  forward   `record(counts_E)` -> int32 words appended to the split-size record (on a Negotiate step
            with this rank's measured bandwidth code); `assign()` picks each pair's replica with the
            current TradePlan; `received(rows_RW, rank_load_R)` keeps every rank's words and every
            rank's total rows under the plan in effect (the column sums of the exchanged split
            sizes: the same integers on every rank, no extra bytes);
  boundary  `step(stats)` -> the Decision for the next step (trade plan, maybe a new placement);
            `stats`, the layer's `CommStats`, gives the meter this step's all-to-all bytes and times.

With every rank's probe replicated (`replicate`, BalancerConfig.probes "all"), the forward sends only
`words()` (the bandwidth word on Negotiate steps, nothing else) and `received(..., counts_RE)` keeps every
rank's per-expert counts of the step, read off the exchanged split sizes; `step` then runs each rank's
probe on its counts and hands the machine the records those ranks would have sent: the same integers
through the same code, so the same decisions, and nothing in the forward needs the host.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ConfigError
from .machine import BalanceMachine, BalancerConfig, Decision, decode_records, encode_record
from .measure import LinkMeter
from .placement import Placement

__all__ = ["LayerBalancer"]


class LayerBalancer:
    def __init__(self, placement: Placement, config: BalancerConfig | None = None, seed: int = 0):
        self.config = config or BalancerConfig()
        self.machine = BalanceMachine(placement, self.config)
        self.probe = self.config.probe(placement.num_experts, seed=seed)
        self.peers: list | None = None  # every rank's LoadProbe, this rank's being `probe` (`replicate`)
        self._seed = seed
        self.meter = LinkMeter(self.config.ema_alpha)
        self._record = None
        self._counts_RE: torch.Tensor | None = None
        self._rows_RW: torch.Tensor | None = None
        self._rank_load_R: tuple[int, ...] | None = None
        self.last: Decision | None = None
        self.sized_by_layer = self.config.bytes_per_expert is None  # the layer reports its slot size

    def set_slot_bytes(self, slot_bytes: int) -> None:
        """The layer's real bytes per slot, where the config left `bytes_per_expert` to the layer.
        Every rank passes the same value (same shapes, same optimizer), so decisions stay identical."""
        if not self.sized_by_layer or self.config.bytes_per_expert == slot_bytes:
            return
        self.config = replace(self.config, bytes_per_expert=float(slot_bytes))
        self.machine.config = self.config

    def replicate(self, rank: int) -> None:
        """Run every rank's probe here from the exchanged split sizes (module docstring); `rank` is this
        process's rank in the EP group. Before the first step, on every rank alike."""
        E = self.machine.placement.num_experts
        self.peers = [self.config.probe(E, seed=self._seed) for _ in range(self.machine.placement.ep_size)]
        self.peers[rank] = self.probe

    @property
    def replicated(self) -> bool:
        return self.peers is not None

    def words(self) -> torch.Tensor:
        """With replicated probes, what this rank sends this step: int32 [1], its bandwidth code, on a
        Negotiate step, else int32 [0] (host tensors)."""
        if not self.machine.negotiating:
            return torch.zeros(0, dtype=torch.int32)
        return torch.tensor([self.meter.code if self.config.measure else 0], dtype=torch.int32)

    @property
    def record_words(self) -> int:
        return self.machine.record_words

    @property
    def state(self) -> str:
        return self.machine.mode.value

    def record(self, counts_E: torch.Tensor) -> torch.Tensor:
        """This step's balancer words (int32 [record_words]); pure, so a recomputed forward is safe."""
        self._record = self.probe.record(counts_E.detach().to("cpu", torch.int64), self.machine.negotiating)
        return encode_record(self._record, self.meter.code if self.config.measure else 0)

    def assign(self, rank: int, ids_TK: torch.Tensor) -> torch.Tensor:
        return self.machine.trade.assign(rank, ids_TK)

    def received(self, rows_RW: torch.Tensor, rank_load_R=None, counts_RE: torch.Tensor | None = None) -> None:
        """rows_RW: int32 [R, record_words] every rank's balancer words (replicated probes: [R, 0 or 1],
        `words()`); rank_load_R: R ints, the rows each rank computes this step under the current plan
        (None: fingerprint-only alarms); counts_RE: int64 [R, E] each rank's pairs per expert this step,
        which replicated probes need."""
        if self.peers is not None and counts_RE is None:
            raise ConfigError("replicated balancer probes need every rank's per-expert counts (counts_RE)")
        self._rows_RW, self._counts_RE = rows_RW, counts_RE
        self._rank_load_R = None if rank_load_R is None else tuple(int(v) for v in rank_load_R)

    def step(self, stats=None) -> Decision | None:
        """Consume this step's exchanged records (None if the layer did not dispatch this step).
        stats: the layer's `CommStats`; its dispatch / combine bytes and seconds since the last step
        feed this rank's bandwidth measurement (None: no measurement from this step)."""
        if stats is not None:
            self.meter.observe_stats(stats)
        if self._rows_RW is None:
            return None
        rows_RW, probes, made = self._rows_RW, [self.probe], [self._record]
        if self.peers is not None:  # each rank's record as it would have sent it
            negotiating, probes = self.machine.negotiating, self.peers
            made = [p.record(c, negotiating) for p, c in zip(probes, self._counts_RE.to("cpu", torch.int64))]
            codes = rows_RW[:, 0].tolist() if negotiating else [0] * len(probes)
            rows_RW = torch.stack([encode_record(r, code) for r, code in zip(made, codes)])
        decision = self.machine.step(*decode_records(rows_RW, self.machine.placement.num_experts), self._rank_load_R)
        for probe, record in zip(probes, made):
            probe.commit(record, reset=decision.alarm, rebase=decision.rebaselined)
        self._rows_RW = self._record = self._rank_load_R = self._counts_RE = None
        self.last = decision
        return decision

    def state_dict(self) -> dict:
        state = {"machine": self.machine.state_dict(), "probe": self.probe.state_dict(),
                 "meter": self.meter.state_dict()}
        if self.peers is not None:
            state["peers"] = [p.state_dict() for p in self.peers]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; a state saved before bandwidth was measured has no meter:
        the meter starts empty (code 0 until it measures, the agreed value is in the machine's). Replicated
        probes need a state saved with them (every rank's probe)."""
        if self.peers is not None and "peers" not in state:
            raise ConfigError("this balancer state holds this rank's probe only (saved with BalancerConfig(probes="
                              "'own')); replicated probes need every rank's: resume with probes='own'")
        self.machine.load_state_dict(state["machine"])
        self.probe.load_state_dict(state["probe"])
        for probe, saved in zip(self.peers or [], state.get("peers", [])):
            probe.load_state_dict(saved)
        self.meter.load_state_dict(state.get("meter") or {"bytes_ema": None, "seconds_ema": None})
