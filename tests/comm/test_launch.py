"""`thunderep.comm.launch`: the CPU threads each rank gets, and how a spawned rank leaves."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import thunderep.comm.launch as launch_module


def test_gpu_ranks_get_their_share_of_the_cores(monkeypatch):
    """A GPU rank gets cores / ranks intra-op threads (torch's default, every core in every rank,
    oversubscribes the machine); OMP_NUM_THREADS, when set, is left to stand."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "0")  # _child sets them; monkeypatch restores them
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(68)))  # 17 per rank: not a default
    before = torch.get_num_threads()
    seen = []
    try:
        launch_module._run_rank(1, 4, 0, lambda rank, world: seen.append(torch.get_num_threads()), (), None)
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        launch_module._run_rank(1, 4, 0, lambda rank, world: seen.append(torch.get_num_threads()), (), None)
    finally:
        torch.set_num_threads(before)
    assert before != 17 and seen == [17, before]


def _print_and_register_atexit(rank, world, marker):
    import atexit

    atexit.register(lambda: open(f"{marker}.{rank}", "w").close())
    print(f"rank {rank} of {world} done", end="\n" if rank else "")  # rank 0's line stays in the buffer


def test_spawned_ranks_leave_without_finalization_and_flush_their_output(tmp_path, capfd):
    """A launched rank that succeeded exits without the interpreter's finalization (atexit handlers
    do not run: a process group's worker thread could abort the process there), after flushing its
    output, and the launch succeeds."""
    launch_module.launch(_print_and_register_atexit, 2, str(tmp_path / "atexit"))
    out = capfd.readouterr().out
    assert "rank 0 of 2 done" in out and "rank 1 of 2 done" in out
    assert not list(tmp_path.iterdir())


SLEEPER = '''
import os, signal, sys, time

def sleep(rank, world, folder):
    open(os.path.join(folder, f"pid.{rank}"), "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    from thunderep.comm.launch import launch
    # as a shell starts a command: Ctrl-C's signal taken and not blocked, whatever the test process had
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        launch(sleep, 2, sys.argv[1])
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
'''


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _launched(tmp_path, script: str, *argv: str):
    """(launcher process, its ranks' pids) of `script` (a launcher of 2 ranks that each write their pid
    to tmp_path/pid.RANK), once both ranks have started; at the end, whatever is left is killed."""
    (tmp_path / "launcher.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2])])}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid.*"))) < 2 or any(not p.read_text() for p in tmp_path.glob("pid.*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.1)
        yield proc, [int(p.read_text()) for p in tmp_path.glob("pid.*")]
    finally:
        proc.kill()
        for p in tmp_path.glob("pid.*"):
            if p.read_text() and _running(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks follow their parent on Linux")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL", "SIGINT"])
def test_ranks_end_when_the_launcher_is_stopped(tmp_path, sig):
    """A launcher stopped by SIGTERM or SIGKILL, or interrupted by SIGINT sent to it alone, leaves no rank
    running (before, its ranks went on training and wrote their output); on SIGINT it raises
    KeyboardInterrupt after stopping them."""
    with _launched(tmp_path, SLEEPER) as (proc, pids):
        assert all(_running(pid) for pid in pids)
        proc.send_signal(getattr(signal, sig))
        try:
            out, _ = proc.communicate(timeout=90)  # seconds alone
        except subprocess.TimeoutExpired:  # what the launcher and its ranks were doing then
            states = {pid: [line for line in open(f"/proc/{pid}/status") if line.startswith(("State", "Sig"))]
                      for pid in [proc.pid, *pids] if _running(pid)}
            raise AssertionError(f"the launcher did not end within 90 s of {sig}: {states}") from None
        if sig == "SIGINT":
            assert proc.returncode == 130 and "interrupted" in out, out
        deadline = time.monotonic() + 15
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(pid) for pid in pids), f"ranks still running after {sig} to the launcher"


STOPPABLE = '''
import os, signal, sys, time
from thunderep.comm.stop import stop_on_sigterm
from thunderep.errors import Stopped

def work(rank, world, folder, finish):
    if finish:  # SIGTERM asks this rank to finish: it ends its work and returns
        asked = []
        signal.signal(signal.SIGTERM, lambda *a: asked.append(1))
    open(os.path.join(folder, f"pid.{rank}"), "w").write(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (finish and asked):
        time.sleep(0.05)

if __name__ == "__main__":
    from thunderep.comm.launch import launch
    try:
        with stop_on_sigterm():
            launch(work, 2, sys.argv[1], sys.argv[2] == "finish", stop_s=120.0)
    except Stopped as exc:
        print(exc, flush=True)
        sys.exit(143)
    print("finished", flush=True)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks follow their parent on Linux")
@pytest.mark.parametrize("ranks_do", ["finish", "die"])
def test_sigterm_to_the_launcher_passes_on_to_the_ranks(tmp_path, ranks_do):
    """SIGTERM to a launcher inside `stop_on_sigterm`: the ranks get SIGTERM too. Ranks that take it as
    a request to finish and end with 0 end the launch normally; ranks that SIGTERM ends make it raise
    `Stopped` ("stopped by SIGTERM"), within seconds, and none is left running."""
    with _launched(tmp_path, STOPPABLE, ranks_do) as (proc, pids):
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=150)
        took = time.monotonic() - started
        if ranks_do == "finish":
            assert proc.returncode == 0 and "finished" in out, out
        else:
            assert proc.returncode == 143 and "stopped by SIGTERM" in out, out
        assert took < 60, took  # the ranks end at once either way: no wait for stop_s (120 s)
        assert not any(_running(pid) for pid in pids)


def test_the_command_line_reports_sigterm_and_exits_with_143(monkeypatch, capsys):
    """SIGTERM to a `thunderep` command (in its main thread) ends it with one line naming the signal
    and exit code 143, cleanup on the way out running as for Ctrl-C; the handler before is restored."""
    import threading
    import types

    from thunderep import cli

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("only the main thread takes signals")  # SIGTERM would end this test process
    cleaned = []

    def main(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises before this ends
        finally:
            cleaned.append(True)

    monkeypatch.setitem(sys.modules, "sigterm_command", types.SimpleNamespace(main=main))
    monkeypatch.setitem(cli.COMMANDS, "sigterm-test", ("sigterm_command", ""))
    monkeypatch.delenv("THUNDEREP_DEBUG", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    assert cli.main(["sigterm-test"]) == 143
    assert time.monotonic() - started < 5 and cleaned
    assert capsys.readouterr().err == "thunderep sigterm-test: stopped by SIGTERM\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_backend_nccl_where_this_host_has_a_gpu_for_each_of_its_ranks(monkeypatch):
    """NCCL where the host has a GPU for each of its own ranks (LOCAL_WORLD_SIZE under torchrun on several
    hosts; else all ranks run here); else gloo, with a warning naming the GPUs when there are some (ranks on
    the CPU of a machine with GPUs are rarely meant), and none when --cpu asks for the CPU or none exist."""
    import warnings

    from thunderep.comm.launch import backend_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns
        assert backend_for(4) == "nccl"
        assert backend_for(8, cpu=True) == "gloo"
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert backend_for(8) == "nccl"  # 2 hosts of 4 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.warns(UserWarning, match=r"8 ranks on this host but 4 GPU\(s\): every rank runs on the CPU"):
        assert backend_for(8) == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "3")  # the host's other ranks stay quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend_for(8) == "gloo"
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        monkeypatch.setenv("LOCAL_RANK", "0")
        assert backend_for(8) == "gloo"  # no GPU: nothing to say


def test_training_ranks_default_to_one_per_gpu_that_the_experts_divide(monkeypatch):
    """Without a rank count a training command starts one rank per GPU of the host, at most as many as
    divide every expert count given; on a host without GPUs, or with --cpu, the CPU default."""
    from thunderep.comm.launch import ranks_for_host

    assert ranks_for_host(2, (8,), gpus=4) == 4
    assert ranks_for_host(2, (8,), gpus=3) == 2  # 3 does not divide 8
    assert ranks_for_host(2, (60,), gpus=8) == 6  # Qwen1.5-MoE's 60 experts: 6 of 8 GPUs
    assert ranks_for_host(2, (8, 6), gpus=4) == 2  # every count must split
    assert ranks_for_host(2, (7,), gpus=4) == 1
    assert ranks_for_host(2, (), gpus=3) == 3  # no count: every GPU
    assert ranks_for_host(2, (8,), gpus=1) == 1  # one GPU: one rank on it, not 2 on the CPU
    assert ranks_for_host(2, (8,), gpus=0) == 2
    assert ranks_for_host(3, (8,), cpu=True, gpus=4) == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert ranks_for_host(2, (8,)) == 4  # what torch sees, where gpus is not given
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert ranks_for_host(2, (8,)) == 2


def _fail_while_a_peer_is_stopped(rank, world, marker):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # suspended as by `kill -STOP`: never ends by itself
        return
    time.sleep(0.5)
    Path(marker).write_text(str(time.monotonic()))
    raise ValueError("rank 0 gives up")


def _fail_while_a_peer_runs(rank, world, marker):
    if rank == 1:
        time.sleep(60)  # alive and not stopped: gets the grace, then SIGTERM
        return
    time.sleep(0.5)
    Path(marker).write_text(str(time.monotonic()))
    raise ValueError("rank 0 gives up")


def _nothing(rank, world):
    pass


def test_a_failure_ends_a_stopped_peer_at_once(tmp_path, monkeypatch):
    """A rank fails while another is stopped (SIGSTOP): the stopped rank is killed at once instead of
    getting the grace and SIGTERM it cannot act on, so the launch raises within a second of the failure;
    a running peer gets the grace, then SIGTERM. After an earlier launch from the same fork server too
    (there, waiting for the failed rank's sentinel to close waited for the running peer's whole minute)."""
    from thunderep.errors import ThunderError

    monkeypatch.setattr(launch_module, "GRACE_S", 3.0)
    launch_module.launch(_nothing, 2)
    marker = tmp_path / "failed_at"
    with pytest.raises(ThunderError, match="rank 0 failed: ValueError: rank 0 gives up"):
        launch_module.launch(_fail_while_a_peer_is_stopped, 2, str(marker))
    stopped_s = time.monotonic() - float(marker.read_text())
    with pytest.raises(ThunderError, match="rank 0 failed: ValueError: rank 0 gives up"):
        launch_module.launch(_fail_while_a_peer_runs, 2, str(marker))
    running_s = time.monotonic() - float(marker.read_text())
    assert stopped_s < 1.5 and 3.0 <= running_s < 10.0, (stopped_s, running_s)
