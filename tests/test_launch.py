"""`thunderep.launch`: the CPU threads each rank gets."""

from __future__ import annotations

import os

import torch

import thunderep.launch as launch_module


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
        launch_module._child(1, 4, 0, lambda rank, world: seen.append(torch.get_num_threads()), (), None)
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        launch_module._child(1, 4, 0, lambda rank, world: seen.append(torch.get_num_threads()), (), None)
    finally:
        torch.set_num_threads(before)
    assert before != 17 and seen == [17, before]
