"""A peer that exits mid-collective is named in one line: which rank, which pid, and torch's reason
without gloo's source location and advice."""

from __future__ import annotations

import os
import time

import pytest

from thunderep.comm.groups import peer_errors
from thunderep.errors import CommError

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3468: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application")


class _Plane:
    def __init__(self, dead):
        self.dead = dead

    def dead_peers(self):
        return self.dead


@pytest.mark.parametrize("plane, expected", [
    (_Plane(["rank 1 (pid 5) exited"]),
     "all_to_all on EP rank 0 failed: rank 1 (pid 5) exited (Read error [127.0.0.1]:3468: Connection reset by "
     "peer): the command cannot go on without it"),
    (_Plane([]), "all_to_all on EP rank 0 failed: a peer died or did not answer within 5 s (Read error "
                 "[127.0.0.1]:3468: Connection reset by peer)"),
    (None, "all_to_all on EP rank 0 failed: a peer died or did not answer within 5 s (Read error "
           "[127.0.0.1]:3468: Connection reset by peer)"),
])
def test_torch_errors_become_one_line(plane, expected):
    with pytest.raises(CommError) as info:
        with peer_errors("all_to_all on EP rank 0", "5 s", plane):
            raise RuntimeError(GLOO + "\nException raised from recvHeader at ...")
    assert str(info.value) == expected


def _last_rank_exits(rank, world, folder):
    import torch

    from thunderep.comm.runtime import ExpertParallel
    from thunderep.config import EPConfig

    ep = ExpertParallel.init(world, EPConfig(control="mailbox", timeout_s=20.0))
    ep.control.barrier()
    if rank == world - 1:
        (folder / "pid.tmp").write_text(str(os.getpid()))
        os.replace(folder / "pid.tmp", folder / "pid")  # whole: a reader never sees the file empty
        os._exit(0)  # as a killed rank: no close, no goodbye
    pid = int(_wait_for(folder / "pid").read_text())
    deadline = time.monotonic() + 20
    while not ep.control.dead_peers() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:  # the runtime's own collective: its errors name the peer through its control plane
        ep.all_reduce_sum(torch.ones(4), op="all_reduce")
    except CommError as exc:
        return str(exc), pid
    return "no error", pid


def _wait_for(path, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path


@pytest.mark.parametrize("world", [2, 4])
def test_a_peer_that_exits_is_named(world, tmp_path):
    from distributed import run_ranks

    from thunderep.comm import mailbox

    if not mailbox.native_available():
        pytest.skip("needs the mailbox extension")
    results = run_ranks(_last_rank_exits, world, tmp_path, allow_missing=(world - 1,), dist_timeout=20.0)
    for rank, (message, pid) in enumerate(results[:-1]):
        assert message.startswith(f"all_reduce on EP rank {rank} failed: rank {world - 1} (pid {pid}) exited ("), message
        assert "\n" not in message and ".cc:" not in message, message
