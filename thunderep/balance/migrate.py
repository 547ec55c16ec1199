"""Move or replicate experts between ranks at a step boundary: a layer goes from one Placement to another.

Shape legend: R ranks of the EP group, S slots per rank, E logical experts.

Every slot whose logical expert changes receives that expert's weights from the rank holding its
first replica in the old placement (the same rank on every rank's view, so sends and receives pair
up), through point-to-point `isend` / `irecv`; slots that keep their expert are not touched. Parameters
are updated in place, so the optimizer keeps its references.

Training: the optimizer state of a slot moves with its weights (every state tensor shaped like the
parameter, e.g. Adam's exp_avg / exp_avg_sq, is cut along the slot dimension and sent along; scalar
state such as Adam's step count is shared by all slots and stays). We move the state rather than
keeping it on the old owner: a replica or a moved expert then continues with exactly the moments its
weights were trained with, so a migration changes where the math runs, never the math itself.
Gradients are not moved: migrations happen between steps, after the optimizer step, when gradients
are consumed.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..comm.groups import peer_errors
from ..errors import ConfigError
from .placement import Placement

__all__ = ["migrate_slots", "slot_bytes"]


def _slot_tensors(params, optimizer) -> list[torch.Tensor]:
    """Every tensor with a leading slot dimension that must travel with a slot, in a fixed order."""
    out = []
    for p in params:
        out.append(p.data)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                out.append(value)
    return out


def slot_bytes(params, optimizer=None) -> int:
    """Bytes one slot's migration moves: its share of `params` (leading dim = slots) and of `optimizer`'s
    state tensors shaped like them, i.e. of everything `migrate_slots` sends."""
    params = list(params)
    return sum(t.numel() * t.element_size() for t in _slot_tensors(params, optimizer)) // params[0].shape[0]


def migrate_slots(params, old: Placement, new: Placement, groups, optimizer=None,
                  timeout_s: float | None = None) -> int:
    """Move the slots of `params` (expert-sharded tensors, leading dim = local slots) and their optimizer
    state from placement `old` to `new`, in place (collective over the EP group of `groups`). Returns
    the number of bytes this rank sent. The caller records the new placement."""
    if new.num_experts != old.num_experts or new.ep_size != old.ep_size or new.slots_per_rank != old.slots_per_rank:
        raise ConfigError(
            f"migration keeps the shape: experts {old.num_experts}, ranks {old.ep_size}, slots "
            f"{old.slots_per_rank}; the new placement has {new.num_experts}, {new.ep_size}, {new.slots_per_rank}"
        )
    S, me = old.slots_per_rank, groups.ep_rank
    tensors = _slot_tensors(params, optimizer)
    sends, recvs, local = [], [], []
    for r in range(new.ep_size):
        for s in range(S):
            e_new, e_old = new.slot_expert_RS[r][s], old.slot_expert_RS[r][s]
            if e_new == e_old:
                continue
            src_slot = old.replicas(e_new)[0]
            src_rank, src_s = divmod(src_slot, S)
            if src_rank == r == me:
                local.append((s, src_s))
            elif src_rank == me:
                sends.append((r, src_s))
            elif r == me:
                recvs.append((src_rank, s))
    # Snapshot what leaves or is copied locally before anything is overwritten.
    outgoing = [(dst, [t[src_s].clone() for t in tensors]) for dst, src_s in sends]
    copies = [(s, [t[src_s].clone() for t in tensors]) for s, src_s in local]
    incoming = [(src, s, [torch.empty_like(t[s]) for t in tensors]) for src, s in recvs]
    ops = []
    for dst, parts in outgoing:
        ops += [dist.P2POp(dist.isend, part, groups.ep_global_rank(dst), group=groups.ep_group) for part in parts]
    for src, _, parts in incoming:
        ops += [dist.P2POp(dist.irecv, part, groups.ep_global_rank(src), group=groups.ep_group) for part in parts]
    timeout = datetime.timedelta(seconds=timeout_s or groups.timeout_s)
    if ops:
        with peer_errors(f"expert migration on EP rank {me}", f"{timeout.total_seconds():g} s"):
            for work in dist.batch_isend_irecv(ops):
                work.wait(timeout=timeout)
    with torch.no_grad():
        for s, parts in copies:
            for t, part in zip(tensors, parts):
                t[s].copy_(part)
        for _, s, parts in incoming:
            for t, part in zip(tensors, parts):
                t[s].copy_(part)
    return sum(part.numel() * part.element_size() for _, parts in outgoing for part in parts)
