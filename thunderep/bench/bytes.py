"""Bytes each MoE layer moves per token, ep mode before and after one-row-per-(token, rank) dispatch,
against all-gather mode, for the routing of real model shapes (`thunderep bench bytes`).

Shape legend: T tokens per rank, D hidden size, K experts per token, E experts, R ranks.

Routing comes from ThunderEP's router (each family's scoring, DeepSeek-V3's group-limited choice) on
random hidden states, uniform or with Zipf-skewed expert popularity (a log-popularity bias on the
logits); experts sit in contiguous blocks, so DeepSeek-V3's 8 groups of 32 experts align with ranks.
Rows are counted by the dispatcher's own layout (`comm.dispatcher.row_layout`). Per token, each way,
with a 16-bit payload:

    ep before   one row of 2D bytes per (token, k) pair whose expert is on another rank
    ep after    one row of 2D bytes per (token, other rank holding one of its experts), plus its side
                row of 2K float32 (routing weights, local slots); the same rows, without side rows, back
    allgather   2D + 4K (weights) + 8K (ids) bytes to each of the R - 1 other ranks; a reduce-scatter
                of 2D bytes per token and other rank back
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import torch

from ..comm.dispatcher import row_layout
from ..config import RouterConfig
from ..moe.router import route

__all__ = ["MODELS", "Shape", "bytes_per_token", "report"]


@dataclass(frozen=True)
class Shape:
    """A model's MoE routing: family (router scoring), E, K, D, and DeepSeek-style groups."""

    family: str
    num_experts: int
    top_k: int
    hidden_size: int
    n_group: int = 1
    topk_group: int = 1


MODELS = {
    "mixtral": Shape("mixtral", 8, 2, 4096),
    "qwen3-30b-a3b": Shape("qwen3_moe", 128, 8, 2048),
    "olmoe": Shape("olmoe", 64, 8, 2048),
    "deepseek-v3": Shape("deepseek_v3", 256, 8, 7168, n_group=8, topk_group=4),
    "deepseek-v3-ungrouped": Shape("deepseek_v3", 256, 8, 7168),
}


def _routing(shape: Shape, tokens: int, skew: float, seed: int) -> torch.Tensor:
    """ids [tokens, K] from the family's router on random inputs; skew > 0: Zipf(skew) expert popularity."""
    gen = torch.Generator().manual_seed(seed)
    width = 64  # the router's input width does not change which experts are chosen, only their spread
    config = RouterConfig.for_family(shape.family, num_experts=shape.num_experts, top_k=shape.top_k,
                                     hidden_size=width, n_group=shape.n_group, topk_group=shape.topk_group)
    x_TD = torch.randn(tokens, width, generator=gen)
    weight_ED = torch.randn(shape.num_experts, width, generator=gen) / math.sqrt(width)
    bias_E = None
    if skew > 0:
        popularity_E = 1.0 / torch.arange(1, shape.num_experts + 1, dtype=torch.float32) ** skew
        bias_E = popularity_E[torch.randperm(shape.num_experts, generator=gen)].log()
    return route(x_TD, weight_ED, config, bias_E=bias_E).ids_TK


def bytes_per_token(shape: Shape, ranks: int, tokens: int = 512, skew: float = 0.0, seed: int = 0) -> dict:
    """Mean bytes per token each way for every mode (see the module docstring), over `ranks` ranks of
    `tokens` tokens each (every rank its own tokens)."""
    E, K, D, R = shape.num_experts, shape.top_k, shape.hidden_size, ranks
    S = E // R
    pairs_remote = rows_remote = 0
    for home in range(R):
        ids_TK = _routing(shape, tokens, skew, seed * 1000 + home)
        slots_TK = ids_TK  # contiguous blocks: expert e is global slot e, on rank e // S
        pairs_remote += int((torch.div(slots_TK, S, rounding_mode="floor") != home).sum())
        rows_R, _, _ = row_layout(slots_TK, torch.ones(ids_TK.shape), R, S)
        rows_remote += int(rows_R.sum() - rows_R[home])
    n = tokens * R
    return {
        "ep_before": (pairs_remote * 2 * D / n, pairs_remote * 2 * D / n),
        "ep_after": (rows_remote * (2 * D + 8 * K) / n, rows_remote * 2 * D / n),
        "allgather": ((R - 1) * (2 * D + 12 * K), (R - 1) * 2 * D),
        "rows_per_token": (pairs_remote / n, rows_remote / n),
    }


def report(models: list[str], ranks: list[int], tokens: int = 512, skews: tuple[float, ...] = (0.0, 1.0)) -> int:
    """Print the table: bytes per token dispatched (and combined) per mode and the ratios."""
    print(f"bytes per token each way, 16-bit rows; {tokens} tokens per rank; routing from ThunderEP's router "
          f"(host: {platform.machine()}, torch {torch.__version__})")
    print(f"{'model':<22} {'routing':<8} {'R':>2} {'ep before':>10} {'ep after':>10} {'allgather':>10} "
          f"{'after/before':>12} {'after/allg':>10} {'rows/token before -> after':>27}")
    for name in models:
        shape = MODELS[name]
        for skew in skews:
            for R in ranks:
                if shape.num_experts % R:
                    continue
                b = bytes_per_token(shape, R, tokens, skew)
                (before, _), (after, _), (allg, _) = b["ep_before"], b["ep_after"], b["allgather"]
                rows = b["rows_per_token"]
                print(f"{name:<22} {'zipf' + format(skew, 'g') if skew else 'uniform':<8} {R:>2} {before:>10.0f} "
                      f"{after:>10.0f} {allg:>10.0f} {after / before:>12.3f} {after / allg:>10.3f} "
                      f"{rows[0]:>13.2f} -> {rows[1]:<8.2f}")
    print("combine (back) is the same rows without the side row; all-gather mode's back is a reduce-scatter "
          "of (R - 1) rows per token")
    return 0
