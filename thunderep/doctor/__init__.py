"""`thunderep doctor`: what a multi-GPU PCIe box is doing, with a verdict and the exact fix per check.

Checks: GPUs and driver (open or proprietary kernel module), nvidia_uvm and /dev/nvidia-uvm, each
GPU's PCIe link (current vs maximum) and NUMA node, the path from each GPU to its root complex with
the ACS control bits of every bridge on it, IOMMU mode, ACS-related kernel parameters, BAR1
(Resizable BAR) size, the P2P access matrix and, with two or more CUDA GPUs, measured GPU-to-GPU copy
bandwidth direct vs through host memory. For the real root also this Python environment: whether
the mailbox extension (the one-host control plane) and Triton (the CUDA expert kernels) can run,
since without them ThunderEP falls back to slower paths without an error.

It works with or without GPUs, drivers or torch.cuda, and never needs root (what only root can read
is reported as such). Every file is read under `root` and every command goes through a runner, so a
fixture tree (or a tree captured from another machine) can be diagnosed with `--root PATH`.

    thunderep doctor [--json] [--root PATH] [--no-cuda] [--no-bandwidth] [--copy-mib N]

The command line is thunderep/cli/doctor.py.
"""

from __future__ import annotations

import os

from ..errors import ConfigError
from .checks import VERDICTS, Check, run_checks
from .facts import Facts, collect
from .gpu import CudaReport, cuda_report
from .report import Diagnosis, render_json, render_table, to_dict
from .software import SoftwareReport, software_report
from .sources import CommandResult, HostFS, RecordedRunner, Runner, SystemRunner, default_runner

__all__ = [
    "Check",
    "CommandResult",
    "CudaReport",
    "Diagnosis",
    "Facts",
    "HostFS",
    "RecordedRunner",
    "Runner",
    "SoftwareReport",
    "SystemRunner",
    "VERDICTS",
    "diagnose",
    "render_json",
    "render_table",
    "to_dict",
]


def diagnose(
    root: str | os.PathLike[str] = "/",
    runner: Runner | None = None,
    *,
    cuda: bool | CudaReport | None = True,
    measure: bool = True,
    copy_mib: int = 64,
    software: bool | SoftwareReport | None = True,
) -> Diagnosis:
    """Collect facts under `root` and run every check.

    runner: runs lspci / setpci / nvidia-smi; default: real commands for root "/", recorded outputs
        (`<root>/_commands/index.json`) otherwise.
    cuda: True asks torch.cuda (only when `root` is "/": a fixture tree is not this machine's GPUs),
        False skips it, or pass a ready `CudaReport`.
    measure, copy_mib: measure copy bandwidth with buffers of `copy_mib` MiB.
    software: True reads this interpreter (mailbox extension, Triton; only when `root` is "/"), False
        skips it, or pass a ready `SoftwareReport`.
    """
    if copy_mib <= 0:
        raise ConfigError(f"copy_mib ({copy_mib}) must be positive: it is the size of each test copy in MiB")
    fs = HostFS(root)
    if not fs.path("/").is_dir():
        raise ConfigError(f"root ({str(root)!r}) is not a directory: pass '/' or the root of a captured "
                          "filesystem tree")
    missing = [] if fs.is_real_root else [d for d in ("sys", "proc") if not fs.path(f"/{d}").is_dir()]
    if missing:  # an empty or wrong directory would pass as a machine without GPUs
        raise ConfigError(f"root ({str(root)!r}) has no {' or '.join(d + '/' for d in missing)}: it is not a "
                          "captured filesystem tree (one holds at least sys/ and proc/, and _commands/ for "
                          "the commands' outputs)")
    report = None
    if isinstance(cuda, CudaReport):
        report = cuda
    elif cuda and fs.is_real_root:
        report = cuda_report(measure=measure, nbytes=copy_mib << 20)
    soft = software if isinstance(software, SoftwareReport) else (
        software_report() if software and fs.is_real_root else None)
    facts = collect(fs, runner if runner is not None else default_runner(fs), report, soft)
    return Diagnosis(facts, tuple(run_checks(facts)))
