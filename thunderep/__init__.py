"""ThunderEP: expert parallelism for Mixture-of-Experts models on consumer PCIe machines."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .config import (
    EPConfig,
    ExpertsConfig,
    LayerConfig,
    RouterConfig,
    SharedExpertsConfig,
    SyncConfig,
)
from .errors import (
    CheckpointError,
    CommError,
    ConfigError,
    InputError,
    PeerTimeout,
    RoutingError,
    ThunderError,
    UnsupportedModelError,
)

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from .balance.placement import Placement
    from .comm.groups import EPGroups, init_expert_parallel
    from .comm.runtime import ExpertParallel
    from .moe.experts import FusedExperts
    from .moe.layer import ThunderMoELayer
    from .moe.router import Routing, TopKRouter

__version__ = "0.1.0"

# Names whose modules import torch, imported on first use (`thunderep.Placement`, `from thunderep import
# Placement`): `import thunderep` and the `thunderep` command's --help then start in a fraction of a second.
_LAZY = {
    "Placement": "thunderep.balance.placement",
    "EPGroups": "thunderep.comm.groups",
    "init_expert_parallel": "thunderep.comm.groups",
    "ExpertParallel": "thunderep.comm.runtime",
    "FusedExperts": "thunderep.moe.experts",
    "ThunderMoELayer": "thunderep.moe.layer",
    "Routing": "thunderep.moe.router",
    "TopKRouter": "thunderep.moe.router",
}

__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "EPConfig",
    "EPGroups",
    "ExpertParallel",
    "ExpertsConfig",
    "FusedExperts",
    "InputError",
    "LayerConfig",
    "PeerTimeout",
    "Placement",
    "RouterConfig",
    "Routing",
    "RoutingError",
    "SharedExpertsConfig",
    "SyncConfig",
    "ThunderError",
    "ThunderMoELayer",
    "TopKRouter",
    "UnsupportedModelError",
    "__version__",
    "init_expert_parallel",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'thunderep' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
