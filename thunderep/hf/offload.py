"""Expert offload for a wrapped Hugging Face model: `from_pretrained(..., gpu_memory=...)`.

Each rank's experts modules keep all their local slots' weights in host memory (pinned where CUDA
exists), filled from the checkpoint as usual, and as many slots as fit `gpu_memory` (after the
replicated weights and the staging buffers) are also held on the device: `thunderep.moe.tiers`.
`plan_offload` sizes that on the meta model before anything is allocated; `attach_tiers` builds the tiers
after the checkpoint is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..moe.offload_cost import OffloadCosts, measure_costs
from ..moe.tiers import ExpertTiers, Staging, TierConfig, TierStats, parse_memory
from .experts import experts_compute_fn
from .fp8 import expert_weights, is_fp8
from .int4 import eager_on_dequantized, is_int4

__all__ = ["OffloadPlan", "attach_tiers", "check_host", "host_compute_fn", "host_experts", "offload_stats",
           "plan_offload", "summary_line"]


@dataclass(frozen=True)
class OffloadPlan:
    """One rank's tiers before loading. hot: {experts module path: hot slots}; slots: its local slots;
    slot_bytes: one slot's bytes; replicated_bytes / staging_bytes / hot_bytes: on the device;
    host_bytes: every local slot's weights, in host memory. experts: E per module."""

    gpu_memory: int
    hot: dict
    slots: dict
    slot_bytes: dict
    slot_params: dict
    experts: dict
    replicated_bytes: int
    staging_bytes: int

    @property
    def hot_bytes(self) -> int:
        return sum(self.hot[n] * self.slot_bytes[n] for n in self.hot)

    @property
    def host_bytes(self) -> int:
        return sum(self.slots[n] * self.slot_bytes[n] for n in self.hot)

    @property
    def hot_fraction(self) -> float:
        return sum(self.hot.values()) / max(1, sum(self.slots.values()))

    def layers(self) -> list[tuple[int, int, int, int, int]]:
        """(E, S, H, params, bytes) per module, as `offload_cost.predicted_rates` takes them."""
        return [(self.experts[n], self.slots[n], self.hot[n], self.slot_params[n], self.slot_bytes[n])
                for n in self.hot]


def _slot_sizes(module: nn.Module, tensors) -> tuple[int, int]:
    ts = [getattr(module, t) for t in tensors]
    return sum(t[0].numel() * t.element_size() for t in ts), sum(t[0].numel() for t in ts)


def plan_offload(wrapped, gpu_memory, ranks: int | None = None) -> OffloadPlan:
    """The hot slots of each experts module of `wrapped` (on any device, meta included): slots are handed
    out one per module in turn (module order) while the next still fits gpu_memory after the replicated
    weights and two staging slots of the largest layer. ConfigError where not even those fit. ranks: plan
    a rank of that many holding ceil(E / ranks) slots per module (`wrapped` holding every expert, as
    `thunderep plan` builds it); None: the slots `wrapped` holds."""
    budget = parse_memory(gpu_memory)
    memory = wrapped.memory()
    sizes, slots, experts = {}, {}, {}
    for name, binding in wrapped.bindings.items():
        module = wrapped.model.get_submodule(name)
        sizes[name] = _slot_sizes(module, binding.tensors)
        E = binding.num_experts
        slots[name], experts[name] = (binding.num_slots if ranks is None else -(-E // ranks)), E
    staging = 2 * max(b for b, _ in sizes.values())
    fixed = memory["replicated_bytes"] + staging
    if budget < fixed:
        raise ConfigError(f"gpu_memory {budget} bytes ({budget / 2**30:.2f} GiB) is less than this rank's replicated "
                          f"weights ({memory['replicated_bytes']} bytes) and the two staging buffers of expert "
                          f"weights ({staging} bytes): give at least {fixed} bytes, or spread the model over more "
                          "ranks")
    left, hot = budget - fixed, dict.fromkeys(slots, 0)
    grew = True
    while grew:
        grew = False
        for name, count in slots.items():
            if hot[name] < count and sizes[name][0] <= left:
                hot[name] += 1
                left -= sizes[name][0]
                grew = True
    return OffloadPlan(gpu_memory=budget, hot=hot, slots=slots, slot_bytes={n: s[0] for n, s in sizes.items()},
                       slot_params={n: s[1] for n, s in sizes.items()}, experts=experts,
                       replicated_bytes=memory["replicated_bytes"], staging_bytes=staging)


def check_host(plan: OffloadPlan, device: torch.device, free_host: int) -> None:
    """ConfigError naming the bytes when the host cannot hold this rank's experts (and, with the model on
    the CPU, everything else)."""
    need = plan.host_bytes
    if device.type == "cpu":
        need += plan.replicated_bytes + plan.staging_bytes + plan.hot_bytes
    if need > free_host:
        raise ConfigError(f"offloaded experts need {need} bytes ({need / 2**30:.2f} GiB) of host memory on this rank "
                          f"and {free_host} bytes ({free_host / 2**30:.2f} GiB) are available: spread the experts "
                          "over more ranks or hosts, load a narrower dtype, or free host memory")


def _holder(module: nn.Module, name: str) -> dict:
    """The dict of `module` holding tensor `name`: its parameters, or its buffers (quantized experts'
    scales and zero points)."""
    return module._parameters if name in module._parameters else module._buffers


@contextlib.contextmanager
def host_experts(model: nn.Module, bindings: dict, pin: bool):
    """Within the block the experts modules hold no expert tensors (so that `to_empty(device)` does not
    allocate them there); after it they hold empty host tensors (pinned where `pin`), frozen, to be
    filled from the checkpoint."""
    held = {}
    for name, binding in bindings.items():
        module = model.get_submodule(name)
        for t in binding.tensors:
            holder = _holder(module, t)
            held[name, t] = (holder, holder.pop(t))
    try:
        yield
    finally:
        for (name, t), (holder, meta) in held.items():
            host = torch.empty(meta.shape, dtype=meta.dtype, device="cpu", pin_memory=pin)
            holder[t] = nn.Parameter(host, requires_grad=False) if isinstance(meta, nn.Parameter) else host


def host_compute_fn(module: nn.Module) -> Callable:
    """How cold rows run on the host: the experts class's own forward (ThunderEP's kernels need CUDA
    tensors), on the weights dequantized into the model's dtype where they are held in FP8 or 4 bits."""
    eager = experts_compute_fn(module, "eager")
    if not (is_fp8(module) or is_int4(module)):
        return eager

    def compute(module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return eager_on_dequantized(module, eager, *expert_weights(module), x_TD, ids_TK, weights_TK)

    return compute


def attach_tiers(wrapped, plan: OffloadPlan, device: torch.device, config: TierConfig | None = None,
                 costs: OffloadCosts | None = None) -> None:
    """Give every binding of `wrapped` its `ExpertTiers` (hot slots as `plan` says, copied to `device`);
    one `Staging` per distinct slot shape, shared by the modules; the cost model measured once."""
    stagings = {}
    for name, binding in wrapped.bindings.items():
        module = wrapped.model.get_submodule(name)
        host = {t: getattr(module, t).detach() for t in binding.tensors}
        key = tuple((t, tuple(v.shape[1:]), v.dtype) for t, v in host.items())
        if key not in stagings:
            stagings[key] = Staging(host, device)
        model_costs = costs or measure_costs(device, next(iter(host.values())).dtype)
        on_host = binding.weights_compute(module, host_compute_fn(module))
        binding.tiers = ExpertTiers(host, plan.hot[name], device, binding.weights_compute(module), model_costs,
                                    stagings[key], config or TierConfig(), host_compute=on_host)


def offload_stats(bindings) -> dict | None:
    """The tiers' telemetry summed over `bindings` (None where no binding has tiers): hot share of rows,
    rows per path, bytes streamed and promoted, host expert seconds, hot slots of all."""
    tiers = [b.tiers for b in bindings if getattr(b, "tiers", None) is not None]
    if not tiers:
        return None
    total = TierStats()
    for t in tiers:
        total.add(t.stats)
    return {"hot_share": round(total.hot_share, 4), "rows_hot": total.rows_hot, "rows_host": total.rows_host,
            "rows_streamed": total.rows_streamed, "bytes_streamed": total.bytes_streamed,
            "bytes_promoted": total.bytes_promoted, "host_expert_seconds": round(total.host_seconds, 6),
            "hot_slots": sum(t.capacity for t in tiers), "slots": sum(t.num_slots for t in tiers)}


def summary_line(stats: dict) -> str:
    """One line of `offload_stats`."""
    return (f"expert offload: {stats['hot_slots']} of {stats['slots']} slots hot, {stats['hot_share']:.1%} of rows "
            f"served hot ({stats['rows_host']} on the host, {stats['rows_streamed']} streamed), "
            f"{stats['bytes_streamed'] / 2**20:.1f} MiB streamed, host expert time {stats['host_expert_seconds']:.3f} s")
