"""Gradient sums among the holders of the same expert: its replicas in an EP group (redundant slots)
and its copies in the other EP groups (data parallel). The all-to-all backward delivers every expert
gradient to its holder; an expert with several holders then sums it among exactly those."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["replica_groups", "sum_replica_grads"]


def replica_groups(ep, placement, params: list[nn.Parameter], timeout: datetime.timedelta):
    """(param, local slot, process group) for the local slots of one expert-parallel layer whose expert
    has other holders: its replicas in this EP group and its copies in the other EP groups (data
    parallel). Collective over the whole world: every rank calls it with the same placement."""
    groups = ep.groups
    S = placement.slots_per_rank
    out, made = [], {}
    for e in range(placement.num_experts):
        holders_ep = sorted({p // S for p in placement.replicas(e)})
        ranks = tuple(d * groups.ep_size + r for d in range(groups.dp_size) for r in holders_ep)
        if len(ranks) < 2:
            continue
        if ranks not in made:
            made[ranks] = dist.new_group(list(ranks), timeout=timeout)  # every rank calls it
        if groups.rank in ranks:
            for slot, expert in enumerate(placement.experts_of(groups.ep_rank)):
                if expert == e:
                    for p in params:
                        if p.requires_grad:  # a frozen tensor has no gradient to sum
                            out.append((p, slot, made[ranks]))
    return out


def sum_replica_grads(replicas: list, wait=None) -> int:
    """Sum the gradient of each (param, slot, group) entry of `replica_groups` over its group: one flat
    all-reduce per group (a layer's holders of the same experts), not one per slot and tensor. Groups
    go in the order of their first entry, the same on every member (entries follow expert order).
    wait(work, flat): how to wait (default: work.wait()). Returns the bytes handed to all-reduce."""
    by_group: dict = {}
    for p, slot, group in replicas:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_group.setdefault(group, []).append((p, slot))
    total = 0
    for group, entries in by_group.items():
        flat = torch.cat([p.grad[slot].reshape(-1) for p, slot in entries])
        work = dist.all_reduce(flat, group=group, async_op=True)
        if wait is None:
            work.wait()
        else:
            wait(work, flat)
        offset = 0
        for p, slot in entries:
            g = p.grad[slot]
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        total += flat.numel() * flat.element_size()
    return total
