"""Expert tiers of one MoE layer on one rank: hot experts in device memory, cold ones in host memory.

Shape legend: S local slots, H hot slots, M rows this rank's experts compute, D hidden size.

Every local slot's weights live in host memory (pinned where CUDA exists; read once from the checkpoint);
H of them are also copied to the device (`hot`, [H, ...] per tensor). A layer call gets its rows grouped
by local slot with the counts on the host (ep mode's split sizes; the latency and all-gather modes' local
sort; a single process's bincount) and `ExpertTiers.sorted` computes:

  1. hot slots: their rows in one call of the experts function on the hot weights (a decode step's few,
     on the plain gated layout: each slot's two products apart, `ExpertTiers.LEAN_HOT_SLOTS`);
  2. each cold slot with rows, on the path the cost model makes cheaper (`split_cold`: per slot; on CUDA,
     where the host computes while the device streams, the split of the call's cold slots that ends first):
       host    computed on the host weights by the layer's host function (`thunderep.moe.host_experts`),
               every host-path slot of the call in one call of it: their rows copied to the host in one
               copy and the results back in one (pinned buffers, non-blocking, on CUDA);
       stream  the slot's weights copied into one of two device staging buffers (`Staging`: on CUDA the
               next slot's copy runs on a side stream while this one computes), computed on the device
               (the plain gated layout's two products; else the experts function).

The hot set (`set_hot`) is first the first H slots; after `TierConfig.calibration_calls` calls it becomes
the H slots with the most rows counted so far. From then on, every `TierConfig.interval` calls, a slot's
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
The weights are the same bytes in both tiers, so the hot set never changes an output. On a CPU-only
machine the device is the host: every path runs, with the host's memory standing in for the device's.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from ..errors import ConfigError
from .host_experts import HostExperts, per_slot
from .offload_cost import OffloadCosts, split_cold

__all__ = ["COLD_PATHS", "ExpertTiers", "Staging", "TierConfig", "TierStats", "parse_memory", "to_host"]

COLD_PATHS = ("auto", "host", "stream")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?", re.IGNORECASE)


def parse_memory(value) -> int:
    """Bytes from an int, or a string of a number and an optional unit: "20GiB", "512MiB", "1.5GB",
    "4096" (B, kB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB powers of 1024). ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"gpu_memory must be a number of bytes or a string like '20GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"gpu_memory must not be negative, got {value}")
        return value
    match = _MEMORY.fullmatch(value.strip())
    if match is None:
        raise ConfigError(f"gpu_memory {value!r} is not a size: write a number and a unit, like '20GiB', '512MiB', "
                          "'1.5GB' or '4096' (bytes)")
    number, unit = match.groups()
    size = float(number) * _UNITS[(unit or "").lower()]
    if size != int(size):
        raise ConfigError(f"gpu_memory {value!r} is not a whole number of bytes: give whole bytes or a larger unit")
    return int(size)


@dataclass(frozen=True)
class TierConfig:
    """cold_path: "auto" (the cost model decides per cold slot and call), "host" or "stream" (forced).
    calibration_calls: layer calls counted before the first chosen hot set. interval: layer calls between
    re-choices after that. ema: weight of the past in the per-slot load average. margin: how many times
    over a swap's estimated saving in one interval must pay for its copy; confidence: how many standard
    deviations of counting noise the two slots' load difference must exceed (the module docstring)."""

    cold_path: str = "auto"
    calibration_calls: int = 4
    interval: int = 32
    ema: float = 0.9
    margin: float = 2.0
    confidence: float = 2.0

    def __post_init__(self):
        if self.cold_path not in COLD_PATHS:
            raise ConfigError(f"cold_path must be one of {', '.join(COLD_PATHS)}, got {self.cold_path!r}")
        if self.margin < 0 or self.interval < 1 or not 0 <= self.ema < 1 or self.confidence < 0:
            raise ConfigError(f"TierConfig needs margin >= 0, interval >= 1, 0 <= ema < 1 and confidence >= 0, got "
                              f"margin {self.margin}, interval {self.interval}, ema {self.ema}, "
                              f"confidence {self.confidence}")


@dataclass
class TierStats:
    """Rows served hot / on the host / streamed, bytes streamed to staging buffers, bytes copied into the
    hot set by re-choices, host seconds of cold experts, hot-set changes."""

    rows_hot: int = 0
    rows_host: int = 0
    rows_streamed: int = 0
    bytes_streamed: int = 0
    bytes_promoted: int = 0
    host_seconds: float = 0.0
    hot_changes: int = 0

    def add(self, other: TierStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    @property
    def hot_share(self) -> float:
        rows = self.rows_hot + self.rows_host + self.rows_streamed
        return self.rows_hot / rows if rows else 0.0


class Staging:
    """Two device buffers holding one slot of expert tensors each, shared by the layers whose slots have the
    same shapes. On CUDA the copies run on a side stream: `load` of the next slot overlaps the compute on
    the other buffer; `ready` makes the compute stream wait for a load, `release` marks a buffer's compute
    issued. Elsewhere the copy is a plain copy and the waits are nothing."""

    def __init__(self, like: dict[str, torch.Tensor], device: torch.device):
        self.buffers = [{n: torch.empty((1, *t.shape[1:]), dtype=t.dtype, device=device) for n, t in like.items()}
                        for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loaded: list = [None, None]
        self._used: list = [None, None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())

    def load(self, i: int, host: dict[str, torch.Tensor], slot: int) -> None:
        if self.stream is None:
            for n, t in self.buffers[i].items():
                t.copy_(host[n][slot:slot + 1])
            return
        with torch.cuda.stream(self.stream):
            if self._used[i] is not None:
                self.stream.wait_event(self._used[i])
            for n, t in self.buffers[i].items():
                t.copy_(host[n][slot:slot + 1], non_blocking=True)
            self._loaded[i] = torch.cuda.Event()
            self._loaded[i].record(self.stream)

    def ready(self, i: int) -> None:
        if self._loaded[i] is not None:
            torch.cuda.current_stream().wait_event(self._loaded[i])

    def release(self, i: int) -> None:
        if self.stream is not None:
            self._used[i] = torch.cuda.Event()
            self._used[i].record()


class ExpertTiers:
    """The tiers of one layer's local slots (see the module docstring).

    host: {tensor name: [S, ...]} in host memory. hot_slots: H >= 0 slots to hold on `device`.
    compute(weights, x_MD, slot_M): the experts function on `weights` ({name: [n, ...]}), row m using
    entry slot_M[m]; returns [M, D] unweighted. staging: the shared `Staging` of this layer's shapes.
    host_fn(host, slots, x_MD, counts, out=None): the host function (`thunderep.moe.host_experts`);
    default: `compute` one slot at a time. Where it is a `HostExperts` (the plain gated layout), its
    products also compute the staged slots and, with `lean_hot` and up to LEAN_HOT_SLOTS slots with rows,
    the hot ones (for an experts function that waits for the host, as transformers' grouped one does; one
    that takes a decode step's rows in a few launches, ThunderEP's kernels, runs them itself).
    pairs(weights, x_TD, local_TK, weights_TK): the decode pair kernels' weighted [T, D] share on `weights`
    (local_TK -1: a pair they do not hold), or None where they do not apply; None: no such kernels
    (`hot_partial`).
    """

    LEAN_HOT_SLOTS = 8  # hot slots with rows up to which each computes apart (a decode step's few)

    def __init__(self, host: dict[str, torch.Tensor], hot_slots: int, device: torch.device, compute: Callable,
                 costs: OffloadCosts, staging: Staging, config: TierConfig | None = None,
                 host_fn: Callable | None = None, lean_hot: bool = True, pairs: Callable | None = None):
        self.host, self.device, self.compute, self.costs = host, torch.device(device), compute, costs
        self.host_fn = host_fn or per_slot(compute)
        # the plain gated layout's two products, for the staged slots and a decode step's hot ones on the
        # device: transformers' experts function waits for the device (docs/benchmarks, expert offload)
        self.lean = host_fn if isinstance(host_fn, HostExperts) else None
        self.lean_hot, self.pairs = lean_hot, pairs
        self._hot_index: torch.Tensor | None = None  # [S] on the device: each slot's hot entry, -1 cold
        self._chosen_at = -1  # the call count of the last re-choice: at most one a call
        self.staging, self.config = staging, config or TierConfig()
        first = next(iter(host.values()))
        self.num_slots = first.shape[0]
        if not 0 <= hot_slots <= self.num_slots:
            raise ConfigError(f"hot slots must be between 0 and {self.num_slots}, got {hot_slots}")
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in host.values())
        self.slot_params = sum(t[0].numel() for t in host.values())
        self.hot = {n: torch.empty((hot_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
                    for n, t in host.items()}
        self.hot_slots: list[int] = []
        self.rows_S = torch.zeros(self.num_slots, dtype=torch.int64)  # rows counted per slot (calibration)
        self.ema_S = torch.zeros(self.num_slots, dtype=torch.float64)
        self.calls = 0
        self.stats = TierStats()
        self.set_hot(list(range(hot_slots)), count=False)

    @property
    def capacity(self) -> int:
        return next(iter(self.hot.values())).shape[0]

    def set_hot(self, slots: list[int], count: bool = True) -> None:
        """Make `slots` (H distinct local slots) the hot set, copying in only the weights of slots not hot
        yet (into the rows the leaving slots free). Between calls only."""
        slots = list(slots)
        if len(slots) != self.capacity or len(set(slots)) != len(slots) or \
                not all(0 <= s < self.num_slots for s in slots):
            raise ConfigError(f"a hot set needs {self.capacity} distinct slots of 0..{self.num_slots - 1}, got {slots}")
        old = dict(zip(self.hot_slots, range(len(self.hot_slots))))
        rows = {s: old[s] for s in slots if s in old}
        entering = [s for s in slots if s not in old]
        free = sorted(set(range(self.capacity)) - set(rows.values()))
        for s, row in zip(entering, free):
            for n, t in self.hot.items():
                t[row].copy_(self.host[n][s], non_blocking=True)
            rows[s] = row
        order = [None] * self.capacity
        for s, row in rows.items():
            order[row] = s
        self.hot_slots = order
        self._row_of = {s: row for row, s in enumerate(order)}
        self._hot_index = None
        if count and entering:
            self.stats.bytes_promoted += len(entering) * self.slot_bytes
            self.stats.hot_changes += 1

    # -- choosing the hot set

    def _observe(self, counts_S) -> None:
        """Count one call's rows per slot (host int64 [S], or a list) into the totals and the load EMA."""
        self.calls += 1
        counts = torch.as_tensor(counts_S, dtype=torch.int64)
        self.rows_S += counts
        self.ema_S.mul_(self.config.ema).add_(counts, alpha=1 - self.config.ema)

    def _top(self, load: torch.Tensor) -> list[int]:
        load = load.tolist()
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
        ema = self.ema_S.tolist()
        worth = {s: self.worth(ema[s], row_bytes) for s in range(self.num_slots)}
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
        row_bytes: the bytes of one row of this call (the host path's copies)."""
        c = self.config
        if not self.capacity or self.capacity == self.num_slots or self._chosen_at == self.calls:
            return False
        self._chosen_at = self.calls
        if self.calls == c.calibration_calls:
            best = self._top(self.rows_S)
            changed = set(best) != set(self.hot_slots)
            self.set_hot(best)
            return changed
        if self.calls < c.calibration_calls or (self.calls - c.calibration_calls) % c.interval:
            return False
        pairs = self.swaps(row_bytes)
        if not pairs:
            return False
        leaving = {s_out: s_in for s_in, s_out in pairs}
        self.set_hot([leaving.get(s, s) for s in self.hot_slots])
        return True

    def time_stream(self, hidden: int, dtype: torch.dtype, slots: int = 3, repeats: int = 3) -> float:
        """Seconds per slot of the stream path at one row a slot: `slots` distinct slots (fewer where the
        layer has fewer) through the staging buffers and the experts function, waited for; best of
        `repeats` after one warm-up. The telemetry is left as it was."""
        chosen = list(range(min(slots, self.num_slots)))
        if not chosen:
            return 0.0
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(1, hidden, generator=gen).to(self.device, dtype) for _ in chosen]
        kept = replace(self.stats)
        best = float("inf")
        for i in range(repeats + 1):
            started = time.perf_counter()
            self._stream(chosen, xs, {})
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if i:
                best = min(best, time.perf_counter() - started)
        self.stats = kept
        return best / len(chosen)

    # -- the compute

    def paths(self, rows: list[int], row_bytes: int) -> list[str]:
        """The path of each cold slot of a call with rows[j] rows: forced, or `split_cold`'s choice from the
        cost model (on CUDA the host's slots and the streamed ones overlap)."""
        if self.config.cold_path != "auto":
            return [self.config.cold_path] * len(rows)
        c, P = self.costs, self.slot_params
        return split_cold([c.host_seconds(n, P, row_bytes) for n in rows],
                          [c.stream_seconds(n, P, self.slot_bytes) for n in rows], self.device.type == "cuda")

    def hot_partial(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor | None:
        """The hot slots' weighted [T, D] share of one call (ids_TK: local slots [T, K] on the device,
        weights_TK [T, K]) through `pairs`, launched with no wait for the host, after this call's re-choice
        (so `sorted(..., hot_done=True)` leaves out the same slots); None where `pairs` does not apply
        (no such kernels, gradients, prompts): the hot rows then go through `sorted`."""
        if self.pairs is None or not self.capacity or (torch.is_grad_enabled() and x_TD.requires_grad):
            return None
        self.rechoose(x_TD.shape[-1] * x_TD.element_size())
        if self._hot_index is None or self._hot_index.device != ids_TK.device:
            index = torch.full((self.num_slots,), -1, dtype=torch.int64)
            index[list(self._row_of)] = torch.tensor(list(self._row_of.values()), dtype=torch.int64)
            self._hot_index = index.to(ids_TK.device)
        return self.pairs(self.hot, x_TD, self._hot_index[ids_TK], weights_TK)

    def sorted(self, x_MD: torch.Tensor, counts_S: torch.Tensor, hot_done: bool = False) -> torch.Tensor:
        """Unweighted [M, D] outputs of rows grouped by local slot; counts_S int64 [S] on the host.
        hot_done: the hot slots' rows were computed by `hot_partial` (their outputs here are zeros).
        Differentiable in x_MD (the experts themselves are frozen: `_TieredRows`)."""
        if torch.is_grad_enabled() and x_MD.requires_grad:
            return _TieredRows.apply(x_MD, self, counts_S)
        return self._sorted(x_MD, counts_S, hot_done)

    def input_grad(self, x_MD: torch.Tensor, dy_MD: torch.Tensor, counts_S: torch.Tensor) -> torch.Tensor:
        """dx [M, D] of `sorted`'s outputs given their gradient dy_MD, the weights frozen: each slot's rows
        recomputed with autograd on the device, the hot slots in one call on their copies, the cold ones
        streamed through the staging buffers (training runs many rows per slot: the stream's case)."""
        counts = counts_S.tolist()
        xs, dys = _slot_rows(x_MD, counts), _slot_rows(dy_MD, counts)  # each slot's rows

        def grad(weights: dict, x: torch.Tensor, slot_M: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                return torch.autograd.grad(self.compute(weights, x, slot_M), x, dy)[0]

        pieces: dict[int, torch.Tensor] = {}
        hot = [s for s in self.hot_slots if counts[s]]
        if hot:
            x_hot, slot_M = self._hot_rows(hot, xs)
            dx_hot = grad(self.hot, x_hot, slot_M, torch.cat([dys[s] for s in hot]))
            pieces.update(zip(hot, dx_hot.split([counts[s] for s in hot])))
        cold = [s for s in xs if s not in self._row_of]
        self._stream(cold, [xs[s] for s in cold], pieces, lambda s, weights, x, zeros: grad(weights, x, zeros, dys[s]))
        if not pieces:
            return torch.zeros_like(x_MD)
        return torch.cat([pieces[s] for s in xs])

    def _sorted(self, x_MD: torch.Tensor, counts_S: torch.Tensor, hot_done: bool = False) -> torch.Tensor:
        counts = counts_S.tolist()  # host data in every caller: no wait for the device
        row_bytes = x_MD.shape[-1] * x_MD.element_size()
        self.rechoose(row_bytes)
        self._observe(counts_S)
        M = x_MD.shape[0]
        if M == 0:
            return x_MD.new_zeros(0, x_MD.shape[-1])
        xs = _slot_rows(x_MD, counts)  # the rows of each slot that has some
        pieces: dict[int, torch.Tensor] = {}
        cold = [s for s in xs if s not in self._row_of]
        paths = dict(zip(cold, self.paths([counts[s] for s in cold], row_bytes)))
        streamed, on_host = [s for s in cold if paths[s] == "stream"], [s for s in cold if paths[s] == "host"]
        # 1. the host path's rows to the host in one copy, queued before the hot experts, so that the host
        # computes while the device runs them
        sent = to_host(torch.cat([xs[s] for s in on_host])) if on_host else None
        hot = [s for s in self.hot_slots if counts[s]]
        if hot:  # 2. every hot slot's rows in one call, or a decode step's few slots one by one
            if hot_done:  # computed by hot_partial: nothing to add here
                zeros = x_MD.new_zeros(sum(counts[s] for s in hot), x_MD.shape[-1])
                pieces.update(zip(hot, zeros.split([counts[s] for s in hot])))
            elif self.lean is not None and self.lean_hot and len(hot) <= self.LEAN_HOT_SLOTS:
                pieces.update((s, self.lean.slot(self.hot, self._row_of[s], xs[s])) for s in hot)
            else:
                x_hot, slot_M = self._hot_rows(hot, xs)
                pieces.update(zip(hot, self.compute(self.hot, x_hot, slot_M).split([counts[s] for s in hot])))
            self.stats.rows_hot += sum(counts[s] for s in hot)
        # 3. the streamed slots, queued (on CUDA nothing here waits for them) before 4. every host-path slot
        # in one call of the host function, back in one copy: the host computes while the device streams
        self._stream(streamed, [xs[s] for s in streamed], pieces)
        if on_host:
            pieces.update(zip(on_host, self._on_host(on_host, [counts[s] for s in on_host], *sent, x_MD.device)))
        return torch.cat([pieces[s] for s in xs])

    def _hot_rows(self, hot: list[int], xs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the hot slots `hot` (xs: each slot's rows, `_slot_rows`) in one tensor, and each row's
        entry in the hot copies."""
        x_hot = torch.cat([xs[s] for s in hot])
        device, rows = x_hot.device, [xs[s].shape[0] for s in hot]
        if x_hot.shape[0] <= 256:  # a decode step's few rows: listed on the host, one copy
            entries = [self._row_of[s] for s, n in zip(hot, rows) for _ in range(n)]
            return x_hot, torch.tensor(entries, dtype=torch.int64, device=device)
        slot_M = torch.repeat_interleave(torch.tensor([self._row_of[s] for s in hot], device=device),
                                         torch.tensor(rows, device=device), output_size=x_hot.shape[0])
        return x_hot, slot_M

    def _on_host(self, slots: list[int], counts: list[int], x_MD: torch.Tensor, copied, device: torch.device):
        """The host function on the host rows x_MD (after `copied`), its [M, D] outputs in a pinned buffer
        sent to `device` in one non-blocking copy; returns them split per slot."""
        started = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        cuda = device.type == "cuda"
        out = torch.empty(x_MD.shape, dtype=x_MD.dtype, pin_memory=True) if cuda else None
        y_MD = self.host_fn(self.host, slots, x_MD, counts, out=out).to(device, non_blocking=cuda)
        self.stats.rows_host += x_MD.shape[0]
        self.stats.host_seconds += time.perf_counter() - started
        return y_MD.split(counts)

    def _stream(self, slots: list[int], xs: list[torch.Tensor], pieces: dict, run: Callable | None = None) -> None:
        """Double-buffered: slot j + 1's weights load while slot j computes; pieces[s] = run(s, weights,
        x_nD, zeros) (default: `lean`'s two products where the layout has them, else the experts function)."""
        if not slots:
            return
        staging = self.staging
        staging.load(0, self.host, slots[0])
        for j, (s, x_nD) in enumerate(zip(slots, xs)):
            if j + 1 < len(slots):
                staging.load((j + 1) % 2, self.host, slots[j + 1])
            staging.ready(j % 2)
            weights = staging.buffers[j % 2]
            if run is None and self.lean is not None:  # two products: no slot index to fill
                pieces[s] = self.lean.slot(weights, 0, x_nD)
            else:
                zeros = torch.zeros(x_nD.shape[0], dtype=torch.int64, device=x_nD.device)
                pieces[s] = self.compute(weights, x_nD, zeros) if run is None else run(s, weights, x_nD, zeros)
            staging.release(j % 2)
            self.stats.rows_streamed += x_nD.shape[0]
        self.stats.bytes_streamed += len(slots) * self.slot_bytes


class _TieredRows(torch.autograd.Function):
    """`ExpertTiers.sorted` with the gradient of its input: forward as without gradients, backward
    `ExpertTiers.input_grad` (offloaded experts train frozen: no weight gradients)."""

    @staticmethod
    def forward(ctx, x_MD, tiers: ExpertTiers, counts_S):
        ctx.tiers, ctx.counts_S = tiers, counts_S
        ctx.save_for_backward(x_MD)
        return tiers._sorted(x_MD, counts_S)

    @staticmethod
    def backward(ctx, dy_MD):
        (x_MD,) = ctx.saved_tensors
        return ctx.tiers.input_grad(x_MD, dy_MD.contiguous(), ctx.counts_S), None, None


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(t on the host, the event its copy completes or None): from a CUDA device one non-blocking copy into
    pinned memory, so that work queued after it runs while the host waits for the copy alone; a plain copy
    from another device (host tensors stay where they are)."""
    if t.device.type != "cuda":
        return t.cpu(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def _slot_rows(x_MD: torch.Tensor, counts: list[int]) -> dict[int, torch.Tensor]:
    """{slot: its rows of x_MD (grouped by slot per counts), a view} for the slots with rows, in slot order:
    a layer call at decode has rows in a few of its slots, and splitting into every slot cost more host
    time than the rest of the call's bookkeeping."""
    used = [s for s, n in enumerate(counts) if n]
    return dict(zip(used, x_MD.split([counts[s] for s in used])))

