"""Programmatic dependent launch (PDL): a kernel launched as a dependent of the one before it starts its
programs while that one still runs, and waits for it (griddepcontrol.wait) where it reads its output.
sm_90 and later (H100 / H200, RTX 5090); the decode kernels use it (pairs.py, pair_chunks.py;
docs/ARCHITECTURE.md, "Decode").
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from ..errors import ConfigError

__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_applies"]

try:  # programmatic dependent launch (sm_90 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - a Triton without it: the kernels run with PDL off
    _HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


def pdl_applies(device: torch.device) -> bool:
    """Whether decode's second launch (the pair kernels' down pass, the one-pass kernels' sum) runs as a
    programmatic dependent of its first: on sm_90 and later (H100 / H200, RTX 5090), outside Triton's
    interpreter; THUNDEREP_PDL=0 turns it off. Its programs then start while the first kernel still
    runs, and wait for its output there (docs/ARCHITECTURE.md, "Decode")."""
    raw = os.environ.get("THUNDEREP_PDL", "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"THUNDEREP_PDL={raw!r}: use 0 (off) or 1, or leave it unset")
    if raw == "0" or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _has_pdl(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_pdl(index: int) -> bool:
    """Whether CUDA device `index` (and this Triton) can launch programmatic dependents: asked once per
    device, as decode asks pdl_applies on every step."""
    return _HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9
