"""ThunderEP: expert parallelism for Mixture-of-Experts models on consumer PCIe machines."""

from __future__ import annotations

from .config import ExpertsConfig, LayerConfig, RouterConfig, SharedExpertsConfig
from .errors import (
    CommError,
    ConfigError,
    PeerTimeout,
    RoutingError,
    ThunderError,
    UnsupportedModelError,
)
from .experts import FusedExperts
from .layer import ThunderMoELayer
from .router import Routing, TopKRouter

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "ConfigError",
    "ExpertsConfig",
    "FusedExperts",
    "LayerConfig",
    "PeerTimeout",
    "RouterConfig",
    "Routing",
    "RoutingError",
    "SharedExpertsConfig",
    "ThunderError",
    "ThunderMoELayer",
    "TopKRouter",
    "UnsupportedModelError",
    "__version__",
]
