"""Low-rank adapters (LoRA) on a model's linear layers, for fine-tuning with the base weights frozen.

`apply_lora(model, targets, rank, alpha)` replaces each `nn.Linear` whose name matches a pattern by a
`LoRALinear`: y = base(x) + (alpha / rank) * B(A(x)), with the base frozen, A drawn like PEFT's
default (Kaiming-uniform) and B zero, so the model starts out unchanged. A and B are replicated
weights: under expert parallelism `GradSync` averages their gradients like any replicated weight, and
the draw of A depends only on `seed` and the layer's name, so every rank starts from the same A.
`merge_lora(model)` folds each adapter into its base weight (W + (alpha / rank) * B @ A, computed in
float32) and puts the plain `nn.Linear` back, so the model saves as a checkpoint of its own family.

The experts are not adapted: their weights are packed tensors, not `nn.Linear`s.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
from torch import nn
from torch.nn import functional as F

from .errors import ConfigError

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "apply_lora", "merge_lora"]

# The attention projections of transformers' MoE families (q/k/v/o, DeepSeek's low-rank q and kv).
DEFAULT_TARGETS = (r"(self_attn|attention)\.[a-z_]*proj[a-z_]*$",)


class LoRALinear(nn.Module):
    """`base` (frozen) plus a trainable low-rank update. A: [rank, in], B: [out, rank], in `dtype`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dtype: torch.dtype, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        a = torch.empty(rank, base.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT draw
        a.uniform_(-bound, bound, generator=generator)
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


def apply_lora(model: nn.Module, targets: list[str] | tuple[str, ...] | None = None, rank: int = 8,
               alpha: float | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Parameter]:
    """Freeze every parameter of `model` and put an adapter on each `nn.Linear` whose name matches one
    of `targets` (regular expressions, `re.search`; default `DEFAULT_TARGETS`). alpha: default 2 x rank.
    Returns the adapters' parameters (A, B per layer, in module order). ConfigError when a pattern
    matches no linear layer or the rank is not positive."""
    if rank < 1:
        raise ConfigError(f"LoRA rank must be at least 1, got {rank}")
    alpha = float(2 * rank if alpha is None else alpha)
    patterns = [(p, re.compile(p)) for p in (targets or DEFAULT_TARGETS)]
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = [(name, m) for name, m in linears if any(rx.search(name) for _, rx in patterns)]
    unused = [p for p, rx in patterns if not any(rx.search(name) for name, _ in linears)]
    if unused or not chosen:
        raise ConfigError(f"LoRA targets {' '.join(unused or [p for p, _ in patterns])} match no linear layer; "
                          f"linear layers are named like {', '.join(n for n, _ in linears[:4])}, ...")
    model.requires_grad_(False)
    params = []
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        adapter = LoRALinear(linear, rank, alpha, dtype, generator)
        setattr(parent, child, adapter)
        params += [adapter.lora_A, adapter.lora_B]
    return params


def merge_lora(model: nn.Module) -> int:
    """Fold every `LoRALinear` of `model` into its base layer and put the base back. Returns how many."""
    adapters = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, adapter in adapters:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, adapter.merged())
    return len(adapters)
