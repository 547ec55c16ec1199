"""What trains on a rank, in which precision, and the memory it takes: the parameters `--freeze` leaves
trainable, the precision weights train in (`--dtype`), the memory plan each rank prints (and checks)
before the first step, and the error that turns running out of device memory in a step into advice.
Used by `thunderep finetune` (finetune.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..hf.load import free_bytes, resolve_dtype

__all__ = ["MemoryPlan", "autocast", "load_dtype", "memory_hint", "memory_plan", "peak_bytes", "precision_for",
           "select_trainable", "stored_dtype"]


def precision_for(dtype: str, device: torch.device) -> str:
    """What `--dtype` trains in on `device`: mixed, float32, bfloat16 or float16 ("auto": mixed on GPUs,
    float32 on CPU)."""
    return dtype if dtype != "auto" else ("mixed" if device.type == "cuda" else "float32")


def stored_dtype(model_dir: str) -> torch.dtype:
    """The dtype the checkpoint's config names (float32 if none)."""
    from transformers import AutoConfig

    return resolve_dtype(None, AutoConfig.from_pretrained(model_dir, local_files_only=True))


def load_dtype(precision: str, model_dir: str) -> torch.dtype:
    """The dtype to load the checkpoint in: mixed loads as stored (what trains becomes float32 afterwards,
    frozen weights keep the stored dtype); the others load in their own."""
    return stored_dtype(model_dir) if precision == "mixed" else getattr(torch, precision)


def autocast(precision: str, device: torch.device):
    """The context a forward runs in: mixed keeps float32 weights (and AdamW's updates on them) and runs
    the products in bfloat16."""
    if precision == "mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def select_trainable(tm, patterns: list[str] | None) -> list[torch.nn.Parameter]:
    """Freeze the parameters whose name (transformers' name in the model, e.g.
    `model.layers.0.mlp.experts.gate_up_proj`) matches any of the regular expressions `patterns`
    (`re.search`), and the experts a `gpu_memory` budget left in host memory; return the others, which
    train. ConfigError when a pattern matches nothing or nothing is left to train: both name the patterns."""
    named = list(tm.model.named_parameters())
    compiled = [(p, re.compile(p)) for p in patterns or []]
    unused = [p for p, rx in compiled if not any(rx.search(name) for name, _ in named)]
    if unused:
        raise ConfigError(f"--freeze {' '.join(unused)} matches no parameter; names look like "
                          f"{', '.join(name for name, _ in named[:3])}, ...")
    offloaded = {id(p) for p in tm.offloaded_parameters()}  # gpu_memory: host-held experts train frozen
    trainable = []
    for name, param in named:
        frozen = id(param) in offloaded or any(rx.search(name) for _, rx in compiled)
        param.requires_grad_(not frozen)
        if not frozen:
            trainable.append(param)
    if not trainable:
        raise ConfigError(f"--freeze {' '.join(patterns)} freezes every parameter: nothing would train")
    return trainable


@dataclasses.dataclass
class MemoryPlan:
    """What one rank holds for training, in bytes, against what its device has free.

    weights: every parameter as loaded (this rank's experts and the replicated weights); trainable:
    the parameters that train; grads, adamw: their gradients and AdamW's two moments; sync: the flat
    buffers GradSync all-reduces the replicated gradients in (held with the gradients while they are
    in flight); free: the device's free memory after loading (CPU: the host's available memory over
    the ranks of this host, which share it). `short`: the largest shortfall over the ranks, the same
    on every rank (`check` raises on all of them). Activations come on top and are not counted."""

    rank: int
    device: str
    weights: int
    trainable: int
    grads: int
    adamw: int
    sync: int
    free: int
    short: int = 0

    @property
    def need(self) -> int:
        return self.grads + self.adamw + self.sync

    def describe(self) -> str:
        gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
        return (f"memory per rank (rank {self.rank}, {self.device}): weights {gb(self.weights)} (of which "
                f"training {gb(self.trainable)}); training adds gradients {gb(self.grads)}, AdamW state "
                f"{gb(self.adamw)}, gradient sync buffers up to {gb(self.sync)}: {gb(self.need)} plus "
                f"activations; {gb(self.free)} free")

    def check(self) -> None:
        if self.short > 0:
            raise ConfigError(
                f"not enough memory to train: a rank needs {self.short / 1e9:.2f} GB more than it has free "
                f"({self.describe()}). Freeze what need not train (--freeze experts, or other name "
                "patterns), keep the weights in bfloat16 (--dtype bfloat16: half the weights, gradients and "
                "AdamW state, but small steps are lost), or spread the experts over more ranks (--ep; "
                "`thunderep plan --model DIR` shows the need for each)")


def memory_plan(tm, device: torch.device, free: int | None = None) -> MemoryPlan:
    """This rank's `MemoryPlan` (collective: the shortfall is all-reduced). free: override the free
    bytes (default: `hf.load.free_bytes`, the GPU's free memory or the host's over its ranks)."""
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    trainable = [p for p in tm.parameters() if p.requires_grad]
    experts = {id(p) for p in tm.expert_parameters()}
    offloaded = {id(p) for p in tm.offloaded_parameters()}  # in host memory; their hot copies on the device
    weights = size(p for p in tm.parameters() if id(p) not in offloaded) + tm.tier_device_bytes()
    plan = MemoryPlan(rank=dist.get_rank() if dist.is_initialized() else 0, device=str(device),
                      weights=weights, trainable=size(trainable), grads=size(trainable),
                      adamw=2 * size(trainable), sync=size(p for p in trainable if id(p) not in experts), free=0)
    if free is None:
        free = free_bytes(device)
    plan.free = free
    short = torch.tensor([max(0, plan.need - free)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
    plan.short = int(short.item())
    return plan


def peak_bytes(device: torch.device) -> int:
    """The largest peak memory over the ranks (collective): CUDA's peak allocation, or on CPU the
    process's peak resident size."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        import resource  # POSIX only: needed on CPU ranks alone

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    t = torch.tensor([peak], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def memory_hint(batch: int, seq_len: int, step: int, plan: MemoryPlan):
    """Turn running out of device memory in a training step (of `batch` x `seq_len` tokens per rank) into a
    ConfigError that says where and what to change (the other ranks then fail at their next collective,
    within --timeout)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise ConfigError(
            f"out of memory in training step {step + 1} on rank {plan.rank} ({plan.device}), "
            f"{batch} x {seq_len} tokens per rank; before training: {plan.describe()}. The activations "
            "grow with --batch x --seq-len: lower them, or add --gradient-checkpointing; or train less "
            f"(--freeze) ({str(exc).splitlines()[0][:200]})") from exc
