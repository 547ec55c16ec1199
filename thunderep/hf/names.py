"""Checkpoint tensor names -> the names of the model built from its config.json, for the tensors that
transformers' own conversion mapping leaves unplaced (`conversion`; older layouts it has no rule for).

Checkpoint names accepted for the experts of layer prefix P (model name `P.experts.gate_up_proj [E, 2I, D]`
and `P.experts.down_proj [E, D, I]`; E experts, I intermediate size, D hidden size):
    fused:       P.experts.gate_up_proj, P.experts.down_proj (and biases), as the model names them
    per expert:  P.experts.{e}.gate_proj|up_proj|down_proj.weight   (Qwen-MoE, DeepSeek, OLMoE, ... as
                 transformers 5.x save_pretrained writes them)
                 P.experts.{e}.w1|w3|w2.weight under `block_sparse_moe` (Mixtral, MiniMax, PhiMoE)
    GraniteMoE:  block_sparse_moe.input_linear.weight / output_linear.weight
"""

from __future__ import annotations

import re

__all__ = ["DOWN", "GATE", "PER_EXPERT", "RENAMES", "UP", "candidates"]

PER_EXPERT = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
RENAMES = (  # (pattern, replacement) tried one at a time and all together; first that resolves wins
    (re.compile(r"\.block_sparse_moe\.gate\.weight$"), ".mlp.router.weight"),  # PhiMoE
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Mixtral, MiniMax, PhiMoE
    (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".block_sparse_moe.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router\.layer\.weight$"), ".block_sparse_moe.router.weight"),
    (re.compile(r"\.mlp\.moe_statics\."), ".mlp.gate.moe_statics."),  # ERNIE 4.5 (as published and saved)
)
GATE, UP, DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")


def candidates(key: str, prefix: str) -> list[str]:
    """The model names checkpoint tensor `key` may stand for, in the order they are tried: `key` itself,
    each of `RENAMES` alone and all together, each also with or without the model's `prefix`."""
    out = [key]
    for pattern, repl in RENAMES:
        if pattern.search(key):
            out.append(pattern.sub(repl, key))
    together = key
    for pattern, repl in RENAMES[1:]:
        together = pattern.sub(repl, together)
    out.append(together)
    if prefix:  # a base-model checkpoint loaded into ...ForCausalLM, or the other way round
        out += [f"{prefix}.{k}" for k in list(out)]
        out += [k[len(prefix) + 1:] for k in list(out) if k.startswith(prefix + ".")]
    return list(dict.fromkeys(out))
