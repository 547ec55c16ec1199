"""ThunderEP: expert parallelism for Mixture-of-Experts models on consumer PCIe machines."""

from __future__ import annotations

from .balance.placement import Placement
from .comm.groups import EPGroups, init_expert_parallel
from .comm.runtime import ExpertParallel
from .config import EPConfig, ExpertsConfig, LayerConfig, RouterConfig, SharedExpertsConfig, SyncConfig
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
from .moe.experts import FusedExperts
from .moe.layer import ThunderMoELayer
from .moe.router import Routing, TopKRouter

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "InputError",
    "EPConfig",
    "EPGroups",
    "ExpertParallel",
    "ExpertsConfig",
    "FusedExperts",
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
