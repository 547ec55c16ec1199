"""GPU kernels (Triton) for the routed-expert MLP, registered as torch.library custom ops.

`available()` says whether they can run here; `thunderep.kernels.ops` (imported on demand, it needs
Triton) holds the ops. FusedExperts uses them on CUDA by itself (ExpertsConfig.backend "auto" or
"triton"); the CPU path never imports Triton.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["available"]


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device=None) -> bool:
    """Whether the Triton expert kernels can run on `device` (a CUDA device, with Triton installed)."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and _triton_importable()
