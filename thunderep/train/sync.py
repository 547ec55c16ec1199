"""Gradient synchronization for expert-parallel training.

Objective: each rank's loss is the mean over its own tokens, and training minimises the mean of the
ranks' losses (as torch DDP does). Then:

* replicated parameters (attention, norms, router, shared experts, embeddings) hold a local gradient;
  "every_step" averages it over all ranks after every backward (bucketed, launched during backward);
  "delta" lets every rank take H local optimizer steps and then averages the parameter change and
  applies an outer Nesterov-momentum step (DiLoCo);
* expert parameters live on the ranks holding their slots; the all-to-all backward already delivers
  the gradient from every rank's tokens, so they are never all-reduced: only scaled by 1 / world. An
  expert held by several ranks (a redundant slot, or the same slot in several data-parallel
  replicas) sums its gradient among exactly those holders.

`SyncStats` counts bytes (payload each rank hands to all-reduce) and seconds per step.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import SyncConfig
from ..comm.groups import peer_errors, wait_work
from ..moe.ep import moe_layers
from ..moe.replicas import replica_groups, sum_replica_grads

__all__ = ["GradSync", "SyncStats", "expert_layers"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SyncStats:
    """Per-step and total gradient-synchronization cost of this rank."""

    steps: int = 0
    total_bytes: int = 0
    total_seconds: float = 0.0
    expert_bytes: int = 0
    last_step_bytes: int = 0
    last_step_seconds: float = 0.0
    history: list = field(default_factory=list)  # (step, bytes, seconds)

    def record(self, nbytes: int, seconds: float, expert: bool = False) -> None:
        self.last_step_bytes += nbytes
        self.last_step_seconds += seconds
        self.total_bytes += nbytes
        self.total_seconds += seconds
        if expert:
            self.expert_bytes += nbytes

    def end_step(self) -> None:
        self.history.append((self.steps, self.last_step_bytes, self.last_step_seconds))
        self.steps += 1
        self.last_step_bytes, self.last_step_seconds = 0, 0.0


def expert_layers(model: nn.Module) -> list[tuple[object, object, list[nn.Parameter]]]:
    """(ExpertParallel runtime, Placement, expert parameters with one leading entry per local slot) of
    every expert-parallel layer of `model` (`thunderep.moe.ep.moe_layers`)."""
    return [(layer.core.ep, layer.core.placement, layer.parameters()) for layer in moe_layers(model)
            if layer.core is not None]


@contextlib.contextmanager
def _grads_set_aside(params):
    """Within the block the parameters have no gradient (an optimizer step skips them); restored after."""
    held = [(p, p.grad) for p in params]
    for p, _ in held:
        p.grad = None
    try:
        yield
    finally:
        for p, g in held:
            p.grad = g


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0
        self.flat: torch.Tensor | None = None
        self.work = None
        self.started = 0.0


class GradSync:
    """Synchronizes a model's gradients / parameters among ranks (see the module docstring).

    Use: `sync = GradSync(model, ep, config)`; every step `loss.backward(); sync.finish();
    optimizer.step(); sync.after_step()`. Collective: every rank makes the same calls.
    model: a model of `ThunderMoELayer`s, or a wrapped Hugging Face model (`ThunderMoE`), whose
        `all_reduce_grads` is the plain, unbucketed alternative.
    group: the group of ranks holding replicas of the dense parameters (default: all ranks).
    """

    def __init__(self, model: nn.Module, ep=None, config: SyncConfig | None = None, group=None):
        self.model, self.ep, self.config = model, ep, config or SyncConfig()
        self.group = group
        self.world = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=ep.groups.timeout_s if ep is not None else 300.0)
        self.stats = SyncStats()
        self.step = 0
        expert_ids = set()
        self._expert_groups: list[tuple[nn.Parameter, int, object]] = []  # (param, slot, group)
        for ep_layer, placement, params in expert_layers(model):
            expert_ids.update(id(p) for p in params)
            self._expert_groups += replica_groups(ep_layer, placement, params, self.timeout)
        self.expert_params = [p for p in model.parameters() if id(p) in expert_ids and p.requires_grad]
        self.replicated = [p for p in model.parameters() if id(p) not in expert_ids and p.requires_grad]
        self._buckets = self._make_buckets(self.replicated)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._next_launch = 0
        self._accumulating = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.replicated]
        self._anchor: list[torch.Tensor] | None = None
        self._momentum: list[torch.Tensor] | None = None
        self._pending_delta = None

    def placement_changed(self) -> None:
        """Rebuild the expert-replica groups after a migration (collective: every rank calls it)."""
        self._expert_groups = []
        for ep_layer, placement, params in expert_layers(self.model):
            self._expert_groups += replica_groups(ep_layer, placement, params, self.timeout)

    # -- set-up

    def _make_buckets(self, params: list[nn.Parameter]) -> list[_Bucket]:
        limit = self.config.bucket_mb * 2**20
        buckets, current, size = [], [], 0
        for p in reversed(params):  # gradients arrive roughly in reverse order of definition
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- every-step gradient all-reduce

    @property
    def syncing_grads(self) -> bool:
        if self.world == 1:  # one rank: nothing to average
            return False
        return self.config.mode == "every_step" or self.step < self.config.warmup_steps

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: the backward passes inside the block only accumulate local gradients
        (no bucket is launched), as torch DDP's `no_sync`; the backward after the block launches the
        buckets with the accumulated gradients, and `finish()` follows as usual."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.syncing_grads or self._accumulating:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        # Buckets launch strictly in index order so that every rank issues the same collectives.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if not force and bucket.ready < len(bucket.params):
                return
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])
            if self.config.grad_dtype is not None:
                bucket.flat = bucket.flat.to(_DTYPES[self.config.grad_dtype])
            bucket.started = time.perf_counter()
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            self._next_launch += 1

    def _wait(self, work, what: str, on_cuda: bool) -> None:
        seconds = self.timeout.total_seconds()
        with peer_errors(f"gradient sync ({what})", f"{seconds:g} s", self.ep.control if self.ep is not None else None):
            wait_work(work, seconds, on_cuda)

    def finish(self) -> None:
        """Call after backward, before the optimizer step."""
        if self.syncing_grads:
            self._launch_ready(force=True)
            for bucket in self._buckets:
                self._complete(bucket)
            self._next_launch = 0
        elif self._anchor is None and self.world > 1:  # the first delta window starts with this step's parameters
            self._anchor = [p.detach().clone() for p in self.replicated]
            self._momentum = [torch.zeros_like(p) for p in self._anchor]
        self._sync_experts()

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """`finish()`, `optimizer.step()` and `after_step()` in one call, with the last bucket's
        all-reduce overlapped with the optimizer: its parameters are updated in a second
        `optimizer.step()` once it is in, the others in a first one while it is still on the wire.
        The last bucket becomes ready last (at the end of backward: in a language model, the input
        embedding's gradient), so nothing but the optimizer is left to hide it behind.

        For optimizers that update each parameter from its own gradient and state (SGD, Adam, AdamW,
        ...: torch's skip parameters without a gradient): the same result as the three calls. Not for
        code that needs every gradient at once between sync and step (clipping by the global norm:
        use the three calls). Every step hook of `optimizer` runs twice."""
        if not self.syncing_grads or len(self._buckets) < 2:
            self.finish()
            optimizer.step()
            self.after_step()
            return
        self._launch_ready(force=True)
        *early, last = self._buckets
        for bucket in early:
            self._complete(bucket)
        self._next_launch = 0
        self._sync_experts()
        late = {id(p) for p in last.params}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with _grads_set_aside(p for p in params if id(p) in late):
            optimizer.step()  # everything but the last bucket, while it is still being all-reduced
        self._complete(last)
        with _grads_set_aside(p for p in params if id(p) not in late):
            optimizer.step()  # the last bucket's parameters
        self.after_step()

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for a bucket's all-reduce and point its parameters' gradients at the averaged values."""
        self._wait(bucket.work, "gradient all-reduce", bucket.flat.is_cuda)
        self.stats.record(bucket.flat.numel() * bucket.flat.element_size(), time.perf_counter() - bucket.started)
        bucket.flat.div_(self.world)
        offset = 0
        for p in bucket.params:
            n = p.numel()
            p.grad = bucket.flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        bucket.ready, bucket.flat, bucket.work = 0, None, None

    def _sync_experts(self) -> None:
        for p in self.expert_params:
            if p.grad is not None:
                p.grad.div_(self.world)
        started = time.perf_counter()
        nbytes = sum_replica_grads(self._expert_groups,
                                   lambda work, flat: self._wait(work, "expert replica all-reduce", flat.is_cuda))
        if nbytes:
            self.stats.record(nbytes, time.perf_counter() - started, expert=True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient of the model so that their norm over all ranks is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` does for one process holding the whole model; returns that norm
        before clipping (the same on every rank). Call after `finish()` (the replicated gradients are
        then equal on every rank and counted once; an expert held by several ranks is counted once);
        collective. In delta mode the replicated gradients are each rank's own."""
        device = next((p.grad.device for p in self.replicated + self.expert_params if p.grad is not None), None)
        if device is None:
            return torch.zeros(())
        held = {}  # (parameter, slot) -> ranks holding that expert
        for p, slot, group in self._expert_groups:
            held[id(p), slot] = dist.get_world_size(group)
        experts = torch.zeros((), device=device, dtype=torch.float32)
        for p in self.expert_params:
            if p.grad is None:
                continue
            per_slot = p.grad.float().pow(2).reshape(p.grad.shape[0], -1).sum(1)
            share = torch.tensor([1.0 / held.get((id(p), s), 1) for s in range(per_slot.shape[0])], device=device)
            experts = experts + (per_slot * share).sum()
        if self.world > 1:
            dist.all_reduce(experts)
        replicated = sum((p.grad.float().pow(2).sum() for p in self.replicated if p.grad is not None),
                         torch.zeros((), device=device))
        norm = (experts + replicated).sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.replicated + self.expert_params:
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    # -- delta mode

    def after_step(self) -> None:
        """Call after the optimizer step: counts steps and runs the outer step at window ends."""
        self.step += 1
        c = self.config
        if (c.mode == "delta" and self.world > 1 and self.step > c.warmup_steps
                and (self.step - c.warmup_steps) % c.delta_steps == 0):
            self._outer_step()
        self.stats.end_step()

    def _launch_delta(self):
        dtype = _DTYPES[self.config.delta_dtype]
        flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(self._anchor, self.replicated)])
        flat = flat.to(dtype)
        started = time.perf_counter()
        return flat, dist.all_reduce(flat, group=self.group, async_op=True), started

    def _outer_step(self) -> None:
        """Average this window's parameter change and take the outer step from the anchor.

        With `overlap`, this window's all-reduce runs behind the next window and the previous
        window's (already averaged) change is applied instead: one window late. Either way every
        rank restarts the next window from the same anchor.
        """
        c = self.config
        launched = self._launch_delta()
        if c.overlap:
            launched, self._pending_delta = self._pending_delta, launched
        if launched is not None:
            flat, work, started = launched
            self._wait(work, "delta all-reduce", flat.is_cuda)
            self.stats.record(flat.numel() * flat.element_size(), time.perf_counter() - started)
            delta = flat.float().div_(self.world)
            offset = 0
            with torch.no_grad():
                for a, m in zip(self._anchor, self._momentum):
                    n = a.numel()
                    d = delta[offset:offset + n].view_as(a).to(m.dtype)
                    offset += n
                    m.mul_(c.outer_momentum).add_(d)
                    a.sub_(d + c.outer_momentum * m, alpha=c.outer_lr)  # Nesterov
        with torch.no_grad():
            for a, p in zip(self._anchor, self.replicated):
                p.copy_(a)
