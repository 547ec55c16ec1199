"""Latency mode's all-reduce and all-gather mode's gathers and reduce-scatters through host memory
(`ExpertParallel` with THUNDEREP_HOST_COLLECTIVE=1): off by default and on CPU ranks (gloo as before); on 2
GPUs of one host, bit-equal to the float32 sum in rank order (the gathers: the rows as sent) and recorded
as their own operations."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_ranks


def _cpu_rank(rank, world):
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    os.environ["THUNDEREP_HOST_COLLECTIVE"] = "1"
    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    try:
        x = torch.full((3, 5), float(rank + 1))
        out = ep.all_reduce_sum(x)
        gathered = ep.all_gather_rows(torch.full((2, 3), rank))
        block = ep.reduce_scatter_rows(torch.ones(2 * world, 3))
        assert gathered.tolist() == [[r] * 3 for r in range(world) for _ in range(2)]
        assert block.tolist() == [[float(world)] * 3] * 2
        return ep.host_collective is None, out.tolist(), dict(ep.stats.calls)
    finally:
        ep.close()


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_ranks_never_take_the_host_path_even_when_asked(world):
    total = float(sum(range(1, world + 1)))
    for none, out, calls in run_ranks(_cpu_rank, world, timeout=60):
        assert none and out == [[total] * 5] * 3
        assert calls.get("latency_allreduce") == 1 and not any(n for op, n in calls.items() if op.endswith("_host"))


def _gpu_rank(rank, world):
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    os.environ["THUNDEREP_HOST_COLLECTIVE"] = "1"
    ep = ExpertParallel(init_expert_parallel(world), EPConfig())
    try:
        out = []
        for dtype, n in ((torch.bfloat16, 4096), (torch.float32, 7), (torch.float16, 1)):
            gen = torch.Generator().manual_seed(n)
            xs = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
            got = ep.all_reduce_sum(xs[rank].to(ep.groups.device).clone())
            want = xs[0].float()
            for x in xs[1:]:
                want = want + x.float()
            out.append(torch.equal(got.cpu(), want.to(dtype)))
        rows = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        gathered = ep.all_gather_rows(rows[rank].to(ep.groups.device))
        out.append(torch.equal(gathered.cpu(), torch.cat(rows)))
        parts = [torch.randn(3 * world, 8, generator=torch.Generator().manual_seed(9 + r)) for r in range(world)]
        block = ep.reduce_scatter_rows(parts[rank].to(ep.groups.device))
        want = parts[0]
        for p in parts[1:]:
            want = want + p
        out.append(torch.equal(block.cpu(), want[rank * 3:(rank + 1) * 3]))
        torch.cuda.synchronize()
        ep.host_collective.check()
        return out, dict(ep.stats.calls)
    finally:
        ep.close()


@pytest.mark.gpu
def test_gpu_host_path_sums_bit_equal_to_the_rank_order_reference():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    for out, calls in run_ranks(_gpu_rank, 2, timeout=120, backend="nccl"):
        assert out == [True] * 5
        assert calls.get("latency_allreduce_host") == 3 and "latency_allreduce" not in calls
        assert calls.get("allgather_host") == 1 and calls.get("reduce_scatter_host") == 1
