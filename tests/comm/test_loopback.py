"""A one-host run listens on the loopback interface alone: the rendezvous store, gloo's sockets."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from thunderep.comm.launch import launch


def _listening(rank, world, queue):
    import torch.distributed as dist

    from thunderep.comm.runtime import ExpertParallel
    from thunderep.config import EPConfig

    with ExpertParallel.init(world, EPConfig(control="collective")) as ep:
        dist.barrier(group=ep.groups.ep_group)
        queue.put((rank, [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]))
        dist.barrier(group=ep.groups.ep_group)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_a_one_host_run_listens_on_loopback_only(world):
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    launch(_listening, world, queue)
    found = dict(queue.get() for _ in range(world))
    assert sorted(found) == list(range(world))
    assert found[0], "rank 0 holds the rendezvous store: something listens"
    for rank, sockets in found.items():
        for ip, port in sockets:
            assert ipaddress.ip_address(ip).is_loopback, f"rank {rank} listens on {ip}:{port}"


def test_a_rendezvous_beyond_this_host_says_what_it_exposes(monkeypatch):
    """torchrun across hosts: the first rank warns that the store takes unauthenticated connections."""
    import warnings

    import torch.distributed as dist

    from thunderep.comm import groups

    assert groups.exposure_note("127.0.0.1", "29500") is None and groups.exposure_note(None, None) is None
    note = groups.exposure_note("10.1.2.3", "29500")
    assert note.startswith("the rendezvous store listens at 10.1.2.3:29500 for as long as the run lasts")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    class Reached(Exception):
        pass

    def init(**kwargs):
        raise Reached

    monkeypatch.setattr(dist, "init_process_group", init)
    for name, value in (("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(Reached):
        warnings.simplefilter("always")
        groups.init_expert_parallel(backend="gloo")
    assert [str(w.message) for w in seen] == [note]
