"""Control planes: the same checks through the mailbox and through gloo collectives, 2 and 4 ranks;
the factory's choices; and the behaviour without the native extension."""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from thunderep.comm import mailbox as mailbox_mod

REPO = Path(__file__).resolve().parents[2]
NEEDS_NATIVE = pytest.mark.skipif(not mailbox_mod.native_available(),
                                  reason="mailbox extension unavailable")


def _segments() -> set[str]:
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith("tep-")}


@pytest.fixture(autouse=True)
def no_leftovers():
    before = _segments()
    yield
    leftovers = _segments() - before
    assert not leftovers, f"segments left in /dev/shm: {sorted(leftovers)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, args):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        results.put((rank, True, fn(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world, *args, timeout=60.0):
    """Run fn(rank, world, *args) in `world` spawned processes with gloo initialized; return the
    results by rank. Hard bound: `timeout` seconds, then the processes are killed and the test fails."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline, got = time.monotonic() + timeout, {}
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=max(0.05, min(0.5, deadline - time.monotonic())))
                got[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)
                    while not results.empty():
                        rank, ok, value = results.get()
                        got[rank] = (ok, value)
                    if any(r not in got for r in dead):
                        pytest.fail(f"ranks {dead} died without a result")
            if time.monotonic() > deadline:
                pytest.fail(f"multi-process test exceeded {timeout} s; results so far: {sorted(got)}")
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if errors:
        pytest.fail("\n".join(errors))
    return [got[r][1] for r in range(world)]


def _check_plane(cp, rank: int, world: int) -> None:
    from thunderep.errors import CommError

    assert (cp.rank, cp.world_size) == (rank, world)
    assert cp.exchange(bytes([rank]) * 8) == [bytes([r]) * 8 for r in range(world)]
    assert cp.exchange(bytes([rank, 7]) * 128) == [bytes([r, 7]) * 128 for r in range(world)]
    for rnd in range(50):  # lengths change from round to round, equal across ranks
        n = (rnd * 37) % 200
        want = [bytes([(r + rnd) % 256]) * n for r in range(world)]
        assert cp.exchange(bytes([(rank + rnd) % 256]) * n) == want
    cp.barrier()
    assert cp.exchange(b"") == [b""] * world
    assert cp.allreduce_max([rank, -rank, 7, 2**40 * rank]) == [world - 1, 0, 7, 2**40 * (world - 1)]
    t = torch.tensor([[rank, 3], [0, -rank]], dtype=torch.int64)
    assert torch.equal(cp.allreduce_max(t), torch.tensor([[world - 1, 3], [0, 0]]))
    f = torch.tensor([0.5 * rank, -1.0], dtype=torch.float32)
    out = cp.allreduce_max(f)
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([0.5 * (world - 1), -1.0]))
    counts_R = torch.arange(world, dtype=torch.int64) + 10 * rank
    counts_RR = cp.exchange_tensor(counts_R)
    assert torch.equal(counts_RR, torch.arange(world) + 10 * torch.arange(world)[:, None])
    with pytest.raises(CommError, match="exceeds"):
        cp.exchange(b"x" * (cp.record_bytes + 1))
    assert cp.exchange(b"ok") == [b"ok"] * world  # still usable after a rejected record
    # Barrier: nobody leaves before the last one enters.
    time.sleep(0.05 * rank)
    entered = time.time()
    cp.barrier()
    left = time.time()
    enters = cp.exchange_tensor(torch.tensor([entered], dtype=torch.float64))
    assert left >= enters.max().item() - 1e-3


def _planes_worker(rank, world):
    import warnings

    import torch.distributed as dist

    from thunderep.comm import CollectiveControlPlane, MailboxControlPlane, make_control_plane

    kinds = {}
    for kind in ("mailbox", "collective"):
        with make_control_plane(kind, record_bytes=512, timeout_s=10.0) as cp:
            kinds[kind] = type(cp).__name__
            _check_plane(cp, rank, world)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one host with the extension: no fallback warning
        with make_control_plane("auto") as cp:
            assert isinstance(cp, MailboxControlPlane) and cp.kind == "mailbox"
            assert cp.exchange(b"%4d" % rank) == [b"%4d" % r for r in range(world)]
            assert cp.round == 1
    # A subgroup: group ranks differ from global ranks.
    members = [world - 1, 0] if world > 2 else [1, 0]
    sub = dist.new_group(sorted(members))
    if rank in members:
        with make_control_plane("mailbox", group=sub) as cp:
            assert cp.world_size == 2
            recs = cp.exchange(b"%4d" % rank)
            assert recs == [b"%4d" % r for r in sorted(members)]
        with CollectiveControlPlane(sub) as cp:
            assert cp.allreduce_max([rank]) == [max(members)]
    cp = make_control_plane("collective")
    cp.close()
    return kinds


@NEEDS_NATIVE
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.world_size(2)),
                                   pytest.param(4, marks=pytest.mark.world_size(4))])
def test_control_planes(world):
    res = run_ranks(_planes_worker, world, timeout=90.0)
    assert res[0] == {"mailbox": "MailboxControlPlane", "collective": "CollectiveControlPlane"}


def test_factory_rejects_bad_settings():
    from thunderep.comm import make_control_plane
    from thunderep.errors import ConfigError

    with pytest.raises(ConfigError, match="kind"):
        make_control_plane("shm")
    with pytest.raises(ConfigError, match="record_bytes"):
        make_control_plane("collective", record_bytes=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        make_control_plane("auto", timeout_s=-1)
    if not torch.distributed.is_initialized():
        with pytest.raises(ConfigError, match="init_process_group"):
            make_control_plane("collective")


_NO_NATIVE_SCRIPT = """
import sys, warnings
from datetime import timedelta

class Block:  # the compiled extension is "missing"
    def find_spec(self, name, path=None, target=None):
        if name == "thunderep.comm._mailbox_native":
            raise ModuleNotFoundError("No module named 'thunderep.comm._mailbox_native'")
        return None

sys.meta_path.insert(0, Block())
import thunderep, thunderep.comm
from thunderep.comm import make_control_plane, native_available
from thunderep.comm.mailbox import Mailbox
from thunderep.errors import CommError
import torch.distributed as dist

MODE = sys.argv[1]
if MODE == "none":
    assert not native_available()
    try:
        Mailbox.create(world_size=1, slot_size=8)
    except CommError as exc:
        assert "C compiler" in str(exc), exc
    else:
        raise AssertionError("Mailbox.create worked without the extension")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cp = make_control_plane("auto")
    assert cp.kind == "collective", cp
    messages = [str(w.message) for w in caught]
    assert any("collective control plane" in m for m in messages), messages
    assert cp.exchange(b"abc") == [b"abc"]
    try:
        make_control_plane("mailbox")
    except CommError as exc:
        assert "unavailable" in str(exc)
    else:
        raise AssertionError("mailbox plane without the extension")
    dist.destroy_process_group()
else:  # "build": the extension is compiled on first use into the cache directory
    assert native_available(), thunderep.comm.mailbox.native_unavailable_reason()
    with Mailbox.create(world_size=1, slot_size=8) as mb:
        assert mb.exchange(1, b"built") == [b"built"]
        mb.unlink()
print("OK")
"""


def _run_script(mode: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    if mode == "build":
        env.pop("THUNDEREP_NO_NATIVE_BUILD", None)
    cmd = [sys.executable, "-c", textwrap.dedent(_NO_NATIVE_SCRIPT), mode, str(_free_port())]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=str(REPO))


def test_without_native_extension_import_works_and_auto_falls_back():
    proc = _run_script("none", {"THUNDEREP_NO_NATIVE_BUILD": "1"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(not (REPO / "native" / "build_mailbox.py").is_file() or not shutil.which("cc"),
                    reason="needs a source checkout and a C compiler")
def test_extension_is_built_on_first_use_when_missing(tmp_path):
    proc = _run_script("build", {"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert list(tmp_path.glob("thunderep/native/*/_mailbox_native*.so"))
