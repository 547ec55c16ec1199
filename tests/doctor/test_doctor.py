"""`thunderep doctor` against fixture boxes: verdicts, exact fixes, parsers, output formats.

Every test reads a fixture tree under tests/fixtures/boxes (or a copy of one in tmp_path) through the
doctor's root parameter; recorded command outputs come from <box>/_commands. Nothing touches the real
machine and nothing needs root.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from thunderep.cli.doctor import main
from thunderep.doctor import diagnose
from thunderep.doctor.checks import setpci_clear_argv
from thunderep.doctor.gpu import CopyBandwidth, CudaDevice, CudaReport, cuda_report
from thunderep.doctor.host import normalize_bdf, parse_bar1, parse_p2p_matrix
from thunderep.doctor.pci import (
    ACS_REDIRECT_MASK,
    bridges_between,
    describe_acs,
    parse_acs_from_config,
    parse_lspci,
    read_acs,
    scan_pci,
)
from thunderep.doctor.software import SoftwareReport, software_report
from thunderep.doctor.sources import CommandResult, HostFS, RecordedRunner

BOXES = Path(__file__).parents[1] / "fixtures" / "boxes"
PLX, TRANSLATED, NO_DRIVER = "2x4090-plx", "2x3090-iommu-translated", "1x4090-no-driver"


def copy_box(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(BOXES / name, dst, symlinks=True)
    return dst


def by_name(diagnosis) -> dict:
    return {c.name: c for c in diagnosis.checks}


class ReadOnlyGuard:
    """Wraps a runner and fails the test if the doctor ever runs a state-changing command."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        assert argv[0] in ("lspci", "setpci", "nvidia-smi"), argv
        assert not (argv[0] == "setpci" and "=" in argv[-1]), f"doctor wrote config space: {argv}"
        return self.inner(argv)


def test_plx_box_verdicts_and_exact_fixes():
    guard = ReadOnlyGuard(RecordedRunner(BOXES / PLX / "_commands"))
    d = diagnose(BOXES / PLX, guard, cuda=False)
    c = by_name(d)
    assert c["gpus"].verdict == "ok" and "2 NVIDIA GPUs" in c["gpus"].summary
    assert "GeForce RTX 4090" in c["gpus"].summary
    assert c["driver"].verdict == "ok" and "550.120" in c["driver"].summary
    assert c["kernel module"].summary.startswith("proprietary kernel module")
    assert c["nvidia_uvm"].verdict == "ok"
    assert c["iommu"].verdict == "ok" and "passthrough (identity)" in c["iommu"].summary
    assert c["acs"].verdict == "warn"
    assert "0000:02:08.0, 0000:02:10.0" in c["acs"].summary
    assert ("`sudo setpci -s 0000:02:08.0 ECAP_ACS+0x6.w=0000:002c; "
            "sudo setpci -s 0000:02:10.0 ECAP_ACS+0x6.w=0000:002c`") in c["acs"].fix
    assert "sudo sysconfig/thunderep-sysconfig apply --yes" in c["acs"].fix
    for gpu, port in (("0000:03:00.0", "0000:02:08.0"), ("0000:04:00.0", "0000:02:10.0")):
        link = c[f"link {gpu}"]
        assert link.verdict == "warn"
        assert link.summary == f"8 GT/s x16 (max 16 GT/s x16): limited by upstream port {port} (max 8 GT/s x16)"
    assert c["bar1"].verdict == "ok" and "32768 MiB (nvidia-smi)" in c["bar1"].summary
    assert c["p2p"].verdict == "warn" and "0->1, 1->0" in c["p2p"].summary
    assert "GeForce" in c["p2p"].fix and "clear ACS redirect" in c["p2p"].fix
    assert c["bandwidth"].verdict == "n/a" and c["numa"].verdict == "n/a"
    assert d.exit_code == 0
    assert ["lspci", "-D", "-nn", "-vvv"] in guard.calls


def test_plx_peer_path_is_the_two_downstream_ports():
    devs = scan_pci(HostFS(BOXES / PLX))
    assert [d.bdf for d in bridges_between(devs, "0000:03:00.0", "0000:04:00.0")] == ["0000:02:08.0", "0000:02:10.0"]
    gpu = devs["0000:03:00.0"]
    assert (gpu.parent, gpu.host_bridge, gpu.driver, gpu.numa_node) == ("0000:02:08.0", "pci0000:00", "nvidia", None)
    assert devs["0000:02:08.0"].parent == "0000:01:00.0" and devs["0000:01:00.0"].parent == "0000:00:01.0"
    assert gpu.is_nvidia_gpu and not devs["0000:03:00.1"].is_nvidia_gpu and devs["0000:02:08.0"].is_bridge


def test_translated_box_two_root_ports():
    devs = scan_pci(HostFS(BOXES / TRANSLATED))
    assert [d.bdf for d in bridges_between(devs, "0000:01:00.0", "0000:02:00.0")] == ["0000:00:01.1", "0000:00:01.2"]


def test_acs_readers_agree_setpci_lspci():
    root = BOXES / PLX
    fs, runner = HostFS(root), RecordedRunner(root / "_commands")
    devs = scan_pci(fs)
    lspci = parse_lspci((root / "_commands" / "lspci-vvv.txt").read_text())
    via_setpci = read_acs(fs, devs["0000:02:08.0"], runner, lspci["0000:02:08.0"])
    assert (via_setpci.source, via_setpci.control, via_setpci.capability) == ("setpci", 0x1D, 0x7F)
    via_lspci = read_acs(fs, devs["0000:02:08.0"], lambda argv: CommandResult(127), lspci["0000:02:08.0"])
    assert (via_lspci.source, via_lspci.control, via_lspci.capability) == ("lspci", 0x1D, 0x7F)
    assert via_lspci.redirects and describe_acs(0x1D) == "SV+ TB- RR+ CR+ UF+ EC- DT-"
    usp = read_acs(fs, devs["0000:01:00.0"], runner, lspci["0000:01:00.0"])
    assert usp.readable and not usp.present  # full capability list visible, no ACS in it
    assert lspci["0000:02:08.0"].port_type == "Downstream Port"
    assert lspci["0000:00:01.0"].port_type == "Root Port"
    assert lspci["0000:03:00.0"].description == "NVIDIA Corporation AD102 [GeForce RTX 4090] [10de:2684]"


def test_acs_unreadable_without_root():
    root = BOXES / NO_DRIVER
    lspci = parse_lspci((root / "_commands" / "lspci-vvv.txt").read_text())
    assert lspci["0000:00:01.0"].caps_denied
    acs = read_acs(HostFS(root), scan_pci(HostFS(root))["0000:00:01.0"], RecordedRunner(root / "_commands"),
                   lspci["0000:00:01.0"])
    assert not acs.readable and not acs.redirects


def _config_space(acs_ctl: int | None) -> bytes:
    cfg = bytearray(4096)
    cfg[0:4] = (0x10B5 | 0x8747 << 16).to_bytes(4, "little")
    aer_next = 0x148 if acs_ctl is not None else 0
    cfg[0x100:0x104] = (0x0001 | 1 << 16 | aer_next << 20).to_bytes(4, "little")  # AER, v1
    if acs_ctl is not None:
        cfg[0x148:0x14C] = (0x000D | 1 << 16 | 0 << 20).to_bytes(4, "little")  # ACS, v1, last
        cfg[0x14C:0x14E] = (0x7F).to_bytes(2, "little")
        cfg[0x14E:0x150] = acs_ctl.to_bytes(2, "little")
    return bytes(cfg)


def test_acs_from_full_config_space(tmp_path):
    acs = parse_acs_from_config(_config_space(0x1D))
    assert (acs.present, acs.capability, acs.control, acs.redirects) == (True, 0x7F, 0x1D, True)
    assert parse_acs_from_config(_config_space(0x1D & ~ACS_REDIRECT_MASK)).redirects is False
    assert parse_acs_from_config(_config_space(None)).present is False
    # a root-readable config file wins over setpci and lspci
    box = copy_box(tmp_path, PLX)
    fs = HostFS(box)
    dsp = scan_pci(fs)["0000:02:08.0"]
    fs.path(f"{dsp.sysfs}/config").write_bytes(_config_space(0x11))
    acs = read_acs(fs, dsp, RecordedRunner(box / "_commands"))
    assert (acs.source, acs.control, acs.redirects) == ("sysfs config", 0x11, False)
    assert setpci_clear_argv("0000:02:08.0", "10b5:8747") == [
        "setpci", "-s", "0000:02:08.0", "-d", "10b5:8747", "ECAP_ACS+0x6.w=0000:002c"]


def test_translated_iommu_box():
    d = diagnose(BOXES / TRANSLATED, cuda=False)
    c = by_name(d)
    assert c["iommu"].verdict == "warn" and "(DMA-FQ)" in c["iommu"].summary
    assert c["iommu"].fix.startswith("boot with `iommu=pt` (the IOMMU stays on")
    assert "intel_iommu" not in c["iommu"].fix  # AMD box
    assert c["acs"].verdict == "warn" and "0000:00:01.1, 0000:00:01.2" in c["acs"].summary
    assert c["kernel module"].summary == "open kernel module (560.35.03)"
    uvm = c["nvidia_uvm"]
    assert uvm.verdict == "fail" and "`install nvidia_uvm /bin/false`" in uvm.summary
    assert "/etc/modprobe.d/50-nvidia-uvm-off.conf line 2: `blacklist nvidia_uvm`" in uvm.fix
    assert "CUDA cannot initialise without nvidia_uvm" in uvm.fix
    assert c["link 0000:01:00.0"].verdict == "ok"
    narrow = c["link 0000:02:00.0"]
    assert narrow.verdict == "warn" and "trained at x4 though both ends support x16" in narrow.summary
    assert "/sys/bus/pci/devices/0000:02:00.0/current_link_width" in narrow.fix
    assert c["bar1"].verdict == "warn" and "256 MiB" in c["bar1"].summary and "(sysfs resource)" in c["bar1"].summary
    assert "Above 4G Decoding" in c["bar1"].fix
    assert c["numa"].verdict == "ok"
    assert c["p2p"].verdict == "n/a"  # no nvidia-smi on this box, no CUDA here
    assert any("nvidia-smi not found" in n for n in d.facts.notes)
    assert d.exit_code == 1


def test_no_driver_box():
    d = diagnose(BOXES / NO_DRIVER, cuda=False)
    c = by_name(d)
    assert c["gpus"].verdict == "ok" and "1 NVIDIA GPU:" in c["gpus"].summary
    assert c["driver"].verdict == "fail" and "install the NVIDIA driver" in c["driver"].fix
    assert c["nvidia_uvm"].verdict == "n/a" and c["kernel module"].verdict == "n/a"
    assert c["iommu"].verdict == "ok" and "no IOMMU unit active" in c["iommu"].summary
    assert c["acs"].verdict == "n/a" and c["p2p"].verdict == "n/a"
    idle = c["link 0000:01:00.0"]
    assert idle.verdict == "warn" and "GPUs lower the link speed when idle" in idle.fix
    assert d.facts.gpus[0].driver is None
    out = io.StringIO()
    assert main(["--root", str(BOXES / NO_DRIVER)], out=out) == 1
    assert "ACS unreadable (needs root)" in out.getvalue()


def bare_tree(tmp_path):
    """A captured tree of a machine without anything: empty sys/ and proc/."""
    for d in ("sys", "proc"):
        (tmp_path / d).mkdir()
    return tmp_path


def test_machine_without_anything(tmp_path):
    d = diagnose(bare_tree(tmp_path), cuda=False)
    assert {c.verdict for c in d.checks} <= {"n/a", "ok"} and d.exit_code == 0
    assert by_name(d)["gpus"].summary.startswith("no NVIDIA GPU")


def test_uvm_variants(tmp_path):
    box = copy_box(tmp_path, PLX)
    (box / "dev" / "nvidia-uvm").unlink()
    uvm = by_name(diagnose(box, cuda=False))["nvidia_uvm"]
    assert uvm.verdict == "warn" and "`sudo nvidia-modprobe -u -c=0`" in uvm.fix
    modules = box / "proc" / "modules"
    modules.write_text("".join(l + "\n" for l in modules.read_text().splitlines() if not l.startswith("nvidia_uvm")))
    uvm = by_name(diagnose(box, cuda=False))["nvidia_uvm"]
    assert uvm.verdict == "fail" and "`sudo modprobe nvidia_uvm && sudo nvidia-modprobe -u -c=0`" in uvm.fix


def test_numa_split_and_kernel_params(tmp_path):
    box = copy_box(tmp_path, PLX)
    fs = HostFS(box)
    devs = scan_pci(fs)
    fs.path(devs["0000:03:00.0"].sysfs + "/numa_node").write_text("0\n")
    fs.path(devs["0000:04:00.0"].sysfs + "/numa_node").write_text("1\n")
    cmdline = box / "proc" / "cmdline"
    extra = " pcie_acs_override=downstream pci=config_acs=x0x00xx@0000:02:08.0\n"
    cmdline.write_text(cmdline.read_text().strip() + extra)
    c = by_name(diagnose(box, cuda=False))
    assert c["numa"].verdict == "warn" and "0000:04:00.0: node 1" in c["numa"].summary
    kp = c["kernel params"]
    assert kp.verdict == "warn"
    assert "pci=config_acs= needs Linux 6.11+; this kernel (6.8) ignores it" in kp.summary
    assert "does not change how the switch routes peer traffic, and this kernel lacks" in kp.summary


def test_cuda_report_is_used_for_p2p_and_bandwidth():
    devices = (CudaDevice(0, "NVIDIA GeForce RTX 4090", "0000:03:00.0", 24217),
               CudaDevice(1, "NVIDIA GeForce RTX 4090", "0000:04:00.0", 24217))
    rows = (CopyBandwidth(0, 1, 64 << 20, False, 9.8, 10.4), CopyBandwidth(1, 0, 64 << 20, False, 9.9, 10.6))
    report = CudaReport(devices, ((True, False), (False, True)), rows)
    d = diagnose(BOXES / PLX, cuda=report)
    c = by_name(d)
    assert c["p2p"].verdict == "warn" and "torch.cuda.can_device_access_peer" in c["p2p"].summary
    assert c["bandwidth"].verdict == "ok" and c["bandwidth"].summary.startswith("peer copy 9.8-9.9 GB/s, via host")
    out = io.StringIO()
    from thunderep.doctor.report import render_table
    out.write(render_table(d))
    assert "GPU-to-GPU copy bandwidth" in out.getvalue() and "staged by the driver" in out.getvalue()
    slow = CudaReport(devices, ((True, True), (True, True)),
                      (CopyBandwidth(0, 1, 64 << 20, True, 3.0, 10.0), CopyBandwidth(1, 0, 64 << 20, True, 12.0, 10.0)))
    c = by_name(diagnose(BOXES / PLX, cuda=slow))
    assert c["p2p"].verdict == "ok"
    assert c["bandwidth"].verdict == "warn" and "P2P slower than staging through host on 0->1" in c["bandwidth"].summary


def test_json_output_is_complete():
    out = io.StringIO()
    assert main(["--json", "--root", str(BOXES / PLX)], out=out) == 0
    doc = json.loads(out.getvalue())
    names = [c["name"] for c in doc["checks"]]
    assert names[:4] == ["gpus", "driver", "kernel module", "nvidia_uvm"] and "acs" in names
    assert sum(doc["counts"].values()) == len(doc["checks"])
    gpu0 = doc["gpus"][0]
    assert gpu0["bdf"] == "0000:03:00.0" and gpu0["bar1_mib"] == 32768 and gpu0["iommu_domain"] == "identity"
    assert [p["bdf"] for p in gpu0["path"]] == ["0000:02:08.0", "0000:01:00.0", "0000:00:01.0"]
    assert gpu0["path"][0]["acs"] == {"present": True, "control": 0x1D, "capability": 0x7F,
                                      "bits": "SV+ TB- RR+ CR+ UF+ EC- DT-", "source": "setpci"}
    assert doc["nvidia_smi_p2p"] == [["X", "NS"], ["NS", "X"]]


def test_table_output_and_usage_errors(tmp_path, capsys):
    out = io.StringIO()
    assert main(["--root", str(BOXES / TRANSLATED)], out=out) == 1
    text = out.getvalue()
    assert "nvidia_uvm         fail" in text and "fix: delete /etc/modprobe.d/50-nvidia-uvm-off.conf" in text
    assert "verdicts: 6 ok, 4 warn, 1 fail, 4 n/a" in text  # mailbox, triton: not read for a fixture root
    assert main(["--root", str(tmp_path / "missing")], out=io.StringIO()) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["--copy-mib", "0", "--root", str(tmp_path)], out=io.StringIO()) == 2
    assert "--copy-mib must be at least 1, got 0" in capsys.readouterr().err  # the option, not diagnose's copy_mib
    # an empty directory is no machine to diagnose (it read as one without GPUs, every check n/a or ok)
    assert main(["--root", str(tmp_path)], out=io.StringIO()) == 2
    assert "has no sys/ or proc/: it is not a captured filesystem tree" in capsys.readouterr().err
    (tmp_path / "sys").mkdir()
    assert main(["--root", str(tmp_path)], out=io.StringIO()) == 2
    assert "has no proc/:" in capsys.readouterr().err
    assert main(["--bogus"], out=io.StringIO()) == 2


def test_parsers():
    smi = (BOXES / PLX / "_commands" / "nvidia-smi-memory.txt").read_text()
    assert parse_bar1(smi) == {"0000:03:00.0": 32768, "0000:04:00.0": 32768}
    p2p = (BOXES / PLX / "_commands" / "nvidia-smi-p2p.txt").read_text()
    assert parse_p2p_matrix(p2p) == [["X", "NS"], ["NS", "X"]]
    assert parse_p2p_matrix("\t\x1b[4mGPU0\tGPU1\x1b[0m\n GPU0\tX\tOK\n GPU1\tOK\tX\n") == [["X", "OK"], ["OK", "X"]]
    assert normalize_bdf("00000000:0A:00.0") == "0000:0a:00.0" and normalize_bdf("01:00.0") == "0000:01:00.0"


def test_software_checks():
    missing = ("the mailbox extension is missing and building it failed (ModuleNotFoundError: No module "
               "named 'cffi'); install a C compiler (e.g. `apt install gcc`) and reinstall thunderep")
    c = by_name(diagnose(BOXES / PLX, cuda=False, software=SoftwareReport(missing, None)))
    assert c["mailbox"].verdict == "warn" and "collective control plane" in c["mailbox"].summary
    assert c["mailbox"].fix == missing
    assert c["triton"].verdict == "warn" and c["triton"].fix.startswith("`pip install triton`")
    c = by_name(diagnose(BOXES / PLX, cuda=False, software=SoftwareReport(None, "3.6.0")))
    assert c["mailbox"].verdict == "ok" and c["triton"].verdict == "ok" and "Triton 3.6.0" in c["triton"].summary
    assert "--experts-implementation auto" in c["triton"].summary
    c = by_name(diagnose(BOXES / NO_DRIVER, cuda=False, software=SoftwareReport(None, None)))
    assert c["triton"].verdict == "warn"  # a GPU on the bus, no Triton: the kernels could not run
    c = by_name(diagnose(BOXES / PLX, cuda=False))  # a fixture root: this interpreter is not that box's
    assert c["mailbox"].verdict == c["triton"].verdict == "n/a" and "--root /" in c["mailbox"].summary
    out = io.StringIO()
    assert main(["--json", "--root", str(BOXES / PLX)], out=out) == 0
    assert json.loads(out.getvalue())["software"] is None


def test_software_checks_without_a_gpu(tmp_path):
    c = by_name(diagnose(bare_tree(tmp_path), cuda=False, software=SoftwareReport(None, None)))
    assert c["triton"].verdict == "n/a" and "needs no Triton" in c["triton"].summary
    assert c["mailbox"].verdict == "ok"


def test_software_report_reads_this_interpreter():
    import importlib.util

    from thunderep.comm.mailbox import native_unavailable_reason

    report = software_report()
    assert report.mailbox_unavailable == native_unavailable_reason()
    assert (report.triton_version is None) == (importlib.util.find_spec("triton") is None)


def test_cuda_report_without_cuda_is_none():
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    except ImportError:
        pass
    assert cuda_report() is None


@pytest.mark.gpu
def test_cuda_report_on_real_gpus():
    report = cuda_report(measure=True, nbytes=8 << 20, iters=2)
    assert report is not None and len(report.devices) >= 1
    n = len(report.devices)
    assert all(report.can_access_peer[i][i] for i in range(n))
    assert len(report.bandwidth) == n * (n - 1)
    for b in report.bandwidth:
        assert b.error is None and b.peer_gbps > 0 and b.via_host_gbps > 0
