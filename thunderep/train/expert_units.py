"""The expert-sharded layers of a model as checkpoints and exports see them: one `ExpertUnit` per layer,
naming its tensors in `model.state_dict()`, its placement and its EP runtime.

Shape legend: E logical experts of a layer, S local slots of a rank.
"""

from __future__ import annotations

import dataclasses

import torch

from ..balance.placement import Placement
from ..moe.ep import moe_layers

__all__ = ["ExpertUnit", "expert_units"]


@dataclasses.dataclass
class ExpertUnit:
    """One layer's expert-sharded tensors as a checkpoint sees them.

    key: the layer's name in the manifest. tensors: short name -> key in `model.state_dict()` (leading
    dim: local slots). stem: expert e's tensor n is stored as f"{stem}.{e}.{n}". restore: sets a saved
    placement back on the layer (None: the layer keeps its own; experts are re-sharded onto it)."""

    key: str
    tensors: dict
    stem: str
    num_experts: int
    ep: object
    placement: Placement
    restore: object = None


def expert_units(model: torch.nn.Module) -> list[ExpertUnit]:
    """The MoE layers of `model` (`thunderep.moe.ep.moe_layers`: ThunderEP layers and wrapped Hugging Face
    experts alike) as checkpoints see them."""
    units = []
    for layer in moe_layers(model):
        core = layer.core
        restore = None
        if core is not None and layer.owner.restores_placement:
            restore = lambda placement, core=core: setattr(core, "placement", placement)  # noqa: E731
        units.append(ExpertUnit(layer.key, {t: f"{layer.name}.{t}" for t in layer.tensors}, layer.name,
                                layer.num_experts, core.ep if core is not None else None, layer.placement, restore))
    return units
