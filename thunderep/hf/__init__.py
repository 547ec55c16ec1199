"""Hugging Face transformers integration: wrap MoE models, load expert shards per rank, generate.

Needs the `hf` extra (transformers >= 5, safetensors). Importing this package changes nothing in
transformers; `ThunderMoE.wrap` / `ThunderMoE.from_pretrained` are the explicit calls that do.
"""

from __future__ import annotations

from .checkpoint_index import CheckpointIndex
from .experts import IMPLEMENTATION, ExpertsBinding, register_experts_implementation
from .report import LoadReport
from .wrap import ThunderMoE, find_experts_modules

__all__ = [
    "IMPLEMENTATION",
    "CheckpointIndex",
    "ExpertsBinding",
    "LoadReport",
    "ThunderMoE",
    "find_experts_modules",
    "register_experts_implementation",
]
