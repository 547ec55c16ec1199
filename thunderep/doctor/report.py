"""Render a diagnosis: a readable table with one verdict per check and its fix, or JSON for scripts."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass

from .checks import VERDICTS, Check
from .facts import Facts
from .pci import upstream_bridges, describe_acs

__all__ = ["Diagnosis", "render_table", "render_json", "to_dict"]

_WIDTH = 110
_NAME_W, _VERDICT_W = 19, 8


@dataclass(frozen=True)
class Diagnosis:
    facts: Facts
    checks: tuple[Check, ...]

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(ch.verdict for ch in self.checks)
        return {v: c.get(v, 0) for v in VERDICTS}

    @property
    def exit_code(self) -> int:
        """1 when any check fails, else 0."""
        return 1 if self.counts["fail"] else 0


def _wrap(text: str, first: str, indent: int) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=first, subsequent_indent=" " * indent,
                         break_on_hyphens=False, break_long_words=False) or [first]


def _path_lines(f: Facts) -> list[str]:
    lines = []
    for i, g in enumerate(f.gpus):
        link = g.link.describe() if g.link else "link ?"
        numa = "-" if g.numa_node is None else g.numa_node
        bar1 = f"{f.bar1_mib[g.bdf]} MiB" if g.bdf in f.bar1_mib else "?"
        lines.append(f"GPU{i} {g.bdf} {f.name(g.bdf)}")
        lines.append(f"    link {link}, NUMA node {numa}, BAR1 {bar1}, driver {g.driver or 'none'}")
        for b in upstream_bridges(f.devices, g.bdf):
            acs = f.acs.get(b.bdf)
            if acs is None or not acs.readable:
                acs_text = "ACS unreadable (needs root)"
            elif not acs.present:
                acs_text = "no ACS"
            else:
                acs_text = f"ACSCtl {describe_acs(acs.control)}"
            kind = f.port_type(b.bdf) or "bridge"
            blink = b.link.describe() if b.link else ""
            lines.append(f"  <- {b.bdf} {kind}: {f.name(b.bdf)}")
            lines.append(f"       {blink}{', ' if blink else ''}{acs_text}")
        lines.append(f"  <- {g.host_bridge} (host bridge)")
    return lines


def _p2p_lines(f: Facts) -> list[str]:
    if f.cuda is not None and len(f.cuda.devices) >= 2:
        m = [["X" if i == j else ("yes" if v else "no") for j, v in enumerate(row)]
             for i, row in enumerate(f.cuda.can_access_peer)]
        head = "P2P access (torch.cuda.can_device_access_peer; row can access column; CUDA device order):"
    elif f.smi_p2p:
        m = [list(r) for r in f.smi_p2p]
        head = "P2P read status (nvidia-smi topo -p2p r; PCI order):"
    else:
        return []
    n = len(m)
    lines = [head, "        " + "".join(f"GPU{j:<4}" for j in range(n))]
    lines += [f"  GPU{i:<3}" + "".join(f"{c:<7}" for c in row) for i, row in enumerate(m)]
    if f.cuda is not None and any(d.bdf for d in f.cuda.devices):
        lines.append("  CUDA devices: " + ", ".join(f"{d.index}={d.bdf or '?'} {d.name}" for d in f.cuda.devices))
    return lines


def _bandwidth_lines(f: Facts) -> list[str]:
    if f.cuda is None or not f.cuda.bandwidth:
        return []
    lines = ["GPU-to-GPU copy bandwidth (GB/s, best of several copies, measured side by side):",
             "  copy     peer copy   via host   peer path"]
    for b in f.cuda.bandwidth:
        if b.error:
            lines.append(f"  {b.src} -> {b.dst}   failed: {b.error}")
        else:
            path = "P2P" if b.peer_access else "staged by the driver"
            lines.append(f"  {b.src} -> {b.dst}   {b.peer_gbps:9.1f}  {b.via_host_gbps:9.1f}   {path}")
    return lines


def render_table(d: Diagnosis) -> str:
    """The human report: checks table, then PCIe paths, P2P matrix, bandwidth and notes."""
    f = d.facts
    out = [f"ThunderEP doctor (root {f.root})", ""]
    indent = _NAME_W + _VERDICT_W
    out.append(f"{'CHECK':<{_NAME_W}}{'VERDICT':<{_VERDICT_W}}RESULT")
    for c in d.checks:
        out += _wrap(c.summary, f"{c.name:<{_NAME_W}}{c.verdict:<{_VERDICT_W}}", indent)
        if c.fix and c.verdict != "ok":
            out += _wrap("fix: " + c.fix, " " * indent, indent + 5)
    for title, lines in (("PCIe paths (GPU up to its root complex)", _path_lines(f)),
                         ("", _p2p_lines(f)), ("", _bandwidth_lines(f))):
        if lines:
            out.append("")
            if title:
                out.append(title + ":")
            out += lines
    if f.notes:
        out += [""] + [f"note: {n}" for n in f.notes]
    counts = d.counts
    out += ["", "verdicts: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS)]
    return "\n".join(out) + "\n"


def to_dict(d: Diagnosis) -> dict:
    """A JSON-ready dict: checks, GPUs with their PCIe path, kernel, IOMMU, P2P and bandwidth."""
    f = d.facts
    gpus = []
    for g in f.gpus:
        path = []
        for b in upstream_bridges(f.devices, g.bdf):
            acs = f.acs.get(b.bdf)
            path.append({
                "bdf": b.bdf, "ids": b.ids, "name": f.name(b.bdf), "port_type": f.port_type(b.bdf),
                "link": asdict(b.link) if b.link else None,
                "acs": None if acs is None or not acs.readable else
                {"present": acs.present, "control": acs.control, "capability": acs.capability,
                 "bits": describe_acs(acs.control) if acs.present else None, "source": acs.source},
            })
        gpus.append({
            "bdf": g.bdf, "ids": g.ids, "name": f.name(g.bdf), "driver": g.driver,
            "link": asdict(g.link) if g.link else None, "numa_node": g.numa_node,
            "bar1_mib": f.bar1_mib.get(g.bdf), "iommu_domain": f.iommu.domain_type(g.bdf),
            "host_bridge": g.host_bridge, "path": path,
        })
    cuda = None
    if f.cuda is not None:
        cuda = {"devices": [asdict(x) for x in f.cuda.devices],
                "can_access_peer": [list(r) for r in f.cuda.can_access_peer],
                "bandwidth": [asdict(b) for b in f.cuda.bandwidth]}
    return {
        "root": f.root,
        "counts": d.counts,
        "exit_code": d.exit_code,
        "checks": [asdict(c) for c in d.checks],
        "gpus": gpus,
        "kernel": {"release": f.kernel.release, "cmdline": list(f.kernel.cmdline),
                   "cpu_vendor": f.kernel.cpu_vendor, "acs_override_patch": f.kernel.acs_override_patch},
        "iommu": {"units": list(f.iommu.units), "active": f.iommu.active},
        "driver": asdict(f.driver),
        "nvidia_smi_p2p": [list(r) for r in f.smi_p2p],
        "cuda": cuda,
        "software": asdict(f.software) if f.software is not None else None,
        "notes": list(f.notes),
    }


def render_json(d: Diagnosis) -> str:
    return json.dumps(to_dict(d), indent=2) + "\n"
