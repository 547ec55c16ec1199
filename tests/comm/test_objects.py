"""Plain values gathered as JSON (thunderep/comm/objects.py): nothing that crosses processes is unpickled."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks


def _gather(rank, world):
    from thunderep.comm.objects import all_gather_json
    from thunderep.errors import CommError

    values = all_gather_json({"rank": rank, "error": None if rank else "boom", "sizes": [rank] * rank,
                              "path": ("a", rank)})
    # A peer that is not ThunderEP's sends a pickle where JSON belongs: the others get a CommError.
    forged = pickle.dumps(("rank", rank))
    if rank == world - 1:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(forged)]))
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(forged)] = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
        dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in range(world)], mine)
        return values, None
    try:
        all_gather_json("fine")
    except CommError as exc:
        return values, str(exc)
    return values, "no error"


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_every_ranks_value_and_a_forged_one_is_an_error(world):
    results = run_ranks(_gather, world, timeout=120)
    want = [{"rank": r, "error": None if r else "boom", "sizes": [r] * r, "path": ["a", r]} for r in range(world)]
    for rank, (values, error) in enumerate(results):
        assert values == want
        if rank < world - 1:
            assert error.startswith(f"rank {world - 1} sent a value that is not JSON"), error
