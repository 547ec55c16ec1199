"""The PCI tree as sysfs shows it, and the ACS control bits of its bridges.

Devices are found by walking `/sys/devices/pci<domain>:<bus>/...`: every device directory sits under
its upstream bridge, so the path from a GPU to its root complex is the directory path itself (no
symlinks needed, which keeps fixture trees plain). Per device we read `vendor`, `device`, `class`,
`current_link_speed`, `current_link_width`, `max_link_speed`, `max_link_width`, `numa_node`, `uevent`
(bound driver) and `resource` (BAR sizes).

ACS (Access Control Services) is a PCIe extended capability (ID 0x000d). Its 16-bit capability
register sits at +4 and its control register at +6 (`setpci ECAP_ACS+0x6.w`). Control bits:
SV 0x01 source validation, TB 0x02 translation blocking, RR 0x04 P2P request redirect,
CR 0x08 P2P completion redirect, UF 0x10 upstream forwarding, EC 0x20 P2P egress control,
DT 0x40 direct translated P2P. RR, CR and EC are the bits that send peer-to-peer traffic up to the
root complex instead of straight across a switch; they are the bits the kernel's
`pci=disable_acs_redir=` clears, and the only ones ThunderEP ever changes.

Reading ACS needs the extended config space, which Linux shows only to root (non-root reads of
`config` stop at 64 bytes). The reading order is: sysfs `config` (when readable in full), then
`setpci`, then `lspci -vvv`; when none can see it the state is reported as unreadable, never guessed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

from .sources import HostFS, Runner

__all__ = [
    "NVIDIA_VENDOR",
    "ACS_BITS",
    "ACS_REDIRECT_MASK",
    "ACS_ECAP_ID",
    "Link",
    "PciDevice",
    "Acs",
    "LspciEntry",
    "scan_pci",
    "nvidia_gpus",
    "upstream_bridges",
    "bridges_between",
    "acs_targets",
    "parse_lspci",
    "parse_acs_from_config",
    "read_acs",
    "bar_sizes",
    "describe_acs",
    "parse_speed",
]

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # class >> 8: VGA-compatible controller, 3D controller
BRIDGE_CLASS = 0x0604  # PCI-to-PCI bridge (root ports, switch ports)

ACS_ECAP_ID = 0x000D
ACS_BITS = {"SV": 0x01, "TB": 0x02, "RR": 0x04, "CR": 0x08, "UF": 0x10, "EC": 0x20, "DT": 0x40}
ACS_REDIRECT_MASK = ACS_BITS["RR"] | ACS_BITS["CR"] | ACS_BITS["EC"]  # 0x002c
_LSPCI_ACS_NAMES = {
    "SrcValid": "SV", "TransBlk": "TB", "ReqRedir": "RR", "CmpltRedir": "CR",
    "UpstreamFwd": "UF", "EgressCtrl": "EC", "DirectTrans": "DT",
}

_BDF = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST = re.compile(r"^pci[0-9a-f]{4,}:[0-9a-f]{2}$")


def parse_speed(text: str | None) -> float | None:
    """GT/s from a sysfs link speed such as '16.0 GT/s PCIe' or '8 GT/s' (None when unknown)."""
    if not text:
        return None
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text)
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class Link:
    """A device's PCIe link as trained now and at most (speed in GT/s, width in lanes)."""

    speed: float | None
    width: int | None
    max_speed: float | None
    max_width: int | None

    @staticmethod
    def _fmt(speed: float | None, width: int | None) -> str:
        return f"{'?' if speed is None else f'{speed:g}'} GT/s x{'?' if width is None else width}"

    def describe_max(self) -> str:
        """'16 GT/s x16': the most this end of the link supports."""
        return self._fmt(self.max_speed, self.max_width)

    def describe(self) -> str:
        """'8 GT/s x16 (max 16 GT/s x16)': trained now, and the most this end supports."""
        return f"{self._fmt(self.speed, self.width)} (max {self.describe_max()})"


@dataclass(frozen=True)
class PciDevice:
    """One PCI function. `parent` is the BDF of the upstream bridge (None right under a host bridge)."""

    bdf: str
    parent: str | None
    host_bridge: str
    vendor: int
    device: int
    class_code: int
    link: Link | None
    numa_node: int | None
    driver: str | None
    sysfs: str

    @property
    def is_bridge(self) -> bool:
        return self.class_code >> 8 == BRIDGE_CLASS

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.vendor == NVIDIA_VENDOR and self.class_code >> 8 in GPU_CLASSES

    @property
    def ids(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"


def _int(text: str | None, base: int = 0) -> int | None:
    try:
        return int(text.strip(), base) if text is not None else None
    except ValueError:
        return None


def _read_device(fs: HostFS, sysfs: str, parent: str | None, host: str) -> PciDevice:
    attr = lambda name: fs.read_line(f"{sysfs}/{name}")  # noqa: E731
    link = None
    if attr("current_link_speed") is not None or attr("max_link_speed") is not None:
        link = Link(
            parse_speed(attr("current_link_speed")), _int(attr("current_link_width"), 10),
            parse_speed(attr("max_link_speed")), _int(attr("max_link_width"), 10),
        )
    numa = _int(attr("numa_node"), 10)
    driver = None
    for line in (fs.read_text(f"{sysfs}/uevent") or "").splitlines():
        if line.startswith("DRIVER="):
            driver = line.split("=", 1)[1].strip() or None
    return PciDevice(
        bdf=os.path.basename(sysfs), parent=parent, host_bridge=host,
        vendor=_int(attr("vendor")) or 0, device=_int(attr("device")) or 0,
        class_code=_int(attr("class")) or 0, link=link,
        numa_node=None if numa is None or numa < 0 else numa, driver=driver, sysfs=sysfs,
    )


def scan_pci(fs: HostFS) -> dict[str, PciDevice]:
    """Every PCI function under /sys/devices/pci*, keyed by domain-qualified BDF ('0000:01:00.0')."""
    found: dict[str, PciDevice] = {}

    def walk(sysfs: str, parent: str | None, host: str) -> None:
        for name in fs.listdir(sysfs):
            child = f"{sysfs}/{name}"
            if not fs.path(child).is_dir() or fs.path(child).is_symlink():
                continue
            if _BDF.match(name):
                found[name] = _read_device(fs, child, parent, host)
                walk(child, name, host)
            elif _HOST.match(name):  # a nested domain (e.g. Intel VMD) keeps the same upstream
                walk(child, parent, host)

    for name in fs.listdir("/sys/devices"):
        if _HOST.match(name):
            walk(f"/sys/devices/{name}", None, name)
    return found


def nvidia_gpus(devs: dict[str, PciDevice]) -> list[PciDevice]:
    """NVIDIA display/3D functions in PCI order (the order nvidia-smi uses)."""
    return sorted((d for d in devs.values() if d.is_nvidia_gpu), key=lambda d: d.bdf)


def upstream_bridges(devs: dict[str, PciDevice], bdf: str) -> list[PciDevice]:
    """Bridges from `bdf` up to its root port, nearest first (the device itself excluded)."""
    out = []
    cur = devs[bdf].parent
    while cur is not None and cur in devs:
        out.append(devs[cur])
        cur = devs[cur].parent
    return out


def bridges_between(devs: dict[str, PciDevice], a: str, b: str) -> list[PciDevice]:
    """Bridges a peer-to-peer packet between `a` and `b` crosses below their common ancestor.

    Behind one switch these are the two downstream ports; on two root ports, the root ports
    themselves. These are the ports whose ACS redirect bits decide whether the packet turns around
    in the switch or goes up to the root complex (and its IOMMU).
    """
    up_a, up_b = upstream_bridges(devs, a), upstream_bridges(devs, b)
    common = {d.bdf for d in up_a} & {d.bdf for d in up_b}
    if devs[a].host_bridge != devs[b].host_bridge:
        common = set()
    below = [d for d in up_a if d.bdf not in common] + [d for d in up_b if d.bdf not in common]
    return sorted({d.bdf: d for d in below}.values(), key=lambda d: d.bdf)


def acs_targets(devs: dict[str, PciDevice], gpus: Iterable[PciDevice]) -> list[PciDevice]:
    """Union of `bridges_between` over every pair of GPUs, in PCI order."""
    gpus = list(gpus)
    out: dict[str, PciDevice] = {}
    for i, g in enumerate(gpus):
        for h in gpus[i + 1:]:
            for d in bridges_between(devs, g.bdf, h.bdf):
                out[d.bdf] = d
    return [out[k] for k in sorted(out)]


@dataclass(frozen=True)
class Acs:
    """ACS of one bridge. readable=False: nobody could see it (needs root); present: has the capability."""

    readable: bool
    present: bool = False
    capability: int = 0
    control: int = 0
    source: str = ""

    @property
    def redirects(self) -> bool:
        """True when RR, CR or EC is set: peer traffic is sent up to the root complex."""
        return self.present and bool(self.control & ACS_REDIRECT_MASK)


def describe_acs(bits: int) -> str:
    """'SV+ TB- RR+ CR+ UF+ EC- DT-' for an ACS register value."""
    return " ".join(f"{name}{'+' if bits & bit else '-'}" for name, bit in ACS_BITS.items())


def parse_acs_from_config(config: bytes) -> Acs:
    """ACS from a full (>= 4 KiB extended) config-space dump; walks the extended capability list."""
    offset, seen = 0x100, set()
    while 0x100 <= offset <= len(config) - 8 and offset not in seen:
        seen.add(offset)
        header = int.from_bytes(config[offset:offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            break
        if header & 0xFFFF == ACS_ECAP_ID:
            cap = int.from_bytes(config[offset + 4:offset + 6], "little")
            ctl = int.from_bytes(config[offset + 6:offset + 8], "little")
            return Acs(True, True, cap, ctl, "sysfs config")
        offset = (header >> 20) & 0xFFC
    return Acs(True, False, source="sysfs config")


@dataclass(frozen=True)
class LspciEntry:
    """What `lspci -D -nn -vvv` says about one function (only the fields the doctor uses)."""

    bdf: str
    description: str
    port_type: str | None
    acs_cap: int | None
    acs_ctl: int | None
    caps_denied: bool
    ext_caps_visible: bool


def _acs_flags(text: str) -> int:
    bits = 0
    for token in text.split():
        name, sign = token[:-1], token[-1:]
        if sign == "+" and name in _LSPCI_ACS_NAMES:
            bits |= ACS_BITS[_LSPCI_ACS_NAMES[name]]
    return bits


def parse_lspci(text: str) -> dict[str, LspciEntry]:
    """Parse `lspci -D -nn -vvv` output into entries keyed by BDF."""
    entries: dict[str, LspciEntry] = {}
    head = re.compile(r"^([0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) (.*)$")
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if not lines or not (m := head.match(lines[0].strip())):
            continue
        bdf, rest = m.groups()
        desc = rest.split(": ", 1)[-1]
        desc = re.sub(r"\s*\((?:prog-if|rev [0-9a-f]+\)).*$", "", desc)
        port = cap = ctl = None
        denied = ext = False
        for line in lines[1:]:
            s = line.strip()
            if s.startswith("Capabilities: <access denied>"):
                denied = True
            elif pm := re.match(r"Capabilities: \[[0-9a-f]+\] Express \(v\d\) (.+?)(?:,| \(|$)", s):
                port = pm.group(1).strip()
            elif re.match(r"Capabilities: \[[0-9a-f]{3} v\d+\]", s):
                ext = True
            elif s.startswith("ACSCap:"):
                cap = _acs_flags(s[len("ACSCap:"):])
            elif s.startswith("ACSCtl:"):
                ctl = _acs_flags(s[len("ACSCtl:"):])
        entries[bdf] = LspciEntry(bdf, desc.strip(), port, cap, ctl, denied, ext)
    return entries


def _setpci_word(runner: Runner, bdf: str, reg: str) -> int | None:
    res = runner(["setpci", "-s", bdf, reg])
    if not res.ok:
        return None
    try:
        return int(res.stdout.strip().split()[-1], 16)
    except (ValueError, IndexError):
        return None


def read_acs(fs: HostFS, dev: PciDevice, runner: Runner, lspci: LspciEntry | None = None) -> Acs:
    """ACS state of bridge `dev`: sysfs config, then setpci, then lspci; unreadable if none can see it."""
    config = fs.read_bytes(f"{dev.sysfs}/config")
    if config is not None and len(config) > 0x100:
        return parse_acs_from_config(config)
    ctl = _setpci_word(runner, dev.bdf, "ECAP_ACS+0x6.w")
    if ctl is not None:
        cap = _setpci_word(runner, dev.bdf, "ECAP_ACS+0x4.w")
        return Acs(True, True, cap or 0, ctl, "setpci")
    if lspci is not None and lspci.acs_ctl is not None:
        return Acs(True, True, lspci.acs_cap or 0, lspci.acs_ctl, "lspci")
    if lspci is not None and lspci.ext_caps_visible and not lspci.caps_denied:
        return Acs(True, False, source="lspci")
    return Acs(False)


def bar_sizes(fs: HostFS, dev: PciDevice) -> list[int]:
    """Sizes in bytes of BAR0..BAR5 from sysfs `resource` (0 for unused or upper halves of 64-bit BARs)."""
    sizes = []
    for line in (fs.read_text(f"{dev.sysfs}/resource") or "").splitlines()[:6]:
        parts = line.split()
        if len(parts) < 2:
            sizes.append(0)
            continue
        start, end = int(parts[0], 16), int(parts[1], 16)
        sizes.append(end - start + 1 if end > start else 0)
    return sizes
