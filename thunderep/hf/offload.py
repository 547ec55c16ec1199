"""Expert offload for a wrapped Hugging Face model: `from_pretrained(..., gpu_memory=...)`.

Each rank's experts modules keep all their local slots' weights in host memory (pinned where CUDA
exists; with `offload_dir`, in files there mapped into memory, which the operating system pages in and
out), filled from the checkpoint as usual, and as many slots as fit `gpu_memory` (after the
replicated weights and the staging buffers) are also held on the device: `thunderep.moe.tiers`.
`plan_offload` sizes that on the meta model before anything is allocated; `attach_tiers` builds the tiers
after the checkpoint is read, with each layer's host function (`make_host_fn`: the lean one of
`thunderep.moe.host_experts` where the experts class is in the plain gated layout, else the class's own
forward one slot at a time) and the cost model calibrated on it at the layer's expert shape.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..moe.host_experts import GatedLayout, HostExperts, calibrate_upcast, per_slot
from ..moe.offload_cost import OffloadCosts, calibrate_host, calibrate_stream, measure_costs
from ..moe.tiers import ExpertTiers, Staging, TierConfig, TierStats, parse_memory
from .experts import KERNELS, experts_compute_fn
from .fp8 import expert_weights, is_fp8
from .int4 import forward_on_dequantized, is_int4

__all__ = ["OffloadPlan", "attach_tiers", "check_host", "disk_tensor", "gated_layout", "host_compute_fn", "host_experts",
           "make_host_fn", "offload_stats", "plan_offload", "summary_line"]


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


def check_host(plan: OffloadPlan, device: torch.device, free_host: int, free_disk: int | None = None) -> None:
    """ConfigError naming the bytes when the host cannot hold this rank's experts (and, with the model on
    the CPU, everything else); with `free_disk` (an offload directory's free bytes) the experts go to disk
    instead, and the error names the disk's bytes."""
    need = plan.replicated_bytes + plan.staging_bytes + plan.hot_bytes if device.type == "cpu" else 0
    if free_disk is not None:
        if plan.host_bytes > free_disk:
            raise ConfigError(f"offloaded experts need {plan.host_bytes} bytes ({plan.host_bytes / 2**30:.2f} GiB) "
                              f"of disk in the offload directory on this rank and {free_disk} bytes "
                              f"({free_disk / 2**30:.2f} GiB) are free there: pick a directory on a larger disk, or "
                              "spread the experts over more ranks or hosts")
    else:
        need += plan.host_bytes
    if need > free_host:
        raise ConfigError(f"offloaded experts need {need} bytes ({need / 2**30:.2f} GiB) of host memory on this rank "
                          f"and {free_host} bytes ({free_host / 2**30:.2f} GiB) are available: spread the experts "
                          "over more ranks or hosts, load a narrower dtype, free host memory, or leave them on disk "
                          "(offload_dir=... / --offload-dir)")


def _holder(module: nn.Module, name: str) -> dict:
    """The dict of `module` holding tensor `name`: its parameters, or its buffers (quantized experts'
    scales and zero points)."""
    return module._parameters if name in module._parameters else module._buffers


@contextlib.contextmanager
def host_experts(model: nn.Module, bindings: dict, pin: bool, directory: str | os.PathLike | None = None):
    """Within the block the experts modules hold no expert tensors (so that `to_empty(device)` does not
    allocate them there); after it they hold empty host tensors (pinned where `pin`), frozen, to be
    filled from the checkpoint. With `directory` the host tensors are files there mapped into memory
    (`disk_tensor`): the operating system keeps the pages it has room for and reads the others back on
    use, so host memory need not hold every offloaded expert."""
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
            if directory is not None:
                host = disk_tensor(directory, f"{name}.{t}", meta.shape, meta.dtype)
            else:
                host = torch.empty(meta.shape, dtype=meta.dtype, device="cpu", pin_memory=pin)
            holder[t] = nn.Parameter(host, requires_grad=False) if isinstance(meta, nn.Parameter) else host


def disk_tensor(directory: str | os.PathLike, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor backed by a new file in `directory` mapped shared into memory; the file's name
    is unlinked at once, so its blocks go back to the disk when the tensor is freed (a crash leaves no
    file behind)."""
    numel = math.prod(shape)
    fd, path = tempfile.mkstemp(prefix=f"thunderep-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:80]}-", suffix=".bin",
                                dir=directory)
    try:
        os.ftruncate(fd, max(1, numel * dtype.itemsize))
        flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)
    return flat.view(shape)


def host_compute_fn(module: nn.Module) -> Callable:
    """How cold rows run on the host: the experts class's own forward (ThunderEP's kernels need CUDA
    tensors), on the weights dequantized into the model's dtype where they are held in FP8 or 4 bits."""
    eager = experts_compute_fn(module, "eager")
    if not (is_fp8(module) or is_int4(module)):
        return eager

    def compute(module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return forward_on_dequantized(module, eager, *expert_weights(module), x_TD, ids_TK, weights_TK)

    return compute


def gated_layout(module: nn.Module, tensors) -> GatedLayout | None:
    """The plain gated layout of a transformers experts module whose class's own forward computes
    act(gate) * up @ down.T with [gate | up] = x @ gate_up.T, or None where the lean host function does not
    cover it: weights in FP8 or 4 bits, transposed weights, no gate, a norm after each expert, a gating
    function of its own (gpt-oss), alternating gate / up rows, or expert tensors besides the two products
    and their biases. `tensors`: the binding's expert tensor names."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if is_fp8(module) or is_int4(module) or not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2] \
            or gate_up.shape[2] != down.shape[1] or not callable(getattr(module, "act_fn", None)):
        return None
    if getattr(module, "is_transposed", False) or not getattr(module, "has_gate", True) \
            or getattr(module, "has_post_expert_norm", False) or not getattr(module, "is_concatenated", True):
        return None
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None:
        import transformers.integrations.moe as hf_moe  # transformers: optional (the hf extra)

        if gate_fn is not getattr(hf_moe, "_default_apply_gate", None):
            return None
    biased = getattr(module, "has_bias", False)
    layout = GatedLayout(gate_up_bias="gate_up_proj_bias" if biased else None,
                         down_bias="down_proj_bias" if biased else None)
    return layout if set(tensors) == set(layout.names) else None


def make_host_fn(binding, module: nn.Module) -> Callable:
    """The host function of `module`'s cold slots (`thunderep.moe.host_experts`): `HostExperts` where
    `gated_layout` covers the module, else the class's own forward one slot at a time (`per_slot`)."""
    layout = gated_layout(module, binding.tensors)
    if layout is None:
        return per_slot(binding.weights_compute(module, host_compute_fn(module)))
    return HostExperts(module.act_fn, layout)


def _hidden(wrapped, module: nn.Module) -> int:
    """D, the hidden size of the rows `module` computes (its config's, else the model's text config's)."""
    config = getattr(module, "config", None) or wrapped.model.config.get_text_config()
    return config.hidden_size


def attach_tiers(wrapped, plan: OffloadPlan, device: torch.device, config: TierConfig | None = None,
                 costs: OffloadCosts | None = None) -> None:
    """Give every binding of `wrapped` its `ExpertTiers` (hot slots as `plan` says, copied to `device`);
    one `Staging` per distinct slot shape, shared by the modules; the cost model measured once, its host
    and stream sides calibrated once per slot shape on that shape's host function and stream path (not
    where `costs` is given)."""
    stagings, upcast, scratch, calibrated = {}, {}, {}, {}
    for name, binding in wrapped.bindings.items():
        module = wrapped.model.get_submodule(name)
        host = {t: getattr(module, t).detach() for t in binding.tensors}
        key = tuple((t, tuple(v.shape[1:]), v.dtype) for t, v in host.items())
        if key not in stagings:
            stagings[key] = Staging(host, device)
        on_host = make_host_fn(binding, module)
        if isinstance(on_host, HostExperts):  # 16-bit weights: where float32 products pay, once per shape
            on_host.upcast_rows = upcast[key] if key in upcast else calibrate_upcast(on_host, host)
            upcast[key] = on_host.upcast_rows
            on_host.scratch = scratch.setdefault(key, on_host.scratch)  # one set of float32 buffers
        if costs is None and key not in calibrated:
            dtype = wrapped.model.dtype  # the rows' (the model's) dtype; the host tensors may be packed
            many = on_host.line_rows() if isinstance(on_host, HostExperts) else 32
            calibrated[key] = calibrate_host(measure_costs(device, dtype), on_host, host, _hidden(wrapped, module), dtype,
                                             rows=(1, many))
        binding.tiers = ExpertTiers(host, plan.hot[name], device, binding.weights_compute(module),
                                    costs or calibrated[key], stagings[key], config or TierConfig(), host_fn=on_host,
                                    lean_hot=binding.implementation != KERNELS, pairs=binding.weights_pairs(module),
                                    name=name)
        if costs is None and calibrated[key].stream_call_s is None:  # once per shape, on this layer's own path
            tiers = binding.tiers
            calibrated[key] = tiers.costs = calibrate_stream(
                calibrated[key], lambda: tiers.time_stream(_hidden(wrapped, module), wrapped.model.dtype))


def offload_stats(bindings) -> dict | None:
    """The tiers' telemetry summed over `bindings` (None where no binding has tiers): hot share of rows,
    rows per path, bytes streamed and promoted, host expert seconds, hot slots of all."""
    tiers = [b.tiers for b in bindings if getattr(b, "tiers", None) is not None]
    if not tiers:
        return None
    total = TierStats()
    for t in tiers:  # read as they are (serve's /health reads from another thread): a decode call handed to a
        total.add(t.stats)  # host job is counted when its layer settles it, at the layer's next call
    return {"hot_share": round(total.hot_share, 4), "rows_hot": total.rows_hot, "rows_host": total.rows_host,
            "rows_streamed": total.rows_streamed, "rows_mapped": total.rows_mapped,
            "bytes_streamed": total.bytes_streamed,
            "bytes_promoted": total.bytes_promoted, "host_expert_seconds": round(total.host_seconds, 6),
            "hot_slots": sum(t.capacity for t in tiers), "slots": sum(t.num_slots for t in tiers)}


def summary_line(stats: dict) -> str:
    """One line of `offload_stats`."""
    return (f"expert offload: {stats['hot_slots']} of {stats['slots']} slots hot, {stats['hot_share']:.1%} of rows "
            f"served hot ({stats['rows_host']} on the host, {stats['rows_streamed']} streamed, "
            f"{stats['rows_mapped']} read mapped), "
            f"{stats['bytes_streamed'] / 2**20:.1f} MiB streamed, host expert time {stats['host_expert_seconds']:.3f} s")
