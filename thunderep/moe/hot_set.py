"""The rule that chooses a layer's hot experts from measured load (`HotSetRule`, the base of
`thunderep.moe.tiers.ExpertTiers`).

A layer's hot set (`ExpertTiers.set_hot`) is first the first H slots; after `TierConfig.calibration_calls`
calls it becomes the H slots with the most rows counted so far. From then on, every `TierConfig.interval` calls, a slot's
worth being hot is w(s) = cold(r_s) - hot(r_s), the expected seconds per call it saves there, from its
load EMA r_s (rows per call) and the calibrated costs (`OffloadCosts.cold_seconds`, on the path it would
take). The coldest-valued hot slot is swapped for the best cold one, pair after pair, while
interval x (w(in) - w(out)) > TierConfig.margin x the seconds of copying one slot in: a swap must pay for
its copy `margin` times over within one interval, so near-equal loads (a prefill's near-uniform routing)
move nothing. At decode a slot sees a row in a few calls of a hundred, and one recent row lifts its EMA
past that bar, so a swap must also be more than counting noise: with n = r x (1 + ema) / (1 - ema), the
rows of as many calls as have the EMA's variance, n(in) - n(out) > TierConfig.confidence x sqrt(n(in) +
n(out)) (Poisson counts; confidence 2: about 2 standard deviations). Without it, near-uniform decode
moved some 500 slots over a short run on one H200 (docs/benchmarks/2026-12-05-expert-offload-h200.md).
The weights are the same bytes in both tiers, so the hot set never changes an output.
"""

from __future__ import annotations

import torch

__all__ = ["HotSetRule"]


class HotSetRule:
    """The hot-set rule over the state `ExpertTiers` keeps: calls (layer calls counted), costs
    (`OffloadCosts`), config (`TierConfig`), num_slots, capacity, slot_bytes / slot_params (one slot's),
    hot_slots and _row_of (the hot set and each hot slot's entry), _chosen_at (the call count of the last
    re-choice), and `set_hot`; and the counts `_observe` keeps (`_counting` starts them): rows_S / ema_S,
    the rows per slot in all and their load EMA.

    Every layer call is counted, and a decode step's call has rows on a few slots of many: the counts are
    Python lists updated on those slots alone, and the EMA is held as scale x values (the decay of a call
    multiplies the scale, a call's rows add (1 - ema) / scale to their slots' values), folded back where the
    scale gets small: a few microseconds a call on the host, where whole-[S] tensor updates took tens."""

    def _counting(self) -> None:
        self._rows = [0] * self.num_slots
        self._ema, self._scale = [0.0] * self.num_slots, 1.0

    @property
    def rows_S(self) -> torch.Tensor:
        """int64 [S] rows counted per slot over every call."""
        return torch.tensor(self._rows, dtype=torch.int64)

    @property
    def ema_S(self) -> torch.Tensor:
        """float64 [S] each slot's load EMA (rows per call; the past weighted by `TierConfig.ema` a call)."""
        return torch.tensor(self._loads(), dtype=torch.float64)

    def _loads(self) -> list[float]:
        """Each slot's load EMA as floats (`ema_S`'s values, without the tensor)."""
        return [e * self._scale for e in self._ema]

    def _observe(self, counts) -> None:
        """Count one call's rows per slot (host int64 [S], a list of S, or {slot: rows}) into the totals and
        the load EMA."""
        self.calls += 1
        decay = self.config.ema
        if self._scale * decay < 1e-200:  # fold the scale into the values (also ema 0: the last call alone)
            self._ema, self._scale = [e * self._scale * decay for e in self._ema], 1.0
        else:
            self._scale *= decay
        add = (1 - decay) / self._scale
        if isinstance(counts, dict):
            items = counts.items()
        else:
            items = enumerate(counts.tolist() if isinstance(counts, torch.Tensor) else counts)
        for s, n in items:
            if n:
                self._rows[s] += n
                self._ema[s] += n * add

    def _top(self, load: list) -> list[int]:
        return sorted(sorted(range(self.num_slots), key=lambda s: -load[s])[:self.capacity])

    def worth(self, rows: float, row_bytes: int) -> float:
        """Expected seconds per call a slot averaging `rows` rows saves by being hot (module docstring)."""
        c = self.costs
        cold = c.cold_seconds(rows, self.slot_params, row_bytes, self.slot_bytes, self.config.cold_path)
        return cold - min(1.0, rows) * c.hot_seconds(max(1.0, rows), self.slot_params)

    def swaps(self, row_bytes: int) -> list[tuple[int, int]]:
        """(cold slot in, hot slot out) pairs the rule of the module docstring makes now, best first."""
        c = self.config
        copy_s = self.slot_bytes / self.costs.h2d_Bps
        ema = self._loads()
        unit = self.worth(1.0, row_bytes)  # at most a row a call, a slot saves its share of one row's worth
        worth = {s: ema[s] * unit if ema[s] <= 1 else self.worth(ema[s], row_bytes) for s in range(self.num_slots)}
        ins = sorted((s for s in range(self.num_slots) if s not in self._row_of), key=lambda s: -worth[s])
        outs = sorted(self.hot_slots, key=lambda s: worth[s])
        window = (1 + c.ema) / (1 - c.ema)  # calls whose counts the EMA's variance equals
        pairs = []
        for s_in, s_out in zip(ins, outs):
            if c.interval * (worth[s_in] - worth[s_out]) <= c.margin * copy_s:
                break
            n_in, n_out = ema[s_in] * window, ema[s_out] * window
            if n_in - n_out <= c.confidence * (n_in + n_out) ** 0.5:
                continue  # a difference counting noise makes often: a later, busier pair may still pass
            pairs.append((s_in, s_out))
        return pairs

    def rechoose(self, row_bytes: int = 0) -> bool:
        """The rule of the module docstring, at a call boundary; True where the hot set changed.
        row_bytes: the bytes of one row of this call (the host path's copies). At each of the rule's
        boundaries (the calibration's end, every interval after it) `_rechosen` follows, changed or not."""
        c = self.config
        if self._chosen_at == self.calls:
            return False
        self._chosen_at = self.calls
        since = self.calls - c.calibration_calls
        if since < 0 or since % c.interval:
            return False
        changed = False
        if 0 < self.capacity < self.num_slots:
            changed = self._choose_top() if since == 0 else self._swap(row_bytes)
        self._rechosen()
        return changed

    def _rechosen(self) -> None:
        """What follows each boundary of the rule (nothing here; `ExpertTiers` re-chooses its mapped slots)."""

    def _choose_top(self) -> bool:
        best = self._top(self._rows)
        changed = set(best) != set(self.hot_slots)
        self.set_hot(best)
        return changed

    def _swap(self, row_bytes: int) -> bool:
        pairs = self.swaps(row_bytes)
        if not pairs:
            return False
        leaving = {s_out: s_in for s_in, s_out in pairs}
        self.set_hot([leaving.get(s, s) for s in self.hot_slots])
        return True
