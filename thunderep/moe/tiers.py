"""Expert tiers of one MoE layer on one rank: hot experts in device memory, cold ones in host memory.

Shape legend: S local slots, H hot slots, M rows this rank's experts compute, D hidden size, T tokens of a call,
K experts per token.

Every local slot's weights live in host memory (pinned where CUDA exists; read once from the checkpoint);
H of them are also copied to the device (`hot`, [H, ...] per tensor). A layer call of many rows gets them
grouped by local slot with the counts on the host (ep mode's split sizes; the latency and all-gather
modes' local sort; a single process's bincount) and `ExpertTiers.sorted` computes:

  1. hot slots: their rows in one call of the experts function on the hot weights (a decode step's few,
     on the plain gated layout: each slot's two products apart, `ExpertTiers.LEAN_HOT_SLOTS`);
  2. each cold slot with rows, on the path the cost model makes cheaper (`split_cold`: per slot; on CUDA,
     where the host computes while the device streams, the split of the call's cold slots that ends first):
       host    computed on the host weights by the layer's host function (`thunderep.moe.host_experts`),
               every host-path slot of the call in one call of it: their rows copied to the host in one
               copy and the results back in one (pinned buffers, non-blocking, on CUDA);
       stream  the slot's weights copied into one of two device staging buffers (`Staging`: on CUDA the
               next slot's copy runs on a side stream while this one computes), computed on the device
               (the plain gated layout's two products; else the experts function);
     and in a `partial` call a third, fixed share of the cold slots:
       mapped  read in place from pinned host memory by the decode pair kernels, which take the ids on the
               device (`thunderep.moe.tier_mapped`): no host knowledge of the ids, so the host's share and
               the bus's run at once even where the host's is a job.

A call of few pairs (T x K <= `ExpertTiers.PARTIAL_PAIRS`: decode steps, small batches) from its token rows
(one process, latency and all-gather modes) takes `ExpertTiers.partial` instead, which needs no sort: the
ids, weights and token rows go to the host in one wait, after the hot pairs are launched through the
decode pair kernels where the experts run on ThunderEP's kernels; the host-path slots compute on the token
rows and come back weighted and summed per token, T rows. Fewer device launches per layer call is the point:
at batch 1 a decode step is bound by the host's launches, not by the experts. Where the device's stream can
wait for host memory (`thunderep.moe.host_jobs`, `TierConfig.host_thread`) and the hot pairs need no host
knowledge (the pair kernels took them, or none is hot), the counting and the host-path slots are a host
job (`thunderep.moe.tier_handoff`; ThunderEP's native threads, or TorchScript: no Python): the launching
thread queues the stream's wait for the job and the copy of its sums, and goes on launching the next layers
while the host computes.

The hot set is first the first H slots, then chosen from measured load by the rule of
`thunderep.moe.hot_set` (`HotSetRule`, which `ExpertTiers` extends). The weights are the same bytes in
both tiers, so the hot set never changes an output. On a CPU-only machine the device is the host: every
path runs, with the host's memory standing in for the device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from ..errors import ConfigError
from ..kernels.graphs import in_graph_steps
from .host_experts import HostExperts, per_slot
from .host_jobs import jobs_for
from .hot_set import HotSetRule
from .tier_graphs import GraphCall, GraphHandoff
from .tier_handoff import HostHandoff
from .tier_mapped import IN_PLACE, MappedReads
from .offload_cost import OffloadCosts, best_seconds, split_cold
from .staging import SlotTable, Staging, to_device, to_host, to_host_all
from .tier_config import COLD_PATHS, HOST_THREAD, TierConfig, TierStats, parse_memory

__all__ = ["COLD_PATHS", "ExpertTiers", "HOST_THREAD", "Staging", "TierConfig", "TierStats", "parse_memory", "to_host",
           "to_host_all"]


class ExpertTiers(MappedReads, HotSetRule, HostHandoff, GraphHandoff):
    """The tiers of one layer's local slots (see the module docstring).

    host: {tensor name: [S, ...]} in host memory. hot_slots: H >= 0 slots to hold on `device`.
    compute(weights, x_MD, slot_M): the experts function on `weights` ({name: [n, ...]}), row m using
    entry slot_M[m]; returns [M, D] unweighted. staging: the shared `Staging` of this layer's shapes.
    host_fn(host, slots, x_MD, counts, out=None): the host function (`thunderep.moe.host_experts`);
    default: `compute` one slot at a time. Where it is a `HostExperts` (the plain gated layout), its
    products also compute the staged slots and, with `lean_hot` and up to LEAN_HOT_SLOTS slots with rows,
    the hot ones (for an experts function that waits for the host, as transformers' grouped one does; one
    that takes a decode step's rows in a few launches, ThunderEP's kernels, runs them itself).
    pairs(weights, x_TD, local_TK, weights_TK, kind="sorted"): the decode pair kernels' weighted [T, D] share
    on `weights` (local_TK -1: a pair they do not hold), or None where they do not apply; None: no such
    kernels (`partial`). kind "in place": weights only they can read (the mapped path), any token count.
    """

    LEAN_HOT_SLOTS = 8  # hot slots with rows up to which each computes apart (a decode step's few)
    FEW_PAIRS = 8  # device pairs of a `partial` call up to which each is added apart (no index copies)
    PARTIAL_PAIRS = 128  # pairs (T x K) up to which a call from token rows takes `partial`: decode, small batches

    def __init__(self, host: dict[str, torch.Tensor], hot_slots: int, device: torch.device, compute: Callable,
                 costs: OffloadCosts, staging: Staging, config: TierConfig | None = None,
                 host_fn: Callable | None = None, lean_hot: bool = True, pairs: Callable | None = None,
                 name: str = "an offloaded layer"):
        self.host, self.device, self.compute, self.costs = host, torch.device(device), compute, costs
        self.name = name
        self.host_fn = host_fn or per_slot(compute)
        # the plain gated layout's two products, for the staged slots and a decode step's hot ones on the
        # device: transformers' experts function waits for the device (docs/benchmarks, expert offload)
        self.lean = host_fn if isinstance(host_fn, HostExperts) else None
        self.lean_hot, self.pairs = lean_hot, pairs
        self._tables: dict[str, SlotTable] = {}  # the device's slot tables (`_table`), made on first use
        self._stale: set[str] = set()  # those to write again before their next use
        self._chosen_at = -1  # the call count of the last re-choice: at most one a call
        self.staging, self.config = staging, config or TierConfig()
        self.jobs = jobs_for(self.config, self.device)
        self._job = None  # this layer's last job on the host (`settle`)
        self._host_buffers: dict[int, torch.Tensor] = {}  # `_pinned_copies`
        self._views: dict[tuple, torch.Tensor] = {}  # (key, shape, dtype) -> its view of a host buffer
        self._handoff: tuple | None = None  # (what `_handoff_args` depends on, its answer)
        self._graph_calls: dict[tuple, GraphCall] = {}  # the calls CUDA graphs captured, by shape (`tier_graphs`)
        self._graph_refused: dict[tuple, tuple[type, str]] = {}  # call shapes a graph cannot take: (error, why)
        first = next(iter(host.values()))
        self.num_slots = first.shape[0]
        if not 0 <= hot_slots <= self.num_slots:
            raise ConfigError(f"hot slots must be between 0 and {self.num_slots}, got {hot_slots}")
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in host.values())
        self.slot_params = sum(t[0].numel() for t in host.values())
        self.hot = {n: torch.empty((hot_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
                    for n, t in host.items()}
        self.hot_slots: list[int] = []
        self._counting()  # rows per slot in all (calibration) and their load EMA (`HotSetRule`)
        self.calls = 0
        self.stats = TierStats()
        self._no_mapping()
        self.set_hot(list(range(hot_slots)), count=False)

    @property
    def capacity(self) -> int:
        return next(iter(self.hot.values())).shape[0]

    def set_hot(self, slots: list[int], count: bool = True) -> None:
        """Make `slots` (H distinct local slots) the hot set, copying in only the weights of slots not hot
        yet (into the rows the leaving slots free). Between calls only."""
        self.settle()
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
        self._hot_mask = torch.zeros(self.num_slots, dtype=torch.bool)  # a new one: a job may hold the old
        self._hot_mask[list(self._row_of)] = True
        self._stale |= {"hot", "both"}
        self.choose_mapped()
        if count and entering:
            self.stats.bytes_promoted += len(entering) * self.slot_bytes
            self.stats.hot_changes += 1

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
        seconds = best_seconds(lambda: self._stream(chosen, xs, {}), self.device, repeats)
        self.stats = kept
        return seconds / len(chosen)

    # -- the compute

    def paths(self, rows: list[int], row_bytes: int) -> list[str]:
        """The path of each cold slot of a call with rows[j] rows: forced, or `split_cold`'s choice from the
        cost model (on CUDA the host's slots and the streamed ones overlap)."""
        if self.config.cold_path != "auto":  # forced ("mapped": a slot the device did not read in place streams)
            return [{"mapped": "stream"}.get(self.config.cold_path, self.config.cold_path)] * len(rows)
        c, P = self.costs, self.slot_params
        return split_cold([c.host_seconds(n, P, row_bytes) for n in rows],
                          [c.stream_seconds(n, P, self.slot_bytes) for n in rows], self.device.type == "cuda")

    def partial(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor | None:
        """The call's weighted float32 [T, D] share from its token rows, or None where the rows go through
        `sorted` instead (gradients; more than PARTIAL_PAIRS pairs, except in the steps CUDA graphs capture,
        `graph_steps`, where a call of any size takes it: `sorted` waits for the counts). local_TK: int64
        [T, K] local slot of each pair on the device, -1 for a pair another rank computes; weights_TK: [T, K].
        One wait for the host:
          1. the ids, the weights and the token rows queued to pinned host memory;
          2. the hot pairs launched through `pairs` (the decode pair kernels), before the wait, and the mapped
             slots' pairs through them on the mapped host weights (`tier_mapped`; the host skips those), both
             in the same launches where the kernels take two sets of tensors (16-bit experts);
          3. with host jobs (`jobs`: `pairs` took the hot pairs, or none is hot), 4 and 5 are a job
             (`_handed_off`) and this thread waits for nothing; else the wait here, and the call's rows per
             slot counted on the host;
          4. on the device, queued: hot pairs `pairs` did not take (two products per slot, or the experts
             function), the streamed slots; their outputs weighted and added per token (a decode step's few
             one by one with their weights as numbers, more in one launch);
          5. meanwhile on the host: every host-path slot on its token rows, weighted and summed per token
             there, sent back in one copy: T rows, not one per pair."""
        T, K = local_TK.shape
        graphed = in_graph_steps()
        if (T * K > self.PARTIAL_PAIRS and not graphed) or (torch.is_grad_enabled() and x_TD.requires_grad):
            return None
        self.settle()
        row_bytes = x_TD.shape[-1] * x_TD.element_size()
        if graphed:  # a step CUDA graphs capture (`tier_graphs`), or the eager one before a capture
            captured = self._graph_partial(x_TD, local_TK, weights_TK, row_bytes)
            if captured is not None:
                return captured
        self.rechoose(row_bytes)
        job_args = self._handoff_args(row_bytes, T) if self.pairs is not None or not self.capacity else None
        tensors = [local_TK, weights_TK, x_TD]
        host, copied = self._pinned_copies(tensors) if job_args is not None else to_host_all(tensors)
        on_device, hot_done, self._job_mapped = self._device_shares(x_TD, local_TK, weights_TK)
        if job_args is not None and (hot_done or not self.capacity):
            mask = self._device_mask if self._job_mapped else self._hot_mask
            return self._handed_off(on_device, host, copied, x_TD.shape, job_args, mask)
        if copied is not None:
            copied.synchronize()
        if self.jobs is not None:  # other layers' jobs first: the host function's scratch buffers are shared
            self.jobs.drain()
        ids_h, w_h, x_h = host
        by_slot, counts = self._tally([s for row in ids_h.tolist() for s in row])  # one torch call
        D, device = x_TD.shape[-1], x_TD.device
        y_TD = on_device[0].float() if on_device else torch.zeros(T, D, dtype=torch.float32, device=device)
        for y in on_device[1:]:
            y_TD += y
        hot, cold = self._split(by_slot, counts, self._job_mapped)
        paths = dict(zip(cold, self.paths([counts[s] for s in cold], row_bytes)))
        later = ([] if hot_done else hot) + [s for s in cold if paths[s] == "stream"]  # on the device
        if later:
            pieces = self._on_device(x_TD, {s: [n // K for n in by_slot[s]] for s in later}, [] if hot_done else hot)
            pairs = [n for s in later for n in by_slot[s]]
            w_N = w_h.reshape(-1).float()
            if len(pairs) <= self.FEW_PAIRS:  # a decode step's few: each added with its weight, no copies
                w = w_N.tolist()
                for n, y_1D in zip(pairs, [y for s in later for y in pieces[s].split(1)]):
                    y_TD[n // K:n // K + 1].add_(y_1D, alpha=w[n])
            else:
                y_ND, pairs = torch.cat([pieces[s] for s in later]), torch.tensor(pairs)
                y_TD.index_add_(0, to_device(pairs // K, device), y_ND.float() * to_device(w_N[pairs], device)[:, None])
        on_host = [s for s in cold if paths[s] == "host"]
        if on_host:
            cuda = device.type == "cuda"
            out = torch.empty((T, D), dtype=torch.float32, pin_memory=cuda)
            y_TD += self._summed_on_host(on_host, by_slot, counts, x_h, w_h, out).to(device, non_blocking=cuda)
        return y_TD

    def _device_shares(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor,
                       any_tokens: bool = False):
        """(the device's weighted [T, D] shares of a `partial` call, whether they include the hot pairs, whether
        they include the mapped slots' pairs): the hot and mapped pairs through the pair kernels, in one call
        where the kernels take two sets of tensors (`_both_pairs`), else each in its own. any_tokens: the pair
        kernels take the hot pairs at any number of tokens (kind "in place"; a captured call has no other
        device path for them), not only where they are the faster path."""
        hot_TD = mapped_TD = None
        kind = {"kind": IN_PLACE} if any_tokens else {}
        both_TD = self._both_pairs(x_TD, local_TK, weights_TK, **kind)
        if both_TD is None:
            if self.pairs is not None and self.capacity:
                hot_TD = self.pairs(self.hot, x_TD, self._hot_entries(local_TK.device)[local_TK], weights_TK, **kind)
            mapped_TD = self._mapped_pairs(x_TD, local_TK, weights_TK)
        on_device = [y for y in (both_TD, hot_TD, mapped_TD) if y is not None]
        return on_device, both_TD is not None or hot_TD is not None, both_TD is not None or mapped_TD is not None

    def settle(self) -> None:
        """Wait for this layer's jobs on the host, if any is out (its eager call's, its captured calls',
        `tier_graphs`), and count their pairs (as an in-line call counts them); raise a failed job's error:
        before anything reads or changes the counts, the hot set or the telemetry."""
        job, self._job = self._job, None
        if job is not None:
            self._count_job(job, self._job_mapped)
        self._settle_graph_calls()
        if self.jobs is not None:
            self.jobs.check()

    def _count_job(self, job, mapped: bool) -> None:
        """A job's pairs counted (`_tally`) once it has ended; its failure raised, naming the layer."""
        ids = job.result()
        if ids is not None:
            by_slot, counts = self._tally(ids)
            _, cold = self._split(by_slot, counts, mapped)
            self.stats.rows_host += sum(counts[s] for s in cold)
            self.stats.host_seconds += getattr(job.future, "seconds", None) or 0.0  # the native engine's timing

    def _tally(self, ids: list[int]) -> tuple[dict[int, list[int]], list[int]]:
        """({slot: its pairs t * K + k, in order}, rows per slot) of a call's flat ids (-1: another rank's
        pair), counted into the load statistics (`_observe`)."""
        by_slot: dict[int, list[int]] = {}
        for n, s in enumerate(ids):
            if s >= 0:
                by_slot.setdefault(s, []).append(n)
        counts = [0] * self.num_slots
        for s, pairs in by_slot.items():
            counts[s] = len(pairs)
        self._observe({s: counts[s] for s in by_slot})
        return by_slot, counts

    def _split(self, by_slot: dict, counts: list[int], mapped: bool = False) -> tuple[list[int], list[int]]:
        """(hot, cold) slots of a call's `by_slot`, each in slot order, the cold ones without the mapped slots
        where the device read those (`mapped`); its hot and mapped rows counted in the telemetry."""
        hot = [s for s in sorted(by_slot) if s in self._row_of]
        self.stats.rows_hot += sum(counts[s] for s in hot)
        skip = self._count_mapped(by_slot, counts) if mapped else ()
        return hot, [s for s in sorted(by_slot) if s not in self._row_of and s not in skip]

    def _hot_entries(self, device: torch.device) -> torch.Tensor:
        """Each slot's entry in the hot copies (-1 for cold ones) on `device`."""
        return self._table("hot", device)

    def _table(self, key: str, device: torch.device) -> torch.Tensor:
        """The device's slot table `key` ("hot": the hot copies' rows; "mapped", "both": `tier_mapped`'s), a
        `SlotTable` made on first use and written with `_entries(key)` where that changed since (`_stale`)."""
        table = self._tables.get(key)
        if table is None or table.device != device:
            table = self._tables[key] = SlotTable(self.num_slots, device)
            self._stale.add(key)
        if key in self._stale:
            table.set(self._entries(key))
            self._stale.discard(key)
        return table.values

    def _on_device(self, x_TD: torch.Tensor, tokens: dict[int, list[int]], hot: list[int]) -> dict:
        """{slot: its rows' outputs [n, D]} for the slots in `tokens` (slot -> the token of each of its rows)
        computed on the device: the hot ones in `hot` on the hot copies, the others streamed."""
        xs = {s: x_TD[t[0]:t[0] + 1] if len(t) == 1 else x_TD[to_device(torch.tensor(t), x_TD.device)]
              for s, t in tokens.items()}
        pieces: dict[int, torch.Tensor] = {}
        if self.lean is not None and self.lean_hot and len(hot) <= self.LEAN_HOT_SLOTS:
            pieces.update((s, self.lean.slot(self.hot, self._row_of[s], xs[s])) for s in hot)
        elif hot:
            x_hot, slot_M = self._hot_rows(hot, xs)
            pieces.update(zip(hot, self.compute(self.hot, x_hot, slot_M).split([xs[s].shape[0] for s in hot])))
        streamed = [s for s in tokens if s not in self._row_of]
        self._stream(streamed, [xs[s] for s in streamed], pieces)
        return pieces

    def _summed_on_host(self, slots: list[int], by_slot: dict, counts: list[int], x_TD: torch.Tensor,
                        w_TK: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The host function on the host token rows x_TD of `slots`' pairs (by_slot: slot -> its pairs t K + k),
        weighted by w_TK and summed per token into `out` (float32 [T, D] on the host), returned: one TorchScript
        call where the host function has it (`HostExperts.summed`), the same bits as the products one by one."""
        K = w_TK.shape[-1]
        pairs = [n for s in slots for n in by_slot[s]]
        w = [v for row in w_TK.tolist() for v in row]
        rows, started = [counts[s] for s in slots], time.perf_counter()
        if self.lean is not None and self.lean.summed(self.host, slots, rows, [n // K for n in pairs],
                                                      [w[n] for n in pairs], x_TD, out) is not None:
            self.stats.hosted(len(pairs), started)
            return out
        w_M = torch.tensor([w[n] for n in pairs], dtype=torch.float32)
        out.zero_()
        if x_TD.shape[0] == 1:  # a decode step of one token: every pair's row is its row, no gather
            return out.addmm_(w_M[None], self._host_call(slots, rows, x_TD.expand(len(pairs), -1)).float())
        token_M = torch.tensor([n // K for n in pairs])
        return out.index_add_(0, token_M, self._host_call(slots, rows, x_TD[token_M]).float() * w_M[:, None])

    def sorted(self, x_MD: torch.Tensor, counts_S: torch.Tensor) -> torch.Tensor:
        """Unweighted [M, D] outputs of rows grouped by local slot; counts_S int64 [S] on the host.
        Differentiable in x_MD (the experts themselves are frozen: `_TieredRows`)."""
        if torch.is_grad_enabled() and x_MD.requires_grad:
            return _TieredRows.apply(x_MD, self, counts_S)
        return self._sorted(x_MD, counts_S)

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

    def _sorted(self, x_MD: torch.Tensor, counts_S: torch.Tensor) -> torch.Tensor:
        self.settle()
        if self.jobs is not None:  # every layer's: the host function's scratch buffers are shared by layers
            self.jobs.drain()
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
            if self.lean is not None and self.lean_hot and len(hot) <= self.LEAN_HOT_SLOTS:
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
            return x_hot, to_device(torch.tensor(entries, dtype=torch.int64), device)
        slot_M = torch.repeat_interleave(torch.tensor([self._row_of[s] for s in hot], device=device),
                                         torch.tensor(rows, device=device), output_size=x_hot.shape[0])
        return x_hot, slot_M

    def _on_host(self, slots: list[int], counts: list[int], x_MD: torch.Tensor, copied, device: torch.device):
        """The host function on the host rows x_MD (after `copied`), its [M, D] outputs in a pinned buffer
        sent to `device` in one non-blocking copy; returns them split per slot."""
        cuda = device.type == "cuda"
        out = torch.empty(x_MD.shape, dtype=x_MD.dtype, pin_memory=True) if cuda else None
        return self._host_call(slots, counts, x_MD, copied, out).to(device, non_blocking=cuda).split(counts)

    def _host_call(self, slots: list[int], counts: list[int], x_MD: torch.Tensor, copied=None, out=None):
        """The host function on the host rows x_MD of `slots` (after the copy `copied`), into `out` where
        given; its rows and seconds counted in the telemetry."""
        started = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        y_MD = self.host_fn(self.host, slots, x_MD, counts, out=out)
        self.stats.hosted(x_MD.shape[0], started)
        return y_MD

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


def _slot_rows(x_MD: torch.Tensor, counts: list[int]) -> dict[int, torch.Tensor]:
    """{slot: its rows of x_MD (grouped by slot per counts), a view} for the slots with rows, in slot order:
    a layer call at decode has rows in a few of its slots, and splitting into every slot cost more host
    time than the rest of the call's bookkeeping."""
    used = [s for s, n in enumerate(counts) if n]
    return dict(zip(used, x_MD.split([counts[s] for s in used])))

