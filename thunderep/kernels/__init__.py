"""GPU kernels (Triton) for the routed-expert MLP, registered as torch.library custom ops.

`available()` says whether they can run here; `thunderep.kernels.ops` (imported on demand, it needs
Triton) holds the ops and their public entries. The modules, by concept:

    act, row_tiles, moe_triton, pairs, pairs4,  the Triton kernels (device code only; pairs4: decode on
    passes                                      4-bit weights)
    ops                                         the torch.library custom ops and the public entries
    sorted_mlp, decode, grouped_gemm            the host side: launches, forward and backward
    tiles, paths, tuning                        tile tables and keys, the choice of path, autotuning
    checks, fp8, int4, graphs                   input checks, FP8 and 4-bit weights, CUDA-graph capture

FusedExperts uses them on CUDA by itself (ExpertsConfig.backend "auto" or
"triton"); the CPU path never imports Triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["available"]


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device=None) -> bool:
    """Whether the Triton expert kernels can run on `device` (a CUDA device, with Triton installed)."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and _triton_importable()
