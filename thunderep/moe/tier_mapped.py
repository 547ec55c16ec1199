"""Cold experts the device reads in place: the mapped path of `thunderep.moe.tiers.ExpertTiers`.

A decode call's cold slots can run on the host or on the device, and the device can have their weights two
ways: copied into a staging buffer (the stream path, which needs the host to know the slots first) or read
where they lie. Pinned host memory is mapped into the device's address space (`staging.mapped`), so the
decode pair kernels, which take each pair's slot on the device, compute a cold slot's pairs reading its
weights across the bus: no copy to launch, no wait for the ids. The host and the bus then work at once on one
call without the launching thread knowing which slots it routes to.

Which cold slots are mapped is fixed between re-choices, since neither side can wait for the other to split
a call: the round(q x cold slots) busiest cold slots by load EMA, for the mapped share q = host / (host +
bus), the seconds of a slot at one row on each (`OffloadCosts.host_seconds`, and `OffloadCosts.stream_seconds`
for the bus: the same bytes cross it; one H100 host read mapped weights at 44-48 GB/s against 50-53 GB/s for
a staged copy, `examples/mapped_pairs_probe.py`). The host's job, or the in-line host path, skips those slots
(`_device_mask`). "auto" maps on CUDA only (on a CPU the device is the host: nothing runs at once;
THUNDEREP_MAPPED=0 turns it off); cold_path "mapped" maps every cold slot (any device: tests), "host" and
"stream" none. Only `partial` calls map, and of those the ones whose tokens share few slots (`maps_call`): each
pair reads its slot's weights itself, so a slot two tokens share is read twice (a decode step's few rows, not a
prompt's; at batch 8 Qwen3-30B-A3B's 128 experts, not Mixtral's 8).
"""

from __future__ import annotations

import torch

from .. import env
from .offload_cost import best_seconds
from .staging import mapped

IN_PLACE = "in place"  # the pair kernels' `kind` for weights they alone can read (`thunderep.kernels.paths`)


class MappedReads:
    """Mixed into `ExpertTiers` (whose attributes it uses: host, device, pairs, config, costs, num_slots,
    slot_params, slot_bytes, stats, _row_of, _hot_mask, the device's slot tables (`_table`, `_stale`) and the
    load EMA of `HotSetRule`)."""

    # Expected reads of a mapped slot in a call that hits it, up to which the call reads its mapped slots in
    # place (`maps_call`): between Qwen3-30B-A3B's 1.24 at 8 tokens, where mapping gained at batch 8 (one
    # H100: 88 against 56 tokens/s unmapped), and Mixtral's 2.22, whose quarter-hot row fell at batch 8 to
    # 77 tokens/s with mapping, below the host alone's 130 (184 in an earlier run without it);
    # docs/benchmarks/2026-12-05-expert-offload-h200.md, thirteenth and fourteenth runs.
    MAPPED_READS = 1.5

    def maps_call(self, tokens: int, top_k: int) -> bool:
        """Whether a call of `tokens` tokens (top_k pairs each) reads its mapped slots in place. Each pair
        reads its slot's weights across the bus, so a slot several of the call's tokens share is read that
        many times, where the host path and the stream path read it once. Expected pairs per hit slot under
        uniform routing over this layer's S slots: T p / (1 - (1 - p) ** T) for p = K / S (1 at one token;
        under expert parallelism S is a rank's share, so p is over-estimated: fewer calls map)."""
        return self.pairs_per_slot(tokens, top_k) <= self.MAPPED_READS

    def pairs_per_slot(self, tokens: int, top_k: int) -> float:
        """Expected pairs per hit slot of a call of `tokens` tokens under uniform routing (`maps_call`)."""
        if tokens <= 1:
            return 1.0
        p = min(1.0, top_k / self.num_slots)
        return tokens * p / (1 - (1 - p) ** tokens)

    def _no_mapping(self) -> None:
        self._maps = None  # `_mapped_views`, made on first use (False: unavailable), of the host dict _maps_of
        self._maps_of = None
        self._mapped: frozenset = frozenset()
        self._masked = None  # the hot mask `_device_mask` was made from
        self._job_mapped = False  # whether the device read the mapped slots of this layer's last job's call
        self._two_sets = getattr(self.pairs, "two_sets", False)  # whether `pairs` may take a second set

    def mapped_share(self) -> float:
        """The share q of the cold rows the device should read mapped (the module docstring), 0 where the
        path does not apply."""
        path = self.config.cold_path
        if path in ("host", "stream") or self.pairs is None or self._mapped_views() is None:
            return 0.0
        if path == "mapped":
            return 1.0
        if self.device.type != "cuda" or not env.mapped():
            return 0.0
        return self.costs.mapped_share(self.slot_params, self.slot_bytes)

    def choose_mapped(self) -> None:
        """The mapped slots after a change of the hot set or a re-choice: round(q x cold slots) of the cold
        slots, the busiest by load EMA (ties: lower slot). By count, not by summed load: a decode step's EMA
        is a few noisy rows, and on one H100 a choice by summed load mapped 37% of the cold rows where q was
        55% (`examples/offload_variants_probe.py`)."""
        q = self.mapped_share()
        cold = [s for s in range(self.num_slots) if s not in self._row_of]
        loads = self._loads()
        chosen = frozenset(sorted(cold, key=lambda s: (-loads[s], s))[:round(q * len(cold))])
        if chosen == self._mapped and self._masked is self._hot_mask:
            return  # unchanged: the device's table and the job's mask are kept
        if chosen != self._mapped:
            self._mapped = chosen
            self._stale |= {"mapped", "both"}
        mask = self._hot_mask.clone()  # a new one: a job may hold the old
        mask[list(chosen)] = True
        self._device_mask, self._masked = mask, self._hot_mask

    def _rechosen(self) -> None:  # `HotSetRule.rechoose`'s boundaries: the loads moved
        self.choose_mapped()

    def _mapped_views(self) -> dict | None:
        """{name: the host tensor as the device reads it in place}, or None where it cannot: on CUDA every host
        tensor must be pinned (weights left memory-mapped on disk are not); on a CPU the host tensors. Made
        again where the host tensors were replaced."""
        if self._maps is None or self._maps_of is not self.host:
            self._maps_of = self.host
            if self.device.type != "cuda":
                self._maps = dict(self.host)
            elif all(t.is_pinned() and t.stride(-1) == 1 for t in self.host.values()):
                self._maps = {n: mapped(t, self.device) for n, t in self.host.items()}
            else:
                self._maps = False
        return self._maps or None

    def _mapped_pairs(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor):
        """The mapped slots' weighted [T, D] share through the pair kernels on the mapped views, or None where
        no slot is mapped, the call would read them too often (`maps_call`) or the kernels do not take it."""
        views = self._mapped_views() if self._mapped and self.maps_call(*local_TK.shape) else None
        if views is None:  # (host tensors replaced by ones the device cannot read: the host computes them)
            return None
        table = self._table("mapped", local_TK.device)
        return self.pairs(views, x_TD, table[local_TK], weights_TK, kind=IN_PLACE)

    def time_mapped(self, hidden: int, dtype: torch.dtype, slots: int = 4, repeats: int = 3) -> float | None:
        """Seconds per slot of the mapped path at one row: one token whose `slots` pairs (fewer where the
        layer has fewer cold slots) read distinct cold slots in place, in one pair call waited for; best of
        `repeats` after one warm-up. None where the path cannot run (no pair kernels, weights not mapped).
        Measured, not used: the mapped share is priced at the stream path's seconds (`mapped_share`); the
        benchmark prints both (`thunderep.bench.offload`)."""
        views = self._mapped_views() if self.pairs is not None else None
        chosen = [s for s in range(self.num_slots) if s not in self._row_of][:slots]
        if views is None or not chosen:
            return None
        gen = torch.Generator().manual_seed(0)
        x_TD = torch.randn(1, hidden, generator=gen).to(self.device, dtype)
        ids_TK = torch.tensor([chosen], dtype=torch.int64, device=self.device)
        w_TK = torch.full((1, len(chosen)), 1.0 / len(chosen), dtype=dtype, device=self.device)
        def call():
            return self.pairs(views, x_TD, ids_TK, w_TK, kind=IN_PLACE)

        if call() is None:  # also the warm-up
            return None
        return best_seconds(call, self.device, repeats, warm=False) / len(chosen)

    def _both_pairs(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor, **kind):
        """The hot and the mapped slots' weighted [T, D] share in one call of the pair kernels, or None where
        that does not apply: nothing hot or nothing mapped, or kernels that take one set of tensors (FP8
        and 4-bit experts: then the two shares are two calls, `partial`). The call's two launches read the
        hot copies and, past their H rows, the mapped host weights (`pairs`' second set, entry H + slot): at
        batch 1 a step is bound by the launching thread, and a pair call costs it about as much as a layer's
        router (examples/decode_step_probe.py). kind: {"kind": ...} for the pair kernels, where the caller
        names one (`ExpertTiers._device_shares`)."""
        applies = self._two_sets and self._mapped and self.capacity and self.maps_call(*local_TK.shape)
        views = self._mapped_views() if applies else None
        if views is None:
            return None
        table = self._table("both", local_TK.device)
        y_TD = self.pairs(self.hot, x_TD, table[local_TK], weights_TK, second=views, **kind)
        if y_TD is None and x_TD.shape[0] == 1:  # one token always fits: these kernels take one set
            self._two_sets = False
        return y_TD

    def _entries(self, key: str) -> dict[int, int]:
        """{slot: its entry} of the device's slot table `key` (`ExpertTiers._table`): "hot", the hot copies' rows;
        "mapped", the mapped slots' own; "both", the hot rows and past their H, H + each mapped slot."""
        if key == "hot":
            return self._row_of
        if key == "mapped":
            return {s: s for s in sorted(self._mapped)}
        return {**self._row_of, **{s: self.capacity + s for s in self._mapped}}

    def _count_mapped(self, by_slot: dict, counts: list[int]) -> list[int]:
        """The mapped slots of a call's `by_slot` whose pairs the device read, in slot order, counted in the
        telemetry (rows_mapped; their weight bytes, read once a pair, in bytes_streamed)."""
        slots = [s for s in sorted(by_slot) if s in self._mapped]
        rows = sum(counts[s] for s in slots)
        self.stats.rows_mapped += rows
        self.stats.bytes_streamed += rows * self.slot_bytes
        return slots
