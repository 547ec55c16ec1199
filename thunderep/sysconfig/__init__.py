"""`thunderep-sysconfig`: set up a consumer PCIe multi-GPU box for peer-to-peer, safely.

What it manages (each with its reason, security cost and undo in docs/guide/doctor-and-sysconfig.md):
- the kernel command line, through a GRUB drop-in (or grubby on BLS systems): `iommu=pt` plus the
  vendor flag where one exists, and `pci=config_acs=` / `pci=disable_acs_redir=` where the running
  kernel supports them; `pcie_acs_override` only on request and only if the kernel carries that patch;
- ACS redirect cleared at runtime with setpci on the bridges between GPUs, plus a systemd oneshot unit
  that repeats it at every boot;
- nvidia_uvm kept loaded (CUDA cannot initialise without it) and, on request, `uvm_disable_hmm`.

Dry-run by default: `plan` prints every file (full content) and command; `apply` needs root and
`--yes`, backs files up first and is idempotent; `revert` restores the backups byte for byte.
Everything happens under a root path ("/" by default) so tests run against fixture trees.

This package imports nothing heavy (no torch), so the launcher `sysconfig/thunderep-sysconfig` runs
from a checkout with the system Python alone. The command line is thunderep/cli/sysconfig.py.
"""

from __future__ import annotations

from .command import run_command
from .planner import make_plan
from .state import apply_plan, load_state, revert, revert_plan
from .steps import Options, Plan, RunCommand, WriteFile

__all__ = [
    "Options",
    "Plan",
    "RunCommand",
    "WriteFile",
    "apply_plan",
    "load_state",
    "make_plan",
    "revert",
    "revert_plan",
    "run_command",
]
