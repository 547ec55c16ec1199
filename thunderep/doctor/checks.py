"""Verdicts: one pure function per check, each `Facts -> Check(s)` with the exact fix.

Verdicts: `ok` (nothing to do), `warn` (works, but slower or less safe than it could be), `fail`
(something ThunderEP needs is broken), `n/a` (does not apply here, or cannot be known without a
privilege or tool that is missing; the summary says which).
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import Facts
from .host import cmdline_values, pci_options
from .pci import ACS_REDIRECT_MASK, acs_targets, describe_acs

__all__ = ["Check", "VERDICTS", "SYSCONFIG", "run_checks", "setpci_clear_argv"]

VERDICTS = ("ok", "warn", "fail", "n/a")
SYSCONFIG = "sysconfig/thunderep-sysconfig"
"""The setup script, as run from a ThunderEP checkout."""
_APPLY = f"review `sudo {SYSCONFIG} plan`, then `sudo {SYSCONFIG} apply --yes`"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    summary: str
    fix: str = ""
    details: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.verdict in VERDICTS, self.verdict


def setpci_clear_argv(bdf: str, ids: str | None = None) -> list[str]:
    """setpci command clearing only ACS RR, CR and EC on `bdf` (and only if its ids match `ids`)."""
    argv = ["setpci", "-s", bdf]
    if ids:
        argv += ["-d", ids]
    return argv + [f"ECAP_ACS+0x6.w=0000:{ACS_REDIRECT_MASK:04x}"]


def _gpus(f: Facts) -> Check:
    if not f.gpus:
        return Check("gpus", "n/a", "no NVIDIA GPU on the PCI bus: ThunderEP runs on the CPU (gloo)")
    listing = "; ".join(f"{g.bdf} {f.name(g.bdf)}" for g in f.gpus)
    summary = f"{len(f.gpus)} NVIDIA GPU{'s' if len(f.gpus) > 1 else ''}: {listing}"
    if f.cuda is not None and len(f.cuda.devices) != len(f.gpus):
        return Check("gpus", "warn", f"{summary}; but CUDA sees {len(f.cuda.devices)}",
                     "check CUDA_VISIBLE_DEVICES and that `nvidia-smi` lists every GPU")
    return Check("gpus", "ok", summary)


def _driver(f: Facts) -> list[Check]:
    if not f.gpus:
        return [Check("driver", "n/a", "no NVIDIA GPU"), Check("kernel module", "n/a", "no NVIDIA GPU")]
    other = [f"{g.bdf} is bound to {g.driver}" for g in f.gpus if g.driver and g.driver != "nvidia"]
    if not f.driver.loaded:
        fix = ("install the NVIDIA driver (your distribution's package or NVIDIA's installer) and reboot; "
               "`nvidia-smi` must then list every GPU")
        if other:
            fix += f" ({'; '.join(other)}: the installer blacklists nouveau, vfio-pci bindings are yours)"
        return [Check("driver", "fail", "NVIDIA kernel driver not loaded (no /proc/driver/nvidia/version)", fix),
                Check("kernel module", "n/a", "no NVIDIA kernel module loaded")]
    version = f.driver.version or "?"
    driver = Check("driver", "ok", f"NVIDIA driver {version} loaded")
    if other:
        driver = Check("driver", "warn", f"NVIDIA driver {version} loaded, but {'; '.join(other)}",
                       "unbind those GPUs from the other driver (or stop passing them to a VM) to use them")
    flavor = f.driver.flavor or "unknown"
    module = Check("kernel module", "ok", f"{flavor} kernel module ({version})",
                   details=("/proc/driver/nvidia/version says \"Open Kernel Module\" for the open flavour",
                            "community patches that enable P2P on GeForce cards exist only for the open flavour"))
    return [driver, module]


def _uvm(f: Facts) -> Check:
    if not f.driver.loaded:
        return Check("nvidia_uvm", "n/a", "NVIDIA driver not loaded")
    why = "CUDA cannot initialise without nvidia_uvm, so advice to unload it breaks CUDA"
    blocking = [r for r in f.modprobe_rules if r.blocks]
    if blocking:
        where = "; ".join(f"{r.path} line {r.line_no}: `{r.line}`" for r in blocking)
        every = "; ".join(f"{r.path} line {r.line_no}: `{r.line}`" for r in f.modprobe_rules)
        return Check("nvidia_uvm", "fail", f"modprobe configuration refuses to load nvidia_uvm ({where})",
                     f"delete {every} ({why}); then `sudo modprobe nvidia_uvm`")
    if not f.driver.uvm_loaded:
        return Check("nvidia_uvm", "fail", f"nvidia_uvm is not loaded: {why}",
                     f"now: `sudo modprobe nvidia_uvm && sudo nvidia-modprobe -u -c=0`; at every boot: {_APPLY}")
    if not f.driver.uvm_device:
        return Check("nvidia_uvm", "warn", "nvidia_uvm is loaded but /dev/nvidia-uvm is missing",
                     "`sudo nvidia-modprobe -u -c=0` creates /dev/nvidia-uvm (containers: pass the device in)")
    if f.modprobe_rules:
        where = "; ".join(f"{r.path} line {r.line_no}: `{r.line}`" for r in f.modprobe_rules)
        return Check("nvidia_uvm", "warn", f"nvidia_uvm is loaded, but blacklisted ({where})",
                     f"delete {where}: {why}")
    return Check("nvidia_uvm", "ok", "nvidia_uvm loaded and /dev/nvidia-uvm present")


def _links(f: Facts) -> list[Check]:
    out = []
    for g in f.gpus:
        name = f"link {g.bdf}"
        link = g.link
        if link is None or link.width is None or link.max_width is None:
            out.append(Check(name, "n/a", "sysfs shows no PCIe link attributes for this device"))
            continue
        parent = f.devices.get(g.parent) if g.parent else None
        plink = parent.link if parent else None
        exp_w = min(link.max_width, plink.max_width) if plink and plink.max_width else link.max_width
        speeds = [s for s in (link.max_speed, plink.max_speed if plink else None) if s]
        exp_s = min(speeds) if speeds else None
        now = link.describe()
        path = f"/sys/bus/pci/devices/{g.bdf}"
        if link.width < exp_w:
            out.append(Check(name, "warn", f"{now}: trained at x{link.width} though both ends support x{exp_w}",
                             "reseat the card, try without a riser, check the slot's electrical width and the "
                             f"firmware's bifurcation setting; verify with `cat {path}/current_link_width`"))
        elif exp_s and link.speed and link.speed < exp_s:
            out.append(Check(name, "warn",
                             f"{now}: running at {link.speed:g} GT/s though both ends support {exp_s:g} GT/s",
                             "GPUs lower the link speed when idle: check again under load "
                             f"(`cat {path}/current_link_speed` while a copy runs); if it stays low, set the "
                             "slot to Auto/the highest generation in the firmware and check risers"))
        elif exp_w < link.max_width or (exp_s and link.max_speed and exp_s < link.max_speed):
            out.append(Check(name, "warn",
                             f"{now}: limited by upstream port {parent.bdf} (max {plink.describe_max()})",
                             "a hardware limit of the slot or switch: moving the card to a full-width, "
                             "current-generation slot raises it; nothing to change in software"))
        else:
            out.append(Check(name, "ok", now))
    return out


def _numa(f: Facts) -> Check:
    nodes = {g.bdf: g.numa_node for g in f.gpus}
    if len(f.gpus) < 2 or all(n is None for n in nodes.values()):
        return Check("numa", "n/a", "fewer than two GPUs or no NUMA information (single node)")
    listing = ", ".join(f"{b}: node {n}" for b, n in nodes.items())
    if len({n for n in nodes.values() if n is not None}) > 1:
        return Check("numa", "warn", f"GPUs on different NUMA nodes ({listing}): traffic between them crosses "
                     "the inter-socket link, where P2P is often unavailable",
                     "prefer GPUs of one socket for one ThunderEP group; bind each rank to its GPU's node "
                     "(`numactl --cpunodebind=N --membind=N`)")
    return Check("numa", "ok", listing)


def _iommu(f: Facts) -> Check:
    off = [t for t in f.kernel.cmdline if t in ("iommu=off", "intel_iommu=off", "amd_iommu=off")]
    if not f.iommu.active:
        why = f"off on the kernel command line ({' '.join(off)})" if off else "no IOMMU unit active"
        return Check("iommu", "ok", f"{why}: peer traffic is not translated (and device DMA is not confined)")
    units = ", ".join(f.iommu.units)
    types = {g.bdf: f.iommu.domain_type(g.bdf) for g in f.gpus}
    known = {b: t for b, t in types.items() if t}
    if f.gpus and known and all(t == "identity" for t in known.values()):
        return Check("iommu", "ok", f"IOMMU on ({units}), GPUs in passthrough (identity) domains")
    translated = sorted({t for t in known.values() if t != "identity"})
    if not known:
        pt = "pt" in cmdline_values(f.kernel.cmdline, "iommu")
        if pt or not f.gpus:
            return Check("iommu", "ok", f"IOMMU on ({units})" + (", iommu=pt on the command line" if pt else ""))
        translated = ["probably translated: no group type in sysfs and no iommu=pt"]
    summary = f"IOMMU on ({units}) and translating the GPUs' DMA ({', '.join(translated)})"
    if len(f.gpus) < 2:
        return Check("iommu", "ok", summary + "; costs only peer-to-peer traffic, which one GPU does not use")
    flag = " intel_iommu=on" if f.kernel.cpu_vendor == "intel" else ""
    return Check("iommu", "warn",
                 summary + ": peer-to-peer packets must go up to the root complex to be translated, and "
                 "some platforms and drivers refuse P2P under translation",
                 f"boot with `iommu=pt{flag}` (the IOMMU stays on, host-owned devices get identity mappings): "
                 f"{_APPLY}, then reboot")


def _acs(f: Facts) -> Check:
    if len(f.gpus) < 2:
        return Check("acs", "n/a", "fewer than two GPUs: ACS only affects traffic between devices")
    targets = acs_targets(f.devices, f.gpus)
    if not targets:
        return Check("acs", "ok", "no bridge between the GPUs")
    readings = {d.bdf: f.acs.get(d.bdf) for d in targets}
    details = tuple(
        f"{b} {f.name(b)}: " + ("unreadable" if a is None or not a.readable else
                                "no ACS capability" if not a.present else
                                f"ACSCtl {describe_acs(a.control)} ({a.source})")
        for b, a in readings.items())
    redirect = [d for d in targets if (a := readings[d.bdf]) is not None and a.redirects]
    unreadable = [b for b, a in readings.items() if a is None or not a.readable]
    if redirect:
        now = "; ".join("sudo " + " ".join(setpci_clear_argv(d.bdf)) for d in redirect)
        return Check("acs", "warn",
                     f"ACS sends peer traffic up to the root complex at {', '.join(d.bdf for d in redirect)}",
                     f"now, until reboot: `{now}`; at every boot: {_APPLY} (this removes the isolation "
                     "between these devices: see docs/guide/doctor-and-sysconfig.md)", details)
    if unreadable:
        return Check("acs", "n/a", f"ACS bits of {', '.join(unreadable)} are unreadable without root",
                     "run `sudo thunderep doctor` (reading is harmless; only root can read PCIe extended "
                     "config space)", details)
    return Check("acs", "ok", f"no ACS redirect on the {len(targets)} bridge(s) between the GPUs", details=details)


def _kernel_params(f: Facts) -> Check:
    k = f.kernel
    ver = f"{k.version[0]}.{k.version[1]}" if k.version else "?"
    found, problems = [], []
    for opt in pci_options(k.cmdline):
        for name, since in (("disable_acs_redir=", (4, 19)), ("config_acs=", (6, 11))):
            if opt.startswith(name):
                found.append(f"pci={opt}")
                if k.version and k.version < since:
                    problems.append(f"pci={name} needs Linux {since[0]}.{since[1]}+; this kernel ({ver}) ignores it")
    if cmdline_values(k.cmdline, "pcie_acs_override"):
        found.append("pcie_acs_override")
        problems.append("pcie_acs_override only changes how the kernel groups devices for VFIO; it does not "
                        "change how the switch routes peer traffic"
                        + ("" if k.acs_override_patch else ", and this kernel lacks the out-of-tree patch"))
    if problems:
        return Check("kernel params", "warn", "; ".join(problems),
                     f"remove the parameter(s) ({', '.join(found)}) from the boot loader unless you need them "
                     f"for VFIO; {_APPLY} writes the ones this kernel supports")
    if found:
        return Check("kernel params", "ok", f"{', '.join(found)} (kernel {ver})")
    return Check("kernel params", "ok", f"no ACS parameters on the command line (kernel {k.release or '?'})")


def _bar1(f: Facts) -> Check:
    if not f.gpus:
        return Check("bar1", "n/a", "no NVIDIA GPU")
    if not f.bar1_mib:
        return Check("bar1", "n/a", "BAR1 size unknown (no nvidia-smi, no sysfs resource file)")
    listing = ", ".join(f"{b}: {m} MiB" for b, m in sorted(f.bar1_mib.items()))
    small = [b for b, m in f.bar1_mib.items() if m <= 256]
    if small and len(f.gpus) >= 2:
        return Check("bar1", "warn", f"BAR1 {listing} ({f.bar1_source}): Resizable BAR is off, so a peer "
                     "can map only 256 MiB of each GPU's memory through BAR1",
                     "enable 'Above 4G Decoding' and 'Re-Size BAR Support' in the firmware setup (BIOS/UEFI), "
                     "then check again")
    return Check("bar1", "ok", f"BAR1 {listing} ({f.bar1_source})")


def _p2p_fix(f: Facts) -> str:
    hints = []
    if _acs(f).verdict == "warn":
        hints.append("clear ACS redirect (see the acs check)")
    if _iommu(f).verdict == "warn":
        hints.append("boot with iommu=pt (see the iommu check)")
    if any("GeForce" in f.name(g.bdf) for g in f.gpus):
        hints.append("NVIDIA's driver does not enable PCIe P2P on recent GeForce cards (e.g. RTX 4090); NCCL "
                     "then moves data through "
                     "host memory, which works. A community-patched open kernel module "
                     "(tinygrad/open-gpu-kernel-modules) enables it; its README asks for Resizable BAR and the "
                     "IOMMU off. ThunderEP neither ships nor tests it")
    return "; ".join(hints) or "check the acs, iommu and bar1 checks"


def _p2p(f: Facts) -> Check:
    if len(f.gpus) < 2 and (f.cuda is None or len(f.cuda.devices) < 2):
        return Check("p2p", "n/a", "fewer than two GPUs")
    if f.cuda is not None and len(f.cuda.devices) >= 2:
        m = f.cuda.can_access_peer
        missing = [(i, j) for i in range(len(m)) for j in range(len(m)) if i != j and not m[i][j]]
        source, pairs = "torch.cuda.can_device_access_peer", len(m) * (len(m) - 1)
    elif f.smi_p2p:
        m = f.smi_p2p
        missing = [(i, j) for i in range(len(m)) for j in range(len(m)) if i != j and m[i][j] != "OK"]
        source, pairs = "nvidia-smi topo -p2p r", len(m) * (len(m) - 1)
    else:
        return Check("p2p", "n/a", "needs torch with CUDA or nvidia-smi to read peer access")
    if not missing:
        return Check("p2p", "ok", f"peer access on all {pairs} GPU pairs ({source})")
    listing = ", ".join(f"{i}->{j}" for i, j in missing)
    return Check("p2p", "warn", f"no peer access for {len(missing)} of {pairs} pairs ({listing}; {source})",
                 _p2p_fix(f))


def _bandwidth(f: Facts) -> Check:
    if f.cuda is None or not f.cuda.bandwidth:
        return Check("bandwidth", "n/a", "not measured: needs two or more CUDA GPUs that torch sees on this "
                     "machine (skipped with --no-cuda, --no-bandwidth or a --root other than /)")
    rows = [b for b in f.cuda.bandwidth if b.error is None]
    errors = [f"{b.src}->{b.dst}: {b.error}" for b in f.cuda.bandwidth if b.error]
    if not rows:
        return Check("bandwidth", "fail", "every copy failed: " + "; ".join(errors),
                     "run `nvidia-smi` and check dmesg for Xid errors")
    details = tuple(f"{b.src}->{b.dst}: peer copy {b.peer_gbps:.1f} GB/s "
                    f"({'P2P' if b.peer_access else 'driver-staged'}), via host {b.via_host_gbps:.1f} GB/s"
                    for b in rows) + tuple(errors)
    worst = min(rows, key=lambda b: b.peer_gbps)
    summary = (f"peer copy {min(b.peer_gbps for b in rows):.1f}-{max(b.peer_gbps for b in rows):.1f} GB/s, "
               f"via host {min(b.via_host_gbps for b in rows):.1f}-{max(b.via_host_gbps for b in rows):.1f} GB/s "
               f"({worst.nbytes >> 20} MiB copies)")
    slow = [b for b in rows if b.peer_access and b.peer_gbps < b.via_host_gbps]
    if slow or errors:
        return Check("bandwidth", "warn", summary + ("; P2P slower than staging through host on "
                     + ", ".join(f"{b.src}->{b.dst}" for b in slow) if slow else "; some copies failed"),
                     "P2P that loses to host staging usually means ACS redirect or IOMMU translation on the path; "
                     "see the acs and iommu checks", details)
    return Check("bandwidth", "ok", summary, details=details)


_NOT_READ = "not read: this interpreter is read only for the real root (`--root /`)"


def _mailbox(f: Facts) -> Check:
    if f.software is None:
        return Check("mailbox", "n/a", _NOT_READ)
    reason = f.software.mailbox_unavailable
    if reason is None:
        return Check("mailbox", "ok", "the mailbox extension loads: runs on one host use the shared-memory "
                                      "control plane")
    return Check("mailbox", "warn", "the mailbox extension cannot be used: runs fall back to the collective "
                                    "control plane (slower per step), and EPConfig(control='mailbox') raises",
                 reason)


def _triton(f: Facts) -> Check:
    if f.software is None:
        return Check("triton", "n/a", _NOT_READ)
    version = f.software.triton_version
    if not f.gpus and (f.cuda is None or not f.cuda.devices):
        return Check("triton", "n/a", "no NVIDIA GPU: the CPU path needs no Triton"
                     + (f" (Triton {version} is installed)" if version else ""))
    if version is None:
        return Check("triton", "warn", "Triton cannot be imported: on CUDA, FusedExperts runs torch's grouped "
                                       "GEMM or a per-expert loop instead of the Triton expert kernels, and "
                                       "`thunderep serve` transformers' experts function",
                     "`pip install triton` (CUDA builds of torch on Linux bring it along)")
    return Check("triton", "ok", f"Triton {version}: FusedExperts runs the Triton expert kernels on CUDA, and "
                                 "`thunderep serve` runs them for bfloat16 / float16 experts they cover "
                                 "(--experts-implementation auto)")


def run_checks(f: Facts) -> list[Check]:
    """Every check, in report order."""
    return [_gpus(f), *_driver(f), _uvm(f), *_links(f), _numa(f), _iommu(f), _acs(f), _kernel_params(f),
            _bar1(f), _p2p(f), _bandwidth(f), _mailbox(f), _triton(f)]
