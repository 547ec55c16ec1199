"""Compute the setup plan for one machine: kernel command line, ACS, UVM.

`make_plan` reads the machine (through the doctor's `collect`) and returns only the steps that would
change something, each with its reason, plus notes on what it left alone and a status summary.
It never writes anything; `state.apply_plan` does.
"""

from __future__ import annotations

import os
import textwrap

from ..doctor.checks import setpci_clear_argv
from ..doctor.facts import Facts, collect
from ..doctor.pci import ACS_REDIRECT_MASK, acs_targets, describe_acs
from ..doctor.sources import HostFS, Runner
from .bootloader import (
    DROPIN,
    GRUB_DEFAULT,
    SOURCE_BLOCK,
    bls_options,
    detect_bootloader,
    dropin_params,
    kernel_params,
    render_dropin,
)
from .state import load_state
from .steps import (
    MODPROBE_OPTIONS,
    MODULES_LOAD,
    UNIT,
    UNIT_NAME,
    UNIT_WANTS,
    Options,
    Plan,
    RunCommand,
    Step,
    WriteFile,
)

__all__ = ["make_plan", "render_unit"]

_UVM_WHY = ("CUDA cannot initialise without nvidia_uvm (its unified-memory driver), so advice found online "
            "to unload nvidia-uvm breaks CUDA")


class _Acc:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.notes: list[str] = []
        self.status: list[str] = []


def _cmdline(fs: HostFS, facts: Facts, opts: Options, acc: _Acc) -> None:
    bl = detect_bootloader(fs)
    acc.status.append(f"boot loader: {bl.kind} ({bl.detail})")
    acc.status.append(f"running kernel {facts.kernel.release or '?'}: {' '.join(facts.kernel.cmdline) or '?'}")
    if not opts.cmdline:
        acc.notes.append("kernel command line left alone (--no-cmdline)")
        return
    state = load_state(fs.root) or {}
    ours = list(state.get("kernel_params", [])) if bl.kind == "grubby" else dropin_params(fs)
    params, notes = kernel_params(facts, ours, opts.acs_override)
    acc.notes += notes
    pending = [p.text for p in params if p.text not in facts.kernel.cmdline]
    if pending:
        acc.status.append("kernel parameters wanted but not on the running command line: " + " ".join(pending))
    if not params:
        if ours:
            acc.notes.append(f"parameters added earlier ({' '.join(ours)}) are no longer needed; "
                             "they stay until `revert`")
        return
    why_file = "kernel parameters for GPU peer-to-peer, one comment per parameter with its reason and cost"
    regen_why = "rebuild grub.cfg so the next boot uses the parameters"
    if bl.kind in ("update-grub", "grub-mkconfig"):
        changed = False
        content = render_dropin(params)
        if fs.read_text(DROPIN) != content:
            acc.steps.append(WriteFile(DROPIN, content, why_file))
            changed = True
        if bl.kind == "grub-mkconfig":
            grub = fs.read_text(GRUB_DEFAULT)
            if grub is None:
                acc.notes.append(f"{GRUB_DEFAULT} is missing: cannot hook the drop-in into grub-mkconfig")
                acc.steps = [s for s in acc.steps if not (isinstance(s, WriteFile) and s.path == DROPIN)]
                return
            if SOURCE_BLOCK.strip() not in grub:
                mode = os.stat(fs.path(GRUB_DEFAULT)).st_mode & 0o777
                text = grub if grub.endswith("\n") else grub + "\n"
                acc.steps.append(WriteFile(GRUB_DEFAULT, text + SOURCE_BLOCK,
                                           f"this grub-mkconfig does not read {os.path.dirname(DROPIN)}/: a marked "
                                           "block sources the drop-in (the original file is backed up)", mode))
                changed = True
        if changed:
            acc.steps.append(RunCommand(bl.regenerate, regen_why, undo=(bl.regenerate,), undo_late=True))
    elif bl.kind == "grubby":
        entries = bls_options(fs)
        missing = [p.text for p in params if any(p.text not in e for e in entries)]
        if missing:
            acc.steps.append(RunCommand(
                ("grubby", "--update-kernel=ALL", "--args=" + " ".join(missing)),
                "add the kernel parameters to every boot entry: " + "; ".join(f"{p.text}: {p.reason}" for p in params),
                undo=(("grubby", "--update-kernel=ALL", "--remove-args=" + " ".join(missing)),),
                adds_params=tuple(missing)))
    else:
        acc.notes.append("no supported boot loader found: add these parameters to the kernel command line by "
                         "hand: " + " ".join(p.text for p in params))


def render_unit(setpci: str, bridges: list[tuple[str, str]]) -> str:
    """systemd oneshot unit that clears ACS RR/CR/EC on (bdf, vendor:device) bridges at every boot."""
    execs = "".join(
        f"ExecStart=-{setpci} -s {bdf} -d {ids} ECAP_ACS+0x6.w=0000:{ACS_REDIRECT_MASK:04x}\n" for bdf, ids in bridges)
    return (
        "# Written by thunderep-sysconfig (ThunderEP). Undo: `thunderep-sysconfig revert --yes`.\n"
        "# Clears ACS P2P Request Redirect, Completion Redirect and Egress Control (mask 0x002c of the ACS\n"
        "# control register) on the PCIe bridges between GPUs, so peer-to-peer traffic turns around in the\n"
        "# switch instead of going up to the root complex. Every other ACS bit is left as it is.\n"
        "# Each line names the bridge by address and by vendor:device, so it does nothing if the address\n"
        "# now belongs to another device. Cost: these devices can reach each other without the IOMMU's check.\n"
        "[Unit]\n"
        "Description=ThunderEP: clear ACS peer-to-peer redirect on the PCIe bridges between GPUs\n"
        "Before=nvidia-persistenced.service display-manager.service\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        "RemainAfterExit=yes\n"
        f"{execs}"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def _acs(fs: HostFS, facts: Facts, opts: Options, acc: _Acc) -> None:
    if len(facts.gpus) < 2:
        return
    targets = acs_targets(facts.devices, facts.gpus)
    for d in targets:
        a = facts.acs.get(d.bdf)
        text = ("unreadable without root" if a is None or not a.readable else
                "no ACS capability" if not a.present else
                f"ACSCtl {describe_acs(a.control)}{' (redirects peer traffic)' if a.redirects else ''}")
        acc.status.append(f"bridge between GPUs {d.bdf} [{d.ids}]: {text}")
    installed = fs.exists(UNIT)
    acc.status.append(f"boot unit {UNIT_NAME}: {'installed' if installed else 'not installed'}"
                      f"{', enabled' if fs.exists(UNIT_WANTS) else ''}")
    if not opts.acs:
        acc.notes.append("ACS left alone (--no-acs)")
        return
    with_acs = [d for d in targets if (a := facts.acs.get(d.bdf)) is None or not a.readable or a.present]
    if not with_acs:
        acc.notes.append("no bridge between the GPUs has an ACS capability: nothing to clear")
        return
    setpci = fs.which("setpci") or "/usr/bin/setpci"
    unit = render_unit(setpci, [(d.bdf, d.ids) for d in with_acs])
    if fs.read_text(UNIT) != unit:
        acc.steps.append(WriteFile(UNIT, unit, "reapply the ACS setting at every boot (setpci changes last "
                                   "until reboot)"))
        acc.steps.append(RunCommand(("systemctl", "daemon-reload"), "make systemd read the new unit",
                                    undo=(("systemctl", "daemon-reload"),), undo_late=True))
    if not fs.exists(UNIT_WANTS):
        acc.steps.append(RunCommand(("systemctl", "enable", UNIT_NAME), "run the unit at every boot",
                                    undo=(("systemctl", "disable", UNIT_NAME),)))
    for d in with_acs:
        a = facts.acs.get(d.bdf)
        why = (f"clear ACS RR, CR and EC on {d.bdf} now (until reboot; the unit repeats it at boot). Cost: "
               "devices below it can reach each other without the IOMMU's check")
        if a is not None and a.readable and a.redirects:
            restore = ("setpci", "-s", d.bdf, "-d", d.ids,
                       f"ECAP_ACS+0x6.w={a.control & ACS_REDIRECT_MASK:04x}:{ACS_REDIRECT_MASK:04x}")
            acc.steps.append(RunCommand(tuple(setpci_clear_argv(d.bdf, d.ids)), why, undo=(restore,)))
        elif a is None or not a.readable:
            acc.steps.append(RunCommand(tuple(setpci_clear_argv(d.bdf, d.ids)),
                                        why + " (current value unreadable without root: not restorable)"))


def _uvm(fs: HostFS, facts: Facts, opts: Options, acc: _Acc) -> None:
    drv = facts.driver
    acc.status.append(f"nvidia_uvm: {'loaded' if drv.uvm_loaded else 'not loaded'}, /dev/nvidia-uvm "
                      f"{'present' if drv.uvm_device else 'missing'}, loaded at boot by {MODULES_LOAD}: "
                      f"{'yes' if fs.exists(MODULES_LOAD) else 'no'}")
    for r in facts.modprobe_rules:
        acc.status.append(f"modprobe rule against nvidia_uvm: {r.path} line {r.line_no}: `{r.line}`")
    if not opts.uvm:
        acc.notes.append("nvidia_uvm left alone (--no-uvm)")
        return
    if not drv.loaded:
        acc.notes.append("NVIDIA driver not loaded: nothing to set up for nvidia_uvm (install the driver first)")
        return
    blocking = [r for r in facts.modprobe_rules if r.blocks]
    for r in facts.modprobe_rules:
        acc.notes.append(f"delete {r.path} line {r.line_no} (`{r.line}`) by hand: {_UVM_WHY}"
                         + ("; it makes every load of nvidia_uvm fail" if r.blocks else ""))
    content = ("# Written by thunderep-sysconfig (ThunderEP): load nvidia_uvm at every boot.\n"
               + "".join(f"{line}\n" for line in textwrap.wrap(_UVM_WHY + ".", 100, initial_indent="# ",
                                                               subsequent_indent="# "))
               + "nvidia_uvm\n")
    if fs.read_text(MODULES_LOAD) != content:
        acc.steps.append(WriteFile(MODULES_LOAD, content, f"load nvidia_uvm at boot: {_UVM_WHY}"))
    if not drv.uvm_loaded and not blocking:
        acc.steps.append(RunCommand(("modprobe", "nvidia_uvm"),
                                    f"load it now: {_UVM_WHY} (revert leaves it loaded)"))
    if not drv.uvm_device and not blocking:
        if fs.which("nvidia-modprobe"):
            acc.steps.append(RunCommand(("nvidia-modprobe", "-u", "-c=0"),
                                        "create /dev/nvidia-uvm and /dev/nvidia-uvm-tools, which CUDA opens"))
        else:
            acc.notes.append("/dev/nvidia-uvm is missing and nvidia-modprobe is not installed: CUDA creates it "
                             "when run as root, or install nvidia-modprobe")
    if opts.uvm_disable_hmm:
        hmm = ("# Written by thunderep-sysconfig (ThunderEP) on request (--uvm-disable-hmm).\n"
               "# HMM lets GPU code touch ordinary pageable host memory; ThunderEP only uses pinned memory and\n"
               "# does not need it. Turning it off is a workaround for driver/kernel combinations where HMM\n"
               "# misbehaves; CUDA keeps working. Takes effect the next time nvidia_uvm loads (reboot).\n"
               "options nvidia_uvm uvm_disable_hmm=1\n")
        if fs.read_text(MODPROBE_OPTIONS) != hmm:
            acc.steps.append(WriteFile(MODPROBE_OPTIONS, hmm, "disable HMM in nvidia_uvm (requested)"))


def make_plan(fs: HostFS, runner: Runner, options: Options = Options()) -> Plan:
    """The steps that bring the machine under `fs` to the wanted state (none when it is there already)."""
    facts = collect(fs, runner)
    acc = _Acc()
    acc.status.append(f"NVIDIA GPUs: {', '.join(g.bdf for g in facts.gpus) or 'none'}")
    if not facts.gpus:
        acc.notes.append("no NVIDIA GPU on the PCI bus: nothing to set up")
        return Plan((), tuple(acc.notes), tuple(acc.status))
    _cmdline(fs, facts, options, acc)
    _acs(fs, facts, options, acc)
    _uvm(fs, facts, options, acc)
    return Plan(tuple(acc.steps), tuple(acc.notes), tuple(acc.status))
