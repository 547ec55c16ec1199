"""Host facts outside the PCI tree: kernel, command line, IOMMU, modules, NVIDIA driver, nvidia-smi.

Sources (all under the `HostFS` root, all readable without root):
- /proc/cmdline, /proc/sys/kernel/osrelease, /proc/cpuinfo, /proc/modules, /proc/kallsyms;
- /sys/class/iommu/* (one entry per active IOMMU unit: dmar* on Intel, ivhd* on AMD) and
  /sys/kernel/iommu_groups/<n>/{type,devices/*} (`identity` = passthrough, `DMA`/`DMA-FQ` = translated);
- /proc/driver/nvidia/version (contains "Open Kernel Module" for NVIDIA's open kernel module),
  /dev/nvidia-uvm, and modprobe configuration directories;
- outputs of `nvidia-smi -q -d MEMORY` (BAR1 size) and `nvidia-smi topo -p2p r` (P2P read matrix).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from .sources import HostFS

__all__ = [
    "KernelInfo",
    "IommuInfo",
    "DriverInfo",
    "ModprobeRule",
    "read_kernel",
    "read_iommu",
    "read_driver",
    "loaded_modules",
    "uvm_modprobe_rules",
    "cmdline_values",
    "pci_options",
    "parse_bar1",
    "parse_p2p_matrix",
    "normalize_bdf",
]

MODPROBE_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/local/lib/modprobe.d",
                 "/usr/lib/modprobe.d", "/lib/modprobe.d")


@dataclass(frozen=True)
class KernelInfo:
    """Running kernel: release string, (major, minor), command-line tokens, CPU vendor."""

    release: str | None
    version: tuple[int, int] | None
    cmdline: tuple[str, ...]
    cpu_vendor: str | None  # "intel", "amd" or None
    acs_override_patch: bool  # the out-of-tree pcie_acs_override patch is in this kernel


def cmdline_values(tokens: tuple[str, ...] | list[str], key: str) -> list[str]:
    """Values of `key=` on the command line, in order ('iommu' -> ['pt']); bare `key` gives ''."""
    out = []
    for t in tokens:
        if t == key:
            out.append("")
        elif t.startswith(key + "="):
            out.append(t[len(key) + 1:])
    return out


def pci_options(tokens: tuple[str, ...] | list[str]) -> list[str]:
    """Every comma-separated option of every `pci=` token ('pci=noaer,config_acs=...')."""
    return [opt for value in cmdline_values(tokens, "pci") for opt in value.split(",") if opt]


def read_kernel(fs: HostFS) -> KernelInfo:
    release = fs.read_line("/proc/sys/kernel/osrelease")
    version = None
    if release and (m := re.match(r"(\d+)\.(\d+)", release)):
        version = (int(m.group(1)), int(m.group(2)))
    raw = (fs.read_text("/proc/cmdline") or "").strip()
    try:
        tokens = tuple(shlex.split(raw))
    except ValueError:
        tokens = tuple(raw.split())
    vendor = None
    for line in (fs.read_text("/proc/cpuinfo") or "").splitlines():
        if line.startswith("vendor_id"):
            v = line.split(":", 1)[-1].strip()
            vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd", "HygonGenuine": "amd"}.get(v)
            break
    patch = False
    kallsyms = fs.path("/proc/kallsyms")
    try:
        with open(kallsyms, encoding="utf-8", errors="replace") as f:
            patch = any("pcie_acs_override" in line for line in f)
    except OSError:
        pass
    return KernelInfo(release, version, tokens, vendor, patch)


@dataclass(frozen=True)
class IommuInfo:
    """IOMMU units and the default-domain type of each device's group."""

    units: tuple[str, ...]
    group_of: dict[str, str] = field(default_factory=dict)
    type_of_group: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.units)

    def domain_type(self, bdf: str) -> str | None:
        """'identity' (passthrough), 'DMA' / 'DMA-FQ' (translated), 'blocked', ... or None if unknown."""
        group = self.group_of.get(bdf)
        return self.type_of_group.get(group) if group is not None else None


def read_iommu(fs: HostFS) -> IommuInfo:
    units = tuple(fs.listdir("/sys/class/iommu"))
    group_of, type_of = {}, {}
    for group in fs.listdir("/sys/kernel/iommu_groups"):
        base = f"/sys/kernel/iommu_groups/{group}"
        t = fs.read_line(f"{base}/type")
        if t:
            type_of[group] = t
        for bdf in fs.listdir(f"{base}/devices"):
            group_of[bdf] = group
    return IommuInfo(units, group_of, type_of)


def loaded_modules(fs: HostFS) -> set[str]:
    """Names of loaded kernel modules (/proc/modules; dashes as underscores, like the kernel)."""
    return {line.split()[0].replace("-", "_") for line in (fs.read_text("/proc/modules") or "").splitlines()
            if line.strip()}


@dataclass(frozen=True)
class DriverInfo:
    """The NVIDIA kernel driver as /proc and /dev show it."""

    loaded: bool
    version: str | None
    flavor: str | None  # "open" or "proprietary"
    uvm_loaded: bool
    uvm_device: bool


def read_driver(fs: HostFS, modules: set[str] | None = None) -> DriverInfo:
    modules = loaded_modules(fs) if modules is None else modules
    text = fs.read_text("/proc/driver/nvidia/version")
    version = flavor = None
    if text:
        first = text.splitlines()[0]
        flavor = "open" if "Open Kernel Module" in first else "proprietary"
        if m := re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", first):
            version = m.group(1)
    return DriverInfo(
        loaded=text is not None or "nvidia" in modules,
        version=version, flavor=flavor,
        uvm_loaded="nvidia_uvm" in modules,
        uvm_device=fs.exists("/dev/nvidia-uvm"),
    )


@dataclass(frozen=True)
class ModprobeRule:
    """A modprobe.d line that keeps nvidia_uvm from loading. `blocks`: it stops even explicit loads."""

    path: str
    line_no: int
    line: str
    blocks: bool


def uvm_modprobe_rules(fs: HostFS) -> list[ModprobeRule]:
    """`blacklist nvidia_uvm` (stops auto-loading by alias) and `install nvidia_uvm /bin/false`-style
    lines (stop every load) in the modprobe configuration directories."""
    rules = []
    for d in MODPROBE_DIRS:
        for name in fs.listdir(d):
            if not name.endswith(".conf"):
                continue
            for no, raw in enumerate((fs.read_text(f"{d}/{name}") or "").splitlines(), 1):
                words = raw.split("#", 1)[0].split()
                if len(words) < 2 or words[1].replace("-", "_") != "nvidia_uvm":
                    continue
                if words[0] == "blacklist":
                    rules.append(ModprobeRule(f"{d}/{name}", no, raw.strip(), False))
                elif words[0] == "install" and any(w.endswith(("/false", "/true")) for w in words[2:]):
                    rules.append(ModprobeRule(f"{d}/{name}", no, raw.strip(), True))
    return rules


def normalize_bdf(text: str) -> str:
    """'00000000:01:00.0' (nvidia-smi) or '01:00.0' -> '0000:01:00.0' (lower case)."""
    text = text.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        return "0000:" + text
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def parse_bar1(text: str) -> dict[str, int]:
    """BAR1 total in MiB per GPU from `nvidia-smi -q -d MEMORY`, keyed by normalized BDF."""
    out: dict[str, int] = {}
    gpu, in_bar1 = None, False
    for line in text.splitlines():
        if m := re.match(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$", line.strip()):
            gpu, in_bar1 = normalize_bdf(m.group(1)), False
        elif "BAR1 Memory Usage" in line:
            in_bar1 = True
        elif in_bar1 and (m := re.match(r"\s*Total\s*:\s*(\d+)\s*MiB", line)):
            if gpu is not None:
                out[gpu] = int(m.group(1))
            in_bar1 = False
    return out


def parse_p2p_matrix(text: str) -> list[list[str]]:
    """Square matrix of status codes ('X', 'OK', 'CNS', 'NS', ...) from `nvidia-smi topo -p2p r`."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi underlines the header on a terminal
    rows = []
    for line in text.splitlines():
        words = line.split()
        if words and re.fullmatch(r"GPU\d+", words[0]) and len(words) > 1 and not words[1].startswith("GPU"):
            rows.append(words[1:])
    n = len(rows)
    return [r[:n] for r in rows] if all(len(r) >= n for r in rows) else []
