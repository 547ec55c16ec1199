"""Plain values (None, booleans, numbers, strings, lists, dicts) gathered from every rank as JSON bytes.

torch's `*_object` collectives pickle what they move, and unpickling runs whatever a peer (or anything
that reaches its connection) sent; what crosses processes here is only ever parsed as JSON. Tuples come
back as lists, as JSON has them.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..errors import CommError

__all__ = ["all_gather_json"]


def all_gather_json(value, group=None) -> list:
    """[value of rank 0, value of rank 1, ...] over `group` (collective: every rank calls it)."""
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL moves device memory only
        device = torch.device("cuda", torch.cuda.current_device())
    data = json.dumps(value).encode()
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    lengths = [int(s) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    out = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, mine.to(device), group=group)
    values = []
    for rank, (tensor, n) in enumerate(zip(out, lengths)):
        try:
            values.append(json.loads(tensor[:n].cpu().numpy().tobytes().decode()))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CommError(f"rank {rank} sent a value that is not JSON ({str(exc)[:80]}): a peer that is not "
                            "ThunderEP's, or a corrupted connection") from None
    return values
