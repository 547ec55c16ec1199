"""Kernel command-line parameters for GPU peer-to-peer, and how to hand them to the boot loader.

Parameters (each only when it applies, see `kernel_params`):
- `iommu=pt`: the IOMMU stays on, but devices owned by the host kernel get identity (passthrough)
  mappings, so peer-to-peer packets need no translation at the root complex. Added only while the
  IOMMU translates the GPUs' DMA (or when this tool added it before).
- `intel_iommu=on` (Intel only, with iommu=pt): keeps the Intel IOMMU explicitly on, so `iommu=pt` has
  an IOMMU to apply to. On AMD there is no flag to add: the AMD IOMMU driver is on whenever the
  firmware enables the IOMMU, and `amd_iommu=on` is not a value the kernel documents.
- `pci=config_acs=x0x00xx@<bridge>;...` (Linux 6.11+) or `pci=disable_acs_redir=<bridge>;...`
  (Linux 4.19+): clear ACS P2P Request Redirect, Completion Redirect and Egress Control at boot, on
  the bridges between GPUs only. config_acs flags are written bit 6 (DT) first down to bit 0 (SV):
  'x' leaves a bit as firmware set it, '0' clears it.
- `pcie_acs_override=downstream,multifunction`: only on request and only when the running kernel
  carries that out-of-tree patch. It changes IOMMU grouping for VFIO, never routing.

Boot loaders: Debian/Ubuntu `update-grub` (drop-in /etc/default/grub.d/90-thunderep.cfg), BLS systems
with `grubby` (Fedora, RHEL: `grubby --update-kernel=ALL --args=...`), and plain `grub2-mkconfig` /
`grub-mkconfig` (the same drop-in, sourced from a marked block appended to /etc/default/grub, whose
original is backed up). Anything else gets the parameters printed for manual entry.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from ..doctor.facts import Facts
from ..doctor.host import cmdline_values
from ..doctor.pci import acs_targets
from ..doctor.sources import HostFS

__all__ = [
    "DROPIN",
    "GRUB_DEFAULT",
    "SOURCE_BLOCK",
    "Param",
    "Bootloader",
    "detect_bootloader",
    "kernel_params",
    "dropin_params",
    "render_dropin",
    "bls_options",
    "grub_quote",
]

DROPIN = "/etc/default/grub.d/90-thunderep.cfg"
GRUB_DEFAULT = "/etc/default/grub"
PARAMS_TAG = "# thunderep-params:"
SOURCE_BLOCK = (
    "\n# >>> thunderep-sysconfig: kernel parameters for GPU peer-to-peer (undo: thunderep-sysconfig revert)\n"
    f"[ -r {DROPIN} ] && . {DROPIN}\n"
    "# <<< thunderep-sysconfig\n"
)
CONFIG_ACS_FLAGS = "x0x00xx"  # DT EC UF CR RR TB SV: clear EC, CR, RR; leave the rest as they are


@dataclass(frozen=True)
class Param:
    text: str
    reason: str


@dataclass(frozen=True)
class Bootloader:
    """kind: 'update-grub', 'grubby', 'grub-mkconfig' or 'none'. regenerate: argv that rebuilds grub.cfg."""

    kind: str
    regenerate: tuple[str, ...] = ()
    detail: str = ""


def detect_bootloader(fs: HostFS) -> Bootloader:
    if fs.which("update-grub"):
        return Bootloader("update-grub", ("update-grub",), f"Debian-style GRUB: drop-in {DROPIN}")
    entries = [e for e in fs.listdir("/boot/loader/entries") if e.endswith(".conf")]
    if fs.which("grubby") and entries:
        return Bootloader("grubby", (), f"BLS entries in /boot/loader/entries ({len(entries)}), edited by grubby")
    for tool in ("grub2-mkconfig", "grub-mkconfig"):
        if fs.which(tool):
            for cfg in ("/boot/grub2/grub.cfg", "/boot/grub/grub.cfg"):
                if fs.is_file(cfg):
                    return Bootloader("grub-mkconfig", (tool, "-o", cfg),
                                      f"{tool} -o {cfg}; drop-in {DROPIN} sourced from {GRUB_DEFAULT}")
            return Bootloader("none", (), f"{tool} found but no grub.cfg under /boot/grub2 or /boot/grub")
    return Bootloader("none", (), "no update-grub, grubby or grub-mkconfig found")


def grub_quote(param: str) -> str:
    """Single-quote a parameter holding ';', which GRUB's script parser would take as a separator."""
    return f"'{param}'" if ";" in param else param


def dropin_params(fs: HostFS) -> list[str]:
    """Parameters our existing drop-in provides (from its machine-readable tag line)."""
    for line in (fs.read_text(DROPIN) or "").splitlines():
        if line.startswith(PARAMS_TAG):
            return line[len(PARAMS_TAG):].split()
    return []


def bls_options(fs: HostFS) -> list[list[str]]:
    """The `options` tokens of every BLS entry."""
    out = []
    for name in fs.listdir("/boot/loader/entries"):
        if name.endswith(".conf"):
            for line in (fs.read_text(f"/boot/loader/entries/{name}") or "").splitlines():
                if line.startswith("options "):
                    out.append(line.split()[1:])
    return out


def kernel_params(facts: Facts, ours: list[str], acs_override: bool = False) -> tuple[list[Param], list[str]]:
    """Parameters to have on the command line, and notes on what was left out and why.

    `ours` are parameters this tool added before; they count as wanted, not as already present, so the
    answer stays the same after the reboot that makes them appear in /proc/cmdline.
    """
    notes: list[str] = []
    params: list[Param] = []
    external = [t for t in facts.kernel.cmdline if t not in ours]
    if len(facts.gpus) < 2:
        return [], ["fewer than two NVIDIA GPUs: no kernel parameter is needed for peer-to-peer"]

    off = [t for t in external if t in ("iommu=off", "intel_iommu=off", "amd_iommu=off")]
    types = {facts.iommu.domain_type(g.bdf) for g in facts.gpus}
    if off:
        notes.append(f"IOMMU is off on the command line ({' '.join(off)}): peer traffic is not translated; "
                     "no IOMMU parameter added")
    elif not facts.iommu.active and "iommu=pt" not in ours:
        notes.append("no IOMMU is active: peer traffic is not translated; no IOMMU parameter added")
    else:
        want_pt = "iommu=pt" in ours or types != {"identity"}
        if want_pt and "iommu=pt" not in external:
            params.append(Param("iommu=pt", "IOMMU stays on, but host-owned devices (the GPUs) get identity "
                                "mappings: peer-to-peer packets need no translation at the root complex. "
                                "Cost: those devices' DMA is no longer confined by the IOMMU"))
        elif not want_pt:
            notes.append("the GPUs are already in passthrough (identity) IOMMU domains: iommu=pt not needed")
        if want_pt and facts.kernel.cpu_vendor == "intel" and not any(
                v.startswith("on") for v in cmdline_values(external, "intel_iommu")):
            params.append(Param("intel_iommu=on", "keeps the Intel IOMMU explicitly on (kernels differ in their "
                                "default), so iommu=pt has an IOMMU to apply to"))
        if want_pt and facts.kernel.cpu_vendor == "amd":
            notes.append("AMD: no vendor flag added: the AMD IOMMU driver is on whenever the firmware enables "
                         "the IOMMU, and `amd_iommu=on` is not a value the kernel documents")

    targets = [d for d in acs_targets(facts.devices, facts.gpus)
               if (a := facts.acs.get(d.bdf)) is None or not a.readable or a.present]
    unreadable = [d.bdf for d in targets if (a := facts.acs.get(d.bdf)) is None or not a.readable]
    if unreadable:
        notes.append(f"ACS of {', '.join(unreadable)} is unreadable without root: assumed present; "
                     "run plan as root for an exact list")
    version = facts.kernel.version
    if targets and version:
        bdfs = [d.bdf for d in targets]
        if version >= (6, 11):
            text = "pci=config_acs=" + ";".join(f"{CONFIG_ACS_FLAGS}@{b}" for b in bdfs)
            why = (f"at boot, clears ACS RR, CR and EC ({CONFIG_ACS_FLAGS}: DT..SV, 'x' = unchanged) on the "
                   "bridges between GPUs, so peer traffic turns around in the switch. Cost: those devices "
                   "can reach each other without the IOMMU's check")
        elif version >= (4, 19):
            text = "pci=disable_acs_redir=" + ";".join(bdfs)
            why = ("at boot, clears ACS RR, CR and EC on the bridges between GPUs, so peer traffic turns "
                   "around in the switch. Cost: those devices can reach each other without the IOMMU's check")
        else:
            text, why = "", ""
            notes.append(f"kernel {facts.kernel.release} predates pci=disable_acs_redir= (4.19): ACS is "
                         "cleared at runtime by the boot unit only")
        if text and text not in external:
            params.append(Param(text, why))
            if len(bdfs) > 1 and version >= (6, 11):
                notes.append("Linux 6.11 reworked ACS parameter parsing, and lists of more than one device "
                             "failed to parse until the upstream fix 'PCI/ACS: Fix pci=config_acs= parameter' "
                             "(2025, backported to stable kernels); the boot unit applies the same bits "
                             "either way, and `thunderep doctor` shows what the bridges really have")
    elif version is None and targets:
        notes.append("kernel version unknown: no ACS parameter added (the boot unit still clears ACS)")

    if acs_override:
        if facts.kernel.acs_override_patch:
            params.append(Param("pcie_acs_override=downstream,multifunction",
                                "requested: makes the kernel treat ports as isolated when it builds IOMMU "
                                "groups (for VFIO). It does not change how peer traffic is routed"))
        else:
            notes.append("--acs-override refused: the running kernel does not carry the out-of-tree "
                         "pcie_acs_override patch, so the parameter would be ignored")
    return params, notes


def render_dropin(params: list[Param]) -> str:
    """The shell fragment grub-mkconfig sources, one comment per parameter."""
    lines = [
        "# Kernel parameters added by thunderep-sysconfig (ThunderEP) for GPU peer-to-peer.",
        "# Undo: `thunderep-sysconfig revert --yes`, or delete this file and regenerate the GRUB configuration.",
        "# Details and security costs: docs/guide/doctor-and-sysconfig.md in the ThunderEP sources.",
        "#",
    ]
    for p in params:
        lines.append(f"# {p.text}:")
        lines += textwrap.wrap(p.reason + ".", 100, initial_indent="#   ", subsequent_indent="#   ",
                               break_on_hyphens=False, break_long_words=False)
    lines.append(f"{PARAMS_TAG} {' '.join(p.text for p in params)}")
    quoted = " ".join(grub_quote(p.text) for p in params)
    lines.append(f'GRUB_CMDLINE_LINUX="${{GRUB_CMDLINE_LINUX}} {quoted}"')
    return "\n".join(lines) + "\n"
