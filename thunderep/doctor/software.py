"""What ThunderEP's own optional parts find in this Python environment.

Two parts fall back without an error when they cannot run, so a box can be slower than it should:
the mailbox extension (the shared-memory control plane of one host; without it runs use the
collective control plane, with a RuntimeWarning) and Triton (the CUDA expert kernels; without it
FusedExperts runs torch's grouped GEMM or a per-expert loop, silently). Unlike the rest of the doctor this is about the
running interpreter, so it is read only for the real root, like `gpu.cuda_report`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

__all__ = ["SoftwareReport", "software_report"]


@dataclass(frozen=True)
class SoftwareReport:
    mailbox_unavailable: str | None  # why the mailbox extension cannot be used; None when it loads
    triton_version: str | None  # None when Triton cannot be imported


def software_report() -> SoftwareReport:
    """Read this interpreter. The mailbox extension is imported, or built into its cache directory if a
    source checkout has not built it yet, exactly as the first run on this box would."""
    # deferred: thunderep.comm's package imports torch, which sysconfig (it imports the doctor) runs without
    from ..comm.mailbox import native_unavailable_reason

    triton = None
    if importlib.util.find_spec("triton") is not None:
        try:
            triton = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:  # importable but not installed as a package
            triton = "unknown version"
    return SoftwareReport(native_unavailable_reason(), triton)
