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
