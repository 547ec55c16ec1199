"""`thunderep-sysconfig` against copies of fixture boxes in tmp_path.

A `FakeBox` runner plays the machine: it answers recorded read-only commands, keeps the ACS control
registers that setpci writes, and turns `systemctl enable/disable`, `modprobe nvidia_uvm` and
`nvidia-modprobe` into the file changes they would make under the test root. Nothing runs on the real
machine and nothing needs root (the root check is injected).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from thunderep.doctor.sources import CommandResult, HostFS, RecordedRunner
from thunderep.errors import ThunderError
from thunderep.cli.sysconfig import main
from thunderep.sysconfig import Options, RunCommand, WriteFile, load_state, make_plan
from thunderep.sysconfig.bootloader import DROPIN, SOURCE_BLOCK
from thunderep.sysconfig.state import BACKUP_DIR, STATE_FILE
from thunderep.sysconfig.steps import MODPROBE_OPTIONS, MODULES_LOAD, UNIT, UNIT_WANTS

REPO = Path(__file__).resolve().parents[2]
BOXES = Path(__file__).parents[1] / "fixtures" / "boxes"
PLX, TRANSLATED, NO_DRIVER = "2x4090-plx", "2x3090-iommu-translated", "1x4090-no-driver"
SCRIPT = REPO / "sysconfig" / "thunderep-sysconfig"


def copy_box(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(BOXES / name, dst, symlinks=True)
    return dst


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and symlink under root: bytes and mode (links: target)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath, f)
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else (p.read_bytes(), p.stat().st_mode)
    return out


class FakeBox:
    """The machine under `root` as far as the commands sysconfig runs are concerned."""

    def __init__(self, root: Path, fail: str | None = None):
        self.root, self.fail = root, fail
        self.recorded = RecordedRunner(root / "_commands")
        self.calls: list[list[str]] = []
        self.acs: dict[str, int] = {}
        for key in self.recorded.index:
            if m := re.fullmatch(r"setpci -s (\S+) ECAP_ACS\+0x6\.w", key):
                self.acs[m.group(1)] = int(self.recorded(key.split()).stdout, 16)

    def writes(self) -> list[list[str]]:
        """Calls other than the read-only probes."""
        probes = ("lspci", "nvidia-smi")
        return [c for c in self.calls if not (c[0] in probes or (c[0] == "setpci" and "=" not in c[-1]))]

    def __call__(self, argv) -> CommandResult:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail and argv[0] == self.fail:
            return CommandResult(1, "", f"{argv[0]}: simulated failure")
        if argv[0] == "setpci":
            bdf, reg = argv[2], argv[-1]
            if "=" not in reg:
                if reg.startswith("ECAP_ACS+0x6.w") and bdf in self.acs:
                    return CommandResult(0, f"{self.acs[bdf]:04x}\n")
                return self.recorded(argv)
            value, mask = (int(x, 16) for x in reg.split("=")[1].split(":"))
            self.acs[bdf] = (self.acs[bdf] & ~mask) | (value & mask)
            return CommandResult(0)
        wants = self.root / UNIT_WANTS.lstrip("/")
        if argv[:2] == ["systemctl", "enable"]:
            wants.parent.mkdir(parents=True, exist_ok=True)
            wants.symlink_to(UNIT)
        elif argv[:2] == ["systemctl", "disable"]:
            wants.unlink()
        elif argv == ["modprobe", "nvidia_uvm"]:
            with open(self.root / "proc" / "modules", "a") as f:
                f.write("nvidia_uvm 4956160 0 - Live 0x0000000000000000 (POE)\n")
        elif argv == ["nvidia-modprobe", "-u", "-c=0"]:
            (self.root / "dev" / "nvidia-uvm").write_text("")
        elif argv[0] in ("lspci", "nvidia-smi"):
            return self.recorded(argv)
        return CommandResult(0)


def run_main(args: list[str], box: FakeBox, root_user: bool = True) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(["--root", str(box.root), *args], runner=box, is_root=lambda: root_user, out=out)
    return rc, out.getvalue()


def files_of(plan) -> dict[str, str]:
    return {s.path: s.content for s in plan.steps if isinstance(s, WriteFile)}


def commands_of(plan) -> list[tuple[str, ...]]:
    return [s.argv for s in plan.steps if isinstance(s, RunCommand)]


def test_plan_plx_box(tmp_path):
    box = FakeBox(copy_box(tmp_path, PLX))
    plan = make_plan(HostFS(box.root), box)
    files = files_of(plan)
    dropin = files[DROPIN]
    assert "# thunderep-params: pci=disable_acs_redir=0000:02:08.0;0000:02:10.0\n" in dropin
    assert dropin.endswith('GRUB_CMDLINE_LINUX="${GRUB_CMDLINE_LINUX} '
                           "'pci=disable_acs_redir=0000:02:08.0;0000:02:10.0'\"\n")
    assert "iommu=pt" not in dropin  # already on the command line, GPUs already identity-mapped
    assert "ExecStart=-/usr/bin/setpci -s 0000:02:08.0 -d 10b5:8747 ECAP_ACS+0x6.w=0000:002c\n" \
           "ExecStart=-/usr/bin/setpci -s 0000:02:10.0 -d 10b5:8747 ECAP_ACS+0x6.w=0000:002c\n" in files[UNIT]
    assert "Type=oneshot\nRemainAfterExit=yes\n" in files[UNIT] and "WantedBy=multi-user.target" in files[UNIT]
    assert files[MODULES_LOAD].endswith("\nnvidia_uvm\n") and "CUDA cannot initialise" in files[MODULES_LOAD]
    assert commands_of(plan) == [
        ("update-grub",),
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable", "thunderep-acs.service"),
        ("setpci", "-s", "0000:02:08.0", "-d", "10b5:8747", "ECAP_ACS+0x6.w=0000:002c"),
        ("setpci", "-s", "0000:02:10.0", "-d", "10b5:8747", "ECAP_ACS+0x6.w=0000:002c"),
    ]
    undo = {s.argv: s.undo for s in plan.steps if isinstance(s, RunCommand)}
    restore = ("setpci", "-s", "0000:02:08.0", "-d", "10b5:8747", "ECAP_ACS+0x6.w=000c:002c")
    assert undo[commands_of(plan)[3]] == (restore,)
    assert all(not c[0].startswith(("grub2-mkconfig", "modprobe")) for c in commands_of(plan))
    assert box.writes() == []  # planning ran nothing but probes


def test_plan_translated_box(tmp_path):
    box = FakeBox(copy_box(tmp_path, TRANSLATED))
    plan = make_plan(HostFS(box.root), box)
    files = files_of(plan)
    assert "# thunderep-params: iommu=pt pci=config_acs=x0x00xx@0000:00:01.1;x0x00xx@0000:00:01.2\n" in files[DROPIN]
    assert "amd_iommu" not in files[DROPIN] and "intel_iommu" not in files[DROPIN]
    original = (box.root / "etc/default/grub").read_text()
    assert files["/etc/default/grub"] == original + SOURCE_BLOCK
    assert ("grub2-mkconfig", "-o", "/boot/grub2/grub.cfg") in commands_of(plan)
    assert ("modprobe", "nvidia_uvm") not in commands_of(plan)  # blocked by `install ... /bin/false`
    assert any("delete /etc/modprobe.d/50-nvidia-uvm-off.conf line 3" in n for n in plan.notes)
    assert any(n.startswith("AMD: no vendor flag added") for n in plan.notes)


@pytest.mark.parametrize("release, expect", [
    ("4.15.0-20-generic", None),
    ("5.4.0-150-generic", "pci=disable_acs_redir=0000:02:08.0;0000:02:10.0"),
    ("6.10.14", "pci=disable_acs_redir=0000:02:08.0;0000:02:10.0"),
    ("6.11.0-9-generic", "pci=config_acs=x0x00xx@0000:02:08.0;x0x00xx@0000:02:10.0"),
])
def test_acs_parameter_follows_kernel_version(tmp_path, release, expect):
    box = FakeBox(copy_box(tmp_path, PLX))
    (box.root / "proc/sys/kernel/osrelease").write_text(release + "\n")
    plan = make_plan(HostFS(box.root), box)
    dropin = files_of(plan).get(DROPIN, "")
    if expect is None:
        assert "pci=" not in dropin and any("predates pci=disable_acs_redir= (4.19)" in n for n in plan.notes)
    else:
        assert f"# thunderep-params: {expect}\n" in dropin


def test_iommu_parameters(tmp_path):
    box = FakeBox(copy_box(tmp_path, PLX))
    cmdline = box.root / "proc/cmdline"
    cmdline.write_text(cmdline.read_text().replace(" intel_iommu=on iommu=pt", ""))
    for t in (box.root / "sys/kernel/iommu_groups").glob("*/type"):
        t.write_text("DMA\n")
    params = files_of(make_plan(HostFS(box.root), box))[DROPIN]
    assert "# thunderep-params: iommu=pt intel_iommu=on pci=disable_acs_redir=" in params
    cmdline.write_text(cmdline.read_text().strip() + " intel_iommu=off\n")
    plan = make_plan(HostFS(box.root), box)
    assert "iommu" not in files_of(plan)[DROPIN].split("thunderep-params:")[1]
    assert any("IOMMU is off on the command line (intel_iommu=off)" in n for n in plan.notes)


def test_acs_override_only_with_the_patch(tmp_path):
    box = FakeBox(copy_box(tmp_path, PLX))
    plan = make_plan(HostFS(box.root), box, Options(acs_override=True))
    assert "pcie_acs_override" not in files_of(plan)[DROPIN]
    assert any(n.startswith("--acs-override refused") for n in plan.notes)
    (box.root / "proc/kallsyms").write_text("0000000000000000 t pcie_acs_override_setup\n")
    plan = make_plan(HostFS(box.root), box, Options(acs_override=True))
    assert "pcie_acs_override=downstream,multifunction" in files_of(plan)[DROPIN]
    assert "pcie_acs_override" not in files_of(make_plan(HostFS(box.root), box))[DROPIN]  # never by default


def test_apply_refuses_without_yes_or_root(tmp_path):
    box = FakeBox(copy_box(tmp_path, PLX))
    before = snapshot(box.root)
    rc, out = run_main(["apply"], box)
    assert rc == 2 and "dry run: nothing was changed" in out and f"write {UNIT}" in out
    rc, out = run_main(["apply", "--yes"], box, root_user=False)
    assert rc == 2 and "refusing to apply" in out and "needs root" in out
    rc, out = run_main(["revert"], box)
    assert rc == 0 and "nothing to revert" in out
    assert snapshot(box.root) == before and box.writes() == []


@pytest.mark.parametrize("name", [PLX, TRANSLATED])
def test_apply_is_idempotent_and_revert_restores_bytes(tmp_path, name):
    box = FakeBox(copy_box(tmp_path, name))
    before, acs_before = snapshot(box.root), dict(box.acs)
    rc, out = run_main(["apply", "--yes"], box)
    assert rc == 0, out
    assert (box.root / DROPIN.lstrip("/")).is_file() and (box.root / UNIT.lstrip("/")).is_file()
    assert (box.root / UNIT_WANTS.lstrip("/")).is_symlink()
    assert all(v & 0x2C == 0 for v in box.acs.values())
    assert "update-grub" in out or "grub2-mkconfig" in out
    state = load_state(box.root)
    assert DROPIN in state["files"] and state["files"][DROPIN] == {"created": True}
    if name == TRANSLATED:
        assert state["files"]["/etc/default/grub"]["backup"] == f"{BACKUP_DIR}/etc/default/grub"
    after_first, writes = snapshot(box.root), len(box.writes())
    rc, out = run_main(["apply", "--yes"], box)
    assert rc == 0 and "nothing to do" in out
    assert snapshot(box.root) == after_first
    rc, out = run_main(["check"], box)
    assert rc == 0 and "0 change(s) pending" in out
    assert len(box.writes()) == writes  # the second apply and check ran nothing but probes
    rc, out = run_main(["revert", "--yes"], box)
    assert rc == 0, out
    assert snapshot(box.root) == before  # every file byte for byte, created files gone, state gone
    assert box.acs == acs_before
    reverted = [c[0] if c[0] != "systemctl" else " ".join(c[:2]) for c in box.writes()[writes:]]
    regen = "update-grub" if name == PLX else "grub2-mkconfig"
    assert reverted.index("systemctl disable") < reverted.index(regen)  # grub.cfg rebuilt from restored files
    assert out.index("delete /etc/default/grub.d/90-thunderep.cfg") < out.index(f"run   {regen}")
    assert not (box.root / STATE_FILE.lstrip("/")).exists()


def test_failed_command_leaves_a_revertible_state(tmp_path):
    box = FakeBox(copy_box(tmp_path, TRANSLATED), fail="grub2-mkconfig")
    before = snapshot(box.root)
    rc, out = run_main(["apply", "--yes"], box)
    assert rc == 1 and (box.root / DROPIN.lstrip("/")).exists()
    assert set(load_state(box.root)["files"]) == {DROPIN, "/etc/default/grub"}
    box.fail = None
    rc, out = run_main(["revert", "--yes"], box)
    assert rc == 0 and snapshot(box.root) == before


def test_uvm_steps_and_hmm_option(tmp_path):
    box = FakeBox(copy_box(tmp_path, PLX))
    modules = box.root / "proc/modules"
    modules.write_text("".join(l + "\n" for l in modules.read_text().splitlines() if not l.startswith("nvidia_uvm")))
    (box.root / "dev/nvidia-uvm").unlink()
    plan = make_plan(HostFS(box.root), box, Options(cmdline=False, acs=False, uvm_disable_hmm=True))
    assert commands_of(plan) == [("modprobe", "nvidia_uvm"), ("nvidia-modprobe", "-u", "-c=0")]
    assert files_of(plan)[MODPROBE_OPTIONS].endswith("options nvidia_uvm uvm_disable_hmm=1\n")
    assert set(files_of(plan)) == {MODULES_LOAD, MODPROBE_OPTIONS}
    rc, _ = run_main(["apply", "--yes", "--no-cmdline", "--no-acs", "--uvm-disable-hmm"], box)
    assert rc == 0
    assert make_plan(HostFS(box.root), box, Options(cmdline=False, acs=False, uvm_disable_hmm=True)).empty
    rc, out = run_main(["revert", "--yes"], box)
    assert rc == 0 and "modprobe -r" not in out  # nvidia_uvm stays loaded: CUDA needs it


def test_grubby_backend(tmp_path):
    box = FakeBox(copy_box(tmp_path, TRANSLATED))
    (box.root / "usr/sbin/grubby").write_text("#!/bin/sh\n")
    entries = box.root / "boot/loader/entries"
    entries.mkdir(parents=True)
    (entries / "abc-6.12.9.conf").write_text("title Linux\nversion 6.12.9\noptions root=UUID=x ro quiet\n")
    plan = make_plan(HostFS(box.root), box)
    grubby = [s for s in plan.steps if isinstance(s, RunCommand) and s.argv[0] == "grubby"]
    args = "iommu=pt pci=config_acs=x0x00xx@0000:00:01.1;x0x00xx@0000:00:01.2"
    assert grubby[0].argv == ("grubby", "--update-kernel=ALL", f"--args={args}")
    assert grubby[0].undo == (("grubby", "--update-kernel=ALL", f"--remove-args={args}"),)
    assert DROPIN not in files_of(plan) and "/etc/default/grub" not in files_of(plan)


def test_no_driver_box_needs_nothing(tmp_path):
    box = FakeBox(copy_box(tmp_path, NO_DRIVER))
    rc, out = run_main(["check"], box)
    assert rc == 0 and "0 change(s) pending" in out and "install the driver first" in out
    rc, out = run_main(["apply", "--yes"], box)
    assert rc == 0 and "nothing to do" in out


def test_other_root_never_runs_commands(tmp_path):
    root = copy_box(tmp_path, PLX)
    out = io.StringIO()
    assert main(["--root", str(root), "apply", "--yes"], is_root=lambda: True, out=out) == 0
    assert "5 command(s) printed but not run: --root" in out.getvalue()
    assert (root / DROPIN.lstrip("/")).is_file()


def test_launcher_runs_standalone_without_torch():
    code = ("import runpy, sys\n"
            f"sys.argv = ['thunderep-sysconfig', '--root', {str(BOXES / PLX)!r}, 'check']\n"
            "try:\n"
            f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code)\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "8 change(s) pending" in res.stdout and "exit 1" in res.stdout
    assert "torch imported: False" in res.stdout
    assert os.access(SCRIPT, os.X_OK)


def test_state_errors_are_thunder_errors(tmp_path):
    box = copy_box(tmp_path, PLX)
    state = box / STATE_FILE.lstrip("/")
    state.parent.mkdir(parents=True)
    state.write_text("{not json")
    with pytest.raises(ThunderError, match="cannot read"):
        load_state(box)
