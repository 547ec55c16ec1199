"""Gather everything the doctor looks at into one frozen `Facts` value.

`collect()` is the only place that reads files or runs commands; the checks are pure functions of the
`Facts` it returns, so tests can build facts from fixture trees and assert verdicts exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .gpu import CudaReport
from .host import (
    DriverInfo,
    IommuInfo,
    KernelInfo,
    ModprobeRule,
    loaded_modules,
    parse_bar1,
    parse_p2p_matrix,
    read_driver,
    read_iommu,
    read_kernel,
    uvm_modprobe_rules,
)
from .pci import Acs, LspciEntry, PciDevice, bar_sizes, nvidia_gpus, parse_lspci, read_acs, scan_pci, upstream_bridges
from .software import SoftwareReport
from .sources import HostFS, Runner

__all__ = ["Facts", "collect", "LSPCI_ARGV", "SMI_MEMORY_ARGV", "SMI_P2P_ARGV"]

LSPCI_ARGV = ("lspci", "-D", "-nn", "-vvv")
SMI_MEMORY_ARGV = ("nvidia-smi", "-q", "-d", "MEMORY")
SMI_P2P_ARGV = ("nvidia-smi", "topo", "-p2p", "r")


@dataclass(frozen=True)
class Facts:
    """A snapshot of one machine, as far as ThunderEP cares."""

    root: str
    devices: dict[str, PciDevice]
    gpus: tuple[PciDevice, ...]
    lspci: dict[str, LspciEntry]
    acs: dict[str, Acs]  # every bridge upstream of an NVIDIA GPU
    kernel: KernelInfo
    iommu: IommuInfo
    modules: frozenset[str]
    driver: DriverInfo
    modprobe_rules: tuple[ModprobeRule, ...]
    bar1_mib: dict[str, int]  # per GPU BDF
    bar1_source: str  # "nvidia-smi", "sysfs resource" or ""
    smi_p2p: tuple[tuple[str, ...], ...]  # nvidia-smi topo -p2p r (GPU order = PCI order)
    cuda: CudaReport | None
    notes: tuple[str, ...] = field(default=())
    software: SoftwareReport | None = None  # this interpreter (real root only)

    def name(self, bdf: str) -> str:
        """A human name for a device: lspci's description, else vendor:device ids."""
        if bdf in self.lspci:
            return self.lspci[bdf].description
        if self.cuda is not None:
            for d in self.cuda.devices:
                if d.bdf == bdf:
                    return d.name
        dev = self.devices.get(bdf)
        return f"[{dev.ids}]" if dev else "?"

    def port_type(self, bdf: str) -> str | None:
        entry = self.lspci.get(bdf)
        return entry.port_type if entry else None


def collect(fs: HostFS, runner: Runner, cuda: CudaReport | None = None,
            software: SoftwareReport | None = None) -> Facts:
    """Read the machine under `fs` (commands through `runner`); `cuda` comes from gpu.cuda_report(),
    `software` from software.software_report()."""
    notes = []
    devices = scan_pci(fs)
    gpus = tuple(nvidia_gpus(devices))

    lspci: dict[str, LspciEntry] = {}
    res = runner(list(LSPCI_ARGV))
    if res.ok:
        lspci = parse_lspci(res.stdout)
    elif gpus:
        notes.append("lspci not available (install pciutils): device names and ACS fall back to sysfs/setpci")

    acs: dict[str, Acs] = {}
    for gpu in gpus:
        for bridge in upstream_bridges(devices, gpu.bdf):
            if bridge.is_bridge and bridge.bdf not in acs:
                acs[bridge.bdf] = read_acs(fs, bridge, runner, lspci.get(bridge.bdf))

    modules = frozenset(loaded_modules(fs))
    driver = read_driver(fs, set(modules))

    bar1: dict[str, int] = {}
    source = ""
    smi_p2p: list[list[str]] = []
    if gpus:
        res = runner(list(SMI_MEMORY_ARGV))
        if res.ok:
            bar1 = {k: v for k, v in parse_bar1(res.stdout).items() if any(g.bdf == k for g in gpus)}
            source = "nvidia-smi" if bar1 else ""
        elif res.returncode == 127 and driver.loaded:
            notes.append("nvidia-smi not found: install the NVIDIA utilities package for BAR1 and P2P status")
        if not bar1:
            for g in gpus:
                sizes = bar_sizes(fs, g)
                if len(sizes) > 1 and sizes[1]:
                    bar1[g.bdf] = sizes[1] >> 20
            source = "sysfs resource" if bar1 else ""
        if len(gpus) >= 2:
            res = runner(list(SMI_P2P_ARGV))
            if res.ok:
                smi_p2p = parse_p2p_matrix(res.stdout)

    return Facts(
        root=str(fs.root),
        devices=devices,
        gpus=gpus,
        lspci=lspci,
        acs=acs,
        kernel=read_kernel(fs),
        iommu=read_iommu(fs),
        modules=modules,
        driver=driver,
        modprobe_rules=tuple(uvm_modprobe_rules(fs)),
        bar1_mib=bar1,
        bar1_source=source,
        smi_p2p=tuple(tuple(r) for r in smi_p2p),
        cuda=cuda,
        notes=tuple(notes),
        software=software,
    )
