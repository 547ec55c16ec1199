"""`thunderep.launch`: the CPU threads each rank gets, and how a spawned rank leaves."""

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
