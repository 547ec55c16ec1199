"""Continuous batching over a preallocated KV cache, each decode step replayed from a CUDA graph.

`DecodeBatch` (engine.py) runs every decode step as eager PyTorch: hundreds of kernel launches per
step, each paying host time, so a small batch waits on the host, not the GPU
(docs/BENCHMARKS.md, "Serving on 2 H200s"). `StaticDecodeBatch` keeps the same sequences, prefill and
sampling, but holds the cache in fixed storage so that a step's shapes depend only on the batch size:

* storage: per layer, keys and values [rows, heads, capacity, head_dim]; row r is sequence r,
  left-padded so that every sequence's next token goes to the same column `length`; a [rows,
  capacity] mask marks the columns that hold a token. `rows` is the largest bucket the batch has
  needed so far (at most max_batch), `capacity` a power of 2 from MIN_CAPACITY;
* a step feeds the batch padded to a bucket size (1, 2, 4, ..., max_batch); the rows past the batch
  are idle sequences that attend only to their own columns, and their logits are dropped;
* the model sees a 4D attention mask built from the storage mask (so transformers' mask code, which
  checks the mask on the host, is skipped), the position of each row, and a cache whose layers write
  at `length` (a device counter) and return the whole storage view;
* on CUDA the first step at a bucket runs eagerly (autotuning, lazy initialisation, NCCL set-up), the
  second is captured in a CUDA graph (all buckets share one memory pool, a new one with each new
  storage) and every later step at that bucket replays it: a handful of launches per step instead of
  hundreds;
* when the sequences need more columns than the storage has, the columns that only padding holds are
  cut first; if that is not enough the storage doubles and the graphs are captured again. More rows
  (a larger bucket) also mean new storage and new graphs. When the batch is empty and the storage is
  at least 4 times as wide as the next prompt needs, it is allocated again at that width, so that one
  long sequence does not leave every later step attending over its length.

The experts run in latency mode with `capturable=True` (`ThunderMoE.running`): every (token, k) pair
goes through the local experts at a fixed shape, with no host sync. A capture that fails (an experts
implementation that syncs, e.g. transformers' `eager` loop) turns graphs off for this batch with one
message, and the same steps run eagerly on the same storage (the device's random generator left
usable: `thunderep.kernels.graphs`). A capture that declines its batch size alone (GraphDeclined: offloaded
experts whose tokens would share slots, `thunderep.moe.tier_graphs`) runs that size eagerly, with one message,
and keeps graphs at the others.

`static_reason(model)` names what this path cannot run (None: it can): attention other than `sdpa`
or `eager`, and any cache `DecodeBatch` cannot merge. `close()` releases the storage and the graphs.

Shapes: B storage rows, C storage columns (capacity), H key / value heads, hd head size.
"""

from __future__ import annotations

import collections
import contextlib
import sys

import torch

from ..hf.wrap import decode_attention
from ..kernels.graphs import capture, replay
from .engine import DecodeBatch, new_cache, unsupported_reason
from ..errors import ConfigError, GraphDeclined

__all__ = ["StaticDecodeBatch", "static_reason"]

MIN_CAPACITY = 256  # columns of the first storage; it doubles from there


def static_reason(model) -> str | None:
    """Why `StaticDecodeBatch` cannot run this model (None: it can)."""
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    attention = getattr(model.config.get_text_config(), "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        return f"its attention implementation is {attention!r} (the static cache needs 'sdpa' or 'eager')"
    return None


def buckets(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def _slot_layer_class():
    from transformers.cache_utils import StaticLayer

    class SlotLayer(StaticLayer):
        """A static cache layer over a view of the batch's storage, writing at a shared device counter."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.cumulative_length = keys, values, length
            self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]

        def update(self, key_states, value_states, *args, **kwargs):
            at = self.cumulative_length + torch.arange(key_states.shape[-2], device=key_states.device)
            self.cumulative_length.add_(key_states.shape[-2])
            self.keys.index_copy_(2, at, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, at, value_states.to(self.values.dtype))
            return self.keys, self.values

    return SlotLayer


class StaticDecodeBatch(DecodeBatch):
    """`DecodeBatch` over fixed storage for up to `max_batch` sequences, its steps in CUDA graphs where
    `graphs` (default: on CUDA devices; True on another device is a ConfigError: a CUDA graph captures
    nothing of its work, and replays would return stale logits). Same interface and the same tokens as
    `DecodeBatch`."""

    def __init__(self, tm, device: torch.device, eos: set[int], pad: int, max_batch: int,
                 graphs: bool | None = None):
        super().__init__(tm, device, eos, pad)
        if graphs and self.device.type != "cuda":
            raise ConfigError(f"graphs=True needs a CUDA device (CUDA graphs capture CUDA work only); this batch "
                              f"decodes on {self.device}: pass graphs=None or False")
        self.max_batch, self.buckets = max_batch, buckets(max_batch)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.capacity, self.row_capacity, self.length = 0, 0, 0  # storage columns and rows; the write column
        self.keys = self.values = self.counters = None  # per layer: [B, H, C, hd] x 2, [] int64
        self.store_mask = self.store_ids = None  # [B, C] int64 (1: the column holds a token), [B, 1] int64
        self._caches: dict[int, object] = {}
        self._graphs: dict[int, tuple] = {}
        self._warm: set[int] = set()
        self._eager_sizes: set[int] = set()  # batch sizes a capture declined (GraphDeclined): eager at any storage
        self._pool = None
        # what a steady server does not do, counted for its slow-step reports: "graph capture",
        # "storage reallocation" (which drops the graphs)
        self.events: collections.Counter = collections.Counter()
        attention = getattr(self.model.config.get_text_config(), "_attn_implementation", "sdpa")
        self._additive = attention == "eager"

    # -- DecodeBatch's hooks

    def step(self) -> list[tuple[int, int | None, str | None]]:
        if not self.rows:
            return []
        self._ensure_room(self.length + 1)
        b = next(size for size in self.buckets if size >= len(self.rows))
        self.store_mask[:, self.length] = 1  # the token fed now, for every row of the storage
        logits = self._run(b)
        self.length += 1
        self._views()
        return self._emit(logits[:len(self.rows)], first=0)

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def close(self) -> None:
        """Drop every sequence and release the storage and the captured graphs (the batch can be used
        again: the next admission allocates anew)."""
        self.reset()
        self.keys = self.values = self.counters = self.store_mask = self.store_ids = None
        self.capacity = self.row_capacity = 0
        self._caches, self._graphs, self._warm, self._pool = {}, {}, set(), None

    def _merge(self, rows, cache, mask: torch.Tensor) -> None:
        n, width = mask.shape
        old = len(self.rows)
        if old + n > self.max_batch:
            raise ConfigError(f"{old} + {n} sequences exceed max_batch ({self.max_batch}): admit at most "
                              f"{self.max_batch - old} now, or make the batch with a larger max_batch")
        if old == 0:
            self.length = 0
        if self.keys is None or old + n > self.row_capacity or (
                old == 0 and self.capacity >= 4 * max(MIN_CAPACITY, width + 1)):
            # first use, more rows, or an empty batch on storage a long sequence left much too wide
            self._allocate([(layer.keys, layer.values) for layer in cache.layers], old + n,
                           width + 1 if old == 0 else max(self.length, width) + 1)
        shift = max(0, width - self.length)
        self._ensure_room(self.length + shift + 1)
        if shift and old:  # the running rows move right so the new prompts fit before the write column
            self._move(slice(0, old), 0, self.length, shift)
        self.length += shift
        new, start = slice(old, old + n), self.length - width
        for keys, values, layer in zip(self.keys, self.values, cache.layers):
            _columns(keys, new, start, self.length).copy_(layer.keys)
            _columns(values, new, start, self.length).copy_(layer.values)
        self.store_mask[new] = 0
        self.store_mask[new, start:self.length] = mask
        self.store_ids[new] = 0
        self._set_counters()
        self.rows = self.rows + rows
        self._views()

    def _drop(self, keep: list[int]) -> None:
        if not keep:
            self.reset()
            return
        index = torch.tensor(keep, device=self.device)
        for t in self.keys + self.values + [self.store_mask, self.store_ids]:
            t[:len(keep)] = t[index]
        self.store_mask[len(keep):] = 0
        self.rows = [self.rows[i] for i in keep]
        self._views()

    # -- storage

    def _views(self) -> None:
        """DecodeBatch's mask [n, length] and next ids [n, 1]: views of the storage's first n rows."""
        self.mask = self.store_mask[:len(self.rows), :self.length]
        self.next_ids = self.store_ids[:len(self.rows)]

    def _set_counters(self) -> None:
        """Every layer's write column (a device counter, read by the captured graphs) to `length`."""
        for counter in self.counters:
            counter.fill_(self.length)

    def _allocate(self, like: list[tuple[torch.Tensor, torch.Tensor]], rows: int, columns: int) -> None:
        """Storage for `rows` rows (rounded up to a bucket) of `columns` columns (a power of 2, at least
        MIN_CAPACITY), heads, head sizes and dtypes as in `like` (keys, values per layer), the rows in use
        copied over. Drops the graphs, which were captured on the old storage."""
        capacity = MIN_CAPACITY
        while capacity < columns:
            capacity *= 2
        B = next(size for size in self.buckets if size >= rows)
        # every new tensor first: an allocation that fails (out of memory) leaves the batch as it was
        keys = [k.new_zeros(B, k.shape[1], capacity, k.shape[3]) for k, _ in like]
        values = [v.new_zeros(B, v.shape[1], capacity, v.shape[3]) for _, v in like]
        store_mask = torch.zeros(B, capacity, dtype=torch.int64, device=self.device)
        store_ids = torch.full((B, 1), self.pad, dtype=torch.int64, device=self.device)
        if self.rows:  # the rows in use keep their columns (storage shrinks only when empty)
            live = slice(0, len(self.rows))
            for new, prev in zip(keys + values + [store_mask], self.keys + self.values + [self.store_mask]):
                _columns(new, live, 0, self.length).copy_(_columns(prev, live, 0, self.length))
            store_ids[live] = self.store_ids[live]
        self.keys, self.values, self.store_mask, self.store_ids = keys, values, store_mask, store_ids
        self.counters = [torch.full((), self.length, dtype=torch.int64, device=self.device) for _ in self.keys]
        self.capacity, self.row_capacity = capacity, B
        self.events["storage reallocation"] += 1
        # The graphs were captured on the old storage. Their memory pool goes with them: torch's allocator
        # drops a pool once no graph holds it, and a capture into a dropped pool's handle fails an
        # internal assert, so the next capture takes a fresh handle.
        self._caches, self._graphs, self._warm, self._pool = {}, {}, set(), None
        self._views()

    def _ensure_room(self, columns: int) -> None:
        """Room for `columns` columns: cut the leading columns only padding holds, else grow."""
        if columns <= self.capacity:
            return
        if self.rows:
            used = self.store_mask[:len(self.rows), :self.length]
            lead = int((used.cumsum(1) == 0).sum(1).min())
            if lead:
                self._move(slice(0, len(self.rows)), lead, self.length - lead, -lead)
                self.length -= lead
                self._set_counters()
                columns -= lead
        if columns > self.capacity:
            self._allocate(list(zip(self.keys, self.values)), self.row_capacity, columns)

    def _move(self, rows: slice, start: int, count: int, by: int) -> None:
        """Columns [start, start + count) of `rows` to [start + by, ...); the columns left behind are cleared."""
        tensors = self.keys + self.values + [self.store_mask]
        blocks = [_columns(t, rows, start, start + count).clone() for t in tensors]  # before any write
        for t, block in zip(tensors, blocks):
            _columns(t, rows, min(start, start + by), max(start, start + by) + count).zero_()
            _columns(t, rows, start + by, start + by + count).copy_(block)

    # -- the step

    def _cache(self, b: int):
        if b not in self._caches:
            layer = _slot_layer_class()
            cache = new_cache(self.model)
            cache.layers = [layer(k[:b], v[:b], c) for k, v, c in zip(self.keys, self.values, self.counters)]
            self._caches[b] = cache
        return self._caches[b]

    def _forward_static(self, b: int) -> torch.Tensor:
        mask = self.store_mask[:b]
        positions = mask.sum(-1, keepdim=True) - 1
        seen = mask[:, None, None, :].bool()
        if self._additive:
            dtype = self.keys[0].dtype
            seen = torch.zeros(seen.shape, dtype=dtype, device=self.device).masked_fill(~seen, torch.finfo(dtype).min)
        running = (self.tm.running("latency", capturable=True) if hasattr(self.tm, "running")
                   else contextlib.nullcontext())
        with torch.no_grad(), running, decode_attention():
            out = self.model(input_ids=self.store_ids[:b], attention_mask=seen, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **{self.cache_arg: self._cache(b)})
        return out.logits[:, -1].float()

    def _run(self, b: int) -> torch.Tensor:
        if not self.graphs:
            return self._forward_static(b)
        if b in self._graphs:
            graph, logits = self._graphs[b]
            replay(graph)
            return logits
        if b not in self._warm or b in self._eager_sizes:  # the first step at a size runs eagerly: it warms up
            self._warm.add(b)
            return self._forward_static(b)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with capture(graph, self._pool):
                logits = self._forward_static(b)
        except GraphDeclined as exc:  # this size runs better eagerly: the other sizes keep their graphs
            self._eager_sizes.add(b)
            print(f"[thunderep] decoding {b} sequences eagerly: {str(exc).splitlines()[0][:300]}", file=sys.stderr,
                  flush=True)
            return self._forward_static(b)
        except Exception as exc:  # noqa: BLE001 - a sync or an uncapturable op: run eagerly from now on
            self.graphs = False
            print(f"[thunderep] CUDA graphs off for decoding: capturing a step failed ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:200]}); steps run eagerly", file=sys.stderr, flush=True)
            return self._forward_static(b)
        self._graphs[b] = (graph, logits)
        self.events["graph capture"] += 1
        replay(graph)
        return logits


def _columns(t: torch.Tensor, rows: slice, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of storage `t` (keys / values [B, H, C, hd], or the mask [B, C]), rows `rows`."""
    return t[rows, :, start:stop] if t.dim() == 4 else t[rows, start:stop]
