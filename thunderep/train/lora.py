"""Low-rank adapters (LoRA) on a model's linear layers and experts, for fine-tuning with the base
weights frozen.

`apply_lora(model, targets, rank, alpha)` replaces each `nn.Linear` whose name matches a pattern by a
`LoRALinear`: y = base(x) + (alpha / rank) * B(A(x)), with the base frozen, A drawn like PEFT's
default (Kaiming-uniform) and B zero, so the model starts out unchanged. A and B are replicated
weights: under expert parallelism `GradSync` averages their gradients like any replicated weight, and
the draw of A depends only on `seed` and the layer's name, so every rank starts from the same A.
`merge_lora(model)` folds each adapter into its base weight (W + (alpha / rank) * B @ A, computed in
float32) and puts the plain `nn.Linear` back, so the model saves as a checkpoint of its own family.

The experts of a wrapped model (`ThunderMoE`) are packed tensors W [S, a, b] (S local slots), not
`nn.Linear`s; a pattern that matches one (e.g. `model.layers.0.mlp.experts.gate_up_proj`) gives each
slot its own adapter, A [S, r, b] and B [S, a, r], registered on the experts module next to W and
listed among its expert-sharded tensors (`ExpertsBinding.tensors`, `.adapters`). So they live with
their experts: the all-to-all backward brings their gradients, GradSync treats them as expert
parameters, checkpoints store them by logical expert. The experts compute with W + (alpha / r) B @ A
(summed in float32, then cast as W would be; `hf.experts._effective_weights`), which costs one small
batched product and a weight-sized temporary per call. A's draw depends on the seed, the tensor's
name and the logical expert, not on where the expert sits.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError
from ..hf.experts import ExpertAdapter

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "apply_lora", "merge_lora"]

# The attention projections of transformers' MoE families (q/k/v/o, DeepSeek's low-rank q and kv).
DEFAULT_TARGETS = (r"(self_attn|attention)\.[a-z_]*proj[a-z_]*$",)


class LoRALinear(nn.Module):
    """`base` (frozen) plus a trainable low-rank update. A: [rank, in], B: [out, rank], in `dtype`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dtype: torch.dtype, a: torch.Tensor):
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        device = base.weight.device
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=dtype))
        base.requires_grad_(False)

    # What modeling code may read off the layer it called.
    weight = property(lambda self: self.base.weight)
    bias = property(lambda self: self.base.bias)
    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        update = F.linear(F.linear(x.to(self.lora_A.dtype) if not torch.is_autocast_enabled(x.device.type) else x,
                                   self.lora_A), self.lora_B)
        return y + (update * self.scale).to(y.dtype)

    def merged(self) -> nn.Linear:
        """The base layer with the update folded into its weight (in place)."""
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
            self.base.weight.copy_((self.base.weight.float() + delta).to(self.base.weight.dtype))
        return self.base


def _expert_tensors(model: nn.Module) -> list[tuple[str, nn.Module, object, str]]:
    """(full name, experts module, binding, tensor name) of the 3-D expert weights of a wrapped model."""
    out = []
    for name, module in model.named_modules():
        binding = module.__dict__.get("_thunderep")
        if binding is None:
            continue
        own = {n for adapter in binding.adapters.values() for n in (adapter.a, adapter.b)}
        for t in binding.tensors:
            p = module._parameters.get(t)
            if t not in own and p is not None and p.is_floating_point() and p.dim() == 3:
                out.append((f"{name}.{t}" if name else t, module, binding, t))
    return out


def _draw(shape, fan_in: int, key: str, seed: int) -> torch.Tensor:
    """Kaiming-uniform (a = sqrt(5)), as nn.Linear and PEFT draw A, from a generator of (seed, key)."""
    bound = 1.0 / math.sqrt(fan_in)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def apply_lora(model: nn.Module, targets: list[str] | tuple[str, ...] | None = None, rank: int = 8,
               alpha: float | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Parameter]:
    """Freeze every parameter of `model` and put an adapter on each `nn.Linear`, and each expert tensor
    of a wrapped model, whose name matches one of `targets` (regular expressions, `re.search`; default
    `DEFAULT_TARGETS`: the attention projections). alpha: default 2 x rank. Returns the adapters'
    parameters (A, B per layer or expert tensor). ConfigError when a pattern matches nothing or the
    rank is not positive."""
    if rank < 1:
        raise ConfigError(f"LoRA rank must be at least 1, got {rank}")
    alpha = float(2 * rank if alpha is None else alpha)
    patterns = [(p, re.compile(p)) for p in (targets or DEFAULT_TARGETS)]
    matches = lambda name: any(rx.search(name) for _, rx in patterns)  # noqa: E731
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    experts = _expert_tensors(model)
    names = [n for n, _ in linears] + [e[0] for e in experts]
    unused = [p for p, rx in patterns if not any(rx.search(name) for name in names)]
    if unused:
        raise ConfigError(f"LoRA targets {' '.join(unused)} match no linear layer or expert tensor; they are "
                          f"named like {', '.join(names[:3] + [e[0] for e in experts[:1]])}, ...")
    model.requires_grad_(False)
    params = []
    for name, linear in linears:
        if matches(name):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            a = _draw((rank, linear.in_features), linear.in_features, name, seed)
            adapter = LoRALinear(linear, rank, alpha, dtype, a)
            setattr(parent, child, adapter)
            params += [adapter.lora_A, adapter.lora_B]
    for name, module, binding, t in experts:
        if not matches(name):
            continue
        if getattr(binding, "tiers", None) is not None:
            raise ConfigError(f"LoRA target {name} is an expert tensor held in host memory (gpu_memory): offloaded "
                              f"experts train frozen; target the attention projections (the default) instead")
        w = module._parameters[t]
        S, a, b = w.shape
        A = torch.stack([_draw((rank, b), b, f"{name}.{e}", seed) for e in binding.local_experts])
        A = nn.Parameter(A.to(device=w.device, dtype=dtype))
        B = nn.Parameter(torch.zeros(S, a, rank, device=w.device, dtype=dtype))
        a_name, b_name = f"{t}_lora_A", f"{t}_lora_B"
        module.register_parameter(a_name, A)
        module.register_parameter(b_name, B)
        binding.tensors = binding.tensors + (a_name, b_name)
        binding.adapters[t] = ExpertAdapter(a_name, b_name, alpha / rank)
        params += [A, B]
    return params


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter of `model` into its weight (float32 sum) and take the adapter away: each
    `LoRALinear` becomes its base layer again, each adapted expert tensor W becomes W + scale * B @ A.
    Returns how many adapters were merged."""
    adapters = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, adapter in adapters:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, adapter.merged())
    merged = len(adapters)
    for module in model.modules():
        binding = module.__dict__.get("_thunderep")
        if binding is None or not binding.adapters:
            continue
        with torch.no_grad():
            for t, adapter in binding.adapters.items():
                w, a, b = (module._parameters[n] for n in (t, adapter.a, adapter.b))
                w.copy_((w.float() + torch.bmm(b.float(), a.float()) * adapter.scale).to(w.dtype))
                del module._parameters[adapter.a], module._parameters[adapter.b]
                merged += 1
        gone = {n for adapter in binding.adapters.values() for n in (adapter.a, adapter.b)}
        binding.tensors = tuple(t for t in binding.tensors if t not in gone)
        binding.adapters.clear()
    return merged
