"""A small Mixtral-architecture causal language model built from ThunderEP layers.

Shape legend: B batch, L sequence length, T = B * L tokens, D hidden, V vocabulary, Hq query heads,
Hkv key/value heads, Hd head size.

The architecture and parameter names follow Hugging Face's Mixtral (RMSNorm, rotary attention with
grouped-query heads, a top-k MoE block per layer), so a trained model exports to a plain Mixtral
checkpoint (`thunderep.train.checkpoint.export_hf`). It is what `thunderep train` and `thunderep demo`
train: byte-level (V = 256) by default, no tokenizer needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerConfig, positive
from ..errors import ConfigError
from .layer import ThunderMoELayer

__all__ = ["MoEModelConfig", "MoETransformer"]


@dataclass(frozen=True)
class MoEModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    max_seq_len: int = 512

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "num_experts", "top_k", "max_seq_len"):
            positive(f"MoEModelConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"MoEModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                              f"num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"MoEModelConfig.num_heads ({self.num_heads}) must be divisible by "
                              f"num_kv_heads ({self.num_kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_config(self) -> LayerConfig:
        return LayerConfig.build(family="mixtral", hidden_size=self.hidden_size,
                                 intermediate_size=self.intermediate_size, num_experts=self.num_experts,
                                 top_k=self.top_k)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary position embeddings (Mixtral's)."""

    def __init__(self, config: MoEModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        D, Hd = config.hidden_size, config.head_dim
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(D, config.num_heads * Hd, **kw)
        self.k_proj = nn.Linear(D, config.num_kv_heads * Hd, **kw)
        self.v_proj = nn.Linear(D, config.num_kv_heads * Hd, **kw)
        self.o_proj = nn.Linear(config.num_heads * Hd, D, **kw)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, Hd, 2, dtype=torch.int64).float() / Hd))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        c = self.config
        q = self.q_proj(x_BLD).view(B, L, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x_BLD).view(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x_BLD).view(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
        positions = torch.arange(L, device=x_BLD.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: MoEModelConfig, ep=None, placement=None, device=None, dtype=None, balancer=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = Attention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = ThunderMoELayer(config.layer_config(), ep=ep, placement=placement, balancer=balancer,
                                   device=device, dtype=dtype)

    def forward(self, x_BLD: torch.Tensor, **moe_kwargs) -> torch.Tensor:
        x_BLD = x_BLD + self.self_attn(self.input_layernorm(x_BLD))
        return x_BLD + self.mlp(self.post_attention_layernorm(x_BLD), **moe_kwargs)


class MoETransformer(nn.Module):
    """forward(ids_BL) -> logits_BLV; `loss(ids_BL)` is next-token cross-entropy.

    ep: an `ExpertParallel` runtime: every rank holds the attention and norms, and its share of the
    experts of every layer (`placements[i]` for layer i, default contiguous blocks).
    balancer: a `BalancerConfig` to balance every layer (call `balance_step(optimizer)` after each step).
    """

    def __init__(self, config: MoEModelConfig, *, ep=None, placements=None, balancer=None, device=None,
                 dtype=None, seed: int = 0):
        super().__init__()
        self.config = config
        self.ep = ep
        if device is None and ep is not None:
            device = ep.groups.device
        placements = placements or [None] * config.num_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ep, placements[i], device, dtype, balancer) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic initialisation, identical on every rank: expert weights are drawn for all
        experts and each rank keeps its slots, so any EP size gives the same model."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                    continue
                shape = p.shape
                if ".mlp.experts." in name:
                    layer = self.get_submodule(name.rsplit(".experts.", 1)[0])
                    shape = (self.config.num_experts, *p.shape[1:])
                full = torch.randn(shape, generator=gen) * 0.02
                if ".mlp.experts." in name:
                    full = full[torch.tensor(layer.local_experts)]
                p.copy_(full.to(p.dtype))

    def forward(self, ids_BL: torch.Tensor, **moe_kwargs) -> torch.Tensor:
        x = self.embed_tokens(ids_BL)
        for layer in self.layers:
            x = layer(x, **moe_kwargs)
        return self.lm_head(self.norm(x))

    def loss(self, ids_BL: torch.Tensor, **moe_kwargs) -> torch.Tensor:
        logits = self(ids_BL[:, :-1], **moe_kwargs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids_BL[:, 1:].reshape(-1))

    def moe_layers(self) -> list[ThunderMoELayer]:
        return [layer.mlp for layer in self.layers]

    def balance_step(self, optimizer=None) -> list:
        """Every MoE layer's balancer decision for this step (None where it has none)."""
        return [layer.balance_step(optimizer) for layer in self.moe_layers()]

    @torch.no_grad()
    def generate(self, ids_BL: torch.Tensor, new_tokens: int, *, replicated: bool = True,
                 temperature: float = 0.0, seed: int = 0, on_token=None) -> torch.Tensor:
        """Greedy (temperature 0) or sampled decoding, recomputing the window per token (the model is
        small). With `replicated`, every rank holds the same prompt and the MoE layers run in latency
        mode; sampling uses a generator seeded alike on every rank, so all ranks pick the same tokens.
        `on_token(ids_B)` is called with each new token (for streaming)."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(new_tokens):
            window = ids_BL[:, -self.config.max_seq_len:]
            logits = self(window, replicated=replicated)[:, -1].float().cpu()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_B = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(ids_BL.device)
            else:
                next_B = logits.argmax(dim=-1).to(ids_BL.device)
            ids_BL = torch.cat([ids_BL, next_B[:, None]], dim=1)
            if on_token is not None:
                on_token(next_B)
        return ids_BL
