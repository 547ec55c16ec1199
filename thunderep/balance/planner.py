"""Pure planners: where experts live (`plan_placement`) and how replicas share the load (`plan_trade`).

Shape legend: E logical experts, R ranks, S slots per rank, P = R * S global slots. A load is a
number of (token, k) pairs per step: load_E per expert (summed over source ranks), load_RE per source
rank and expert.

Both planners are pure functions of their arguments. Their arithmetic is plain Python floats and ints
in a fixed order (IEEE-754 doubles, no library reductions whose order could depend on the CPU), so
every rank that runs them on the same exchanged integers gets the same plan, bit for bit.

    plan_placement(load_E, R, S, previous) -> Placement   (DeepSeek-EPLB-like, sticky)
    plan_trade(load_RE, placement)         -> TradePlan   (water-filling, local replica first)
    water_fill(load_E, placement)          -> (amount per expert and rank, level_R)
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from .placement import QUOTA_ONE, Placement, TradePlan

__all__ = ["moved_slots", "plan_placement", "plan_trade", "water_fill"]

WATER_PASSES = 16   # coordinate-descent passes of `water_fill`; it usually settles in 2-4
KEEP_TOLERANCE = 0.02  # plan_placement keeps more slots if the max rank load grows by at most 2%


def _loads(name: str, load: torch.Tensor, shape: tuple[int, ...]) -> list:
    if not isinstance(load, torch.Tensor) or tuple(load.shape) != shape:
        got = tuple(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__
        raise ConfigError(f"{name} must be a tensor of shape {list(shape)}, got {got}")
    values = load.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ConfigError(f"{name} must hold finite, non-negative pair counts; got min "
                          f"{values.min().item()!r}, max {values.max().item()!r}")
    return values.tolist()


def _replica_ranks(placement: Placement) -> list[list[int]]:
    """Distinct ranks holding each expert, ascending."""
    S = placement.slots_per_rank
    return [sorted({p // S for p in reps}) for reps in placement._replicas]


def _pour(amount: float, ranks: list[int], level: list[float]) -> dict[int, float]:
    """Split `amount` over `ranks` raising the lowest levels first to one common water level."""
    order = sorted(ranks, key=lambda q: (level[q], q))
    acc, h, k = 0.0, 0.0, len(order)
    for i, q in enumerate(order):
        acc += level[q]
        h = (amount + acc) / (i + 1)
        if i + 1 == len(order) or h <= level[order[i + 1]]:
            k = i + 1
            break
    return {q: (max(0.0, h - level[q]) if i < k else 0.0) for i, q in enumerate(order)}


def water_fill(load_E: torch.Tensor | list[float], placement: Placement,
               passes: int = WATER_PASSES) -> tuple[list[dict[int, float]], list[float]]:
    """Split each replicated expert's load over its replica ranks to minimize the maximum rank load.

    load_E: [E] pairs per expert (a tensor or a list of floats). Returns (amount_E, level_R):
    amount_E[e] = {rank: pairs of e that rank computes} (ranks holding e), level_R[q] = pairs rank q
    computes. Non-replicated experts stay on their rank; replicated experts are re-poured one at a
    time (heaviest first) onto the others' levels until no amount changes (coordinate descent on the
    min-max, which the subset bound max_U (load of U + experts living only in U) / |U| certifies in the
    tests).
    """
    E = placement.num_experts
    loads = load_E if isinstance(load_E, list) else _loads("load_E", load_E, (E,))
    ranks_E = _replica_ranks(placement)
    level = [0.0] * placement.ep_size
    amount_E: list[dict[int, float]] = []
    multi = []
    for e, ranks in enumerate(ranks_E):
        amount_E.append({q: (loads[e] if len(ranks) == 1 else 0.0) for q in ranks})
        if len(ranks) == 1:
            level[ranks[0]] += loads[e]
        else:
            multi.append(e)
    multi.sort(key=lambda e: (-loads[e], e))
    for _ in range(passes if multi else 0):
        change = 0.0
        for e in multi:
            for q, a in amount_E[e].items():
                level[q] -= a
            new = _pour(loads[e], ranks_E[e], level)
            for q, a in new.items():
                level[q] += a
                change = max(change, abs(a - amount_E[e][q]))
            amount_E[e] = new
        if change <= 1e-9 * (1.0 + max(level)):
            break
    return amount_E, level


def _quotas(amounts: list[float]) -> list[int]:
    """Fractions amounts / sum(amounts) as ints summing to QUOTA_ONE (cumulative rounding)."""
    total, cum, prev, out = sum(amounts), 0.0, 0, []
    for a in amounts:
        cum += a
        q = math.floor(cum * QUOTA_ONE / total + 0.5)
        out.append(q - prev)
        prev = q
    out[-1] += QUOTA_ONE - prev
    return out


def plan_trade(load_RE: torch.Tensor, placement: Placement) -> TradePlan:
    """Split each replicated expert's pairs across its replicas, per source rank.

    load_RE: [R, E] pairs each source rank routes to each expert per step (exchanged loads).
    The amount each replica rank computes comes from `water_fill` (min-max rank load). Then, per
    expert, each replica rank first keeps its own pairs (local replica first: no PCIe bytes), up to its
    amount; the rest of its amount is filled by the other sources in ascending rank order. A source
    with no load for an expert keeps its local replica if it has one, else splits like the amounts.
    Returns a `TradePlan` (identity quotas for non-replicated experts).
    """
    R, S, E = placement.ep_size, placement.slots_per_rank, placement.num_experts
    load = _loads("load_RE", load_RE, (R, E))
    total_E = [sum(load[r][e] for r in range(R)) for e in range(E)]
    amount_E, _ = water_fill(total_E, placement)
    ranks_E = _replica_ranks(placement)
    quota = [[0] * placement.num_slots for _ in range(R)]
    for e, reps in enumerate(placement._replicas):
        ranks = ranks_E[e]
        first = {q: min(p for p in reps if p // S == q) for q in ranks}
        if len(ranks) == 1:
            for r in range(R):
                quota[r][first[ranks[0]]] = QUOTA_ONE
            continue
        x = amount_E[e]
        local = {q: min(load[q][e], x[q]) for q in ranks}
        cap = {q: x[q] - local[q] for q in ranks}
        for r in range(R):
            got = {q: 0.0 for q in ranks}
            need = load[r][e]
            if need <= 0.0:
                if r in first:
                    got[r] = 1.0
                else:
                    got = dict(x) if sum(x.values()) > 0 else {q: 1.0 for q in ranks}
            else:
                if r in local:
                    got[r], need = local[r], need - local[r]
                for q in ranks:
                    if need <= 0.0:
                        break
                    take = min(need, cap[q])
                    if take > 0.0:
                        got[q] += take
                        cap[q] -= take
                        need -= take
                if sum(got.values()) <= 0.0:  # rounding left nothing: fall back to the amounts
                    got = dict(x)
            for q, share in zip(ranks, _quotas([got[q] for q in ranks])):
                quota[r][first[q]] = share
    return TradePlan(placement, tuple(tuple(row) for row in quota))


# -- placement


def _replica_counts(loads: list[float], num_slots: int, ep_size: int) -> list[int]:
    """Give each redundant slot to the expert with the most load per replica (EPLB), at most one
    replica per rank while any expert can still take one."""
    E = len(loads)
    reps = [1] * E
    for _ in range(num_slots - E):
        open_ = [e for e in range(E) if reps[e] < ep_size] or list(range(E))
        best = max(open_, key=lambda e: (loads[e] / reps[e], -e))
        reps[best] += 1
    return reps


def _pack(loads: list[float], reps: list[int], R: int, S: int, previous: Placement | None,
          cap: float) -> list[list[int]]:
    """Greedy packing of replicas (weight load / replicas), heaviest first, onto the least loaded rank
    with a free slot that does not hold the expert yet. With `previous`, a replica goes back to a rank
    that held the expert before whenever that keeps the rank's load within `cap` (sticky packing)."""
    items = sorted(((loads[e] / reps[e], e) for e in range(len(loads)) for _ in range(reps[e])),
                   key=lambda t: (-t[0], t[1]))
    sets: list[list[int]] = [[] for _ in range(R)]
    level = [0.0] * R
    before = None if previous is None else [list(previous.experts_of(q)) for q in range(R)]
    for w, e in items:
        free = [q for q in range(R) if len(sets[q]) < S]
        fresh = [q for q in free if e not in sets[q]] or free
        sticky = [] if before is None else [q for q in fresh if e in before[q] and level[q] + w <= cap]
        q = min(sticky or fresh, key=lambda q: (level[q], q))
        if sticky:
            before[q].remove(e)
        sets[q].append(e)
        level[q] += w
    return sets


def _repair(loads: list[float], reps: list[int], previous: Placement) -> Placement:
    """The fewest-moves candidate: keep `previous` and only retarget redundant slots - each replica an
    expert gains takes the slot of a replica another expert loses, on the least loaded rank that does
    not hold the gaining expert yet."""
    R, S = previous.ep_size, previous.slots_per_rank
    rows = [list(previous.experts_of(q)) for q in range(R)]
    have = [0] * len(loads)
    for row in rows:
        for e in row:
            have[e] += 1

    def level(q: int) -> float:
        return sum(loads[e] / reps[e] for e in rows[q])

    gain = sorted((e for e in range(len(loads)) for _ in range(max(0, reps[e] - have[e]))),
                  key=lambda e: (-loads[e], e))
    for e in gain:
        spare = [(q, s) for q in range(R) for s in range(S) if have[rows[q][s]] > reps[rows[q][s]]]
        fresh = [(q, s) for q, s in spare if e not in rows[q]] or spare
        q, s = min(fresh, key=lambda qs: (level(qs[0]), qs))
        have[rows[q][s]] -= 1
        rows[q][s] = e
        have[e] += 1
    return Placement(previous.num_experts, tuple(tuple(row) for row in rows))


def _to_slots(num_experts: int, sets: list[list[int]], S: int, previous: Placement | None) -> Placement:
    """Rank sets -> slots: an expert that stays on a rank keeps its slot; newcomers fill the rest."""
    rows = []
    for q, experts in enumerate(sets):
        want = sorted(experts)
        row: list[int | None] = [None] * S
        if previous is not None:
            for s, e in enumerate(previous.experts_of(q)):
                if e in want:
                    row[s] = e
                    want.remove(e)
        free = [s for s in range(S) if row[s] is None]
        for s, e in zip(free, want):
            row[s] = e
        rows.append(tuple(row))
    return Placement(num_experts, tuple(rows))


def moved_slots(old: Placement, new: Placement) -> tuple[int, ...]:
    """Global slots whose expert differs between two placements of the same shape."""
    a = [e for row in old.slot_expert_RS for e in row]
    b = [e for row in new.slot_expert_RS for e in row]
    return tuple(p for p, (x, y) in enumerate(zip(a, b)) if x != y)


def plan_placement(load_E: torch.Tensor, ep_size: int, slots_per_rank: int,
                   previous: Placement | None = None, *, tolerance: float = KEEP_TOLERANCE) -> Placement:
    """A placement of E experts on ep_size x slots_per_rank slots for the load `load_E` [E] (pairs per
    expert per step, summed over source ranks), in the manner of DeepSeek's EPLB:

    1. replicas: each of the P - E redundant slots goes to the expert with the most load per replica;
    2. packing: replicas, heaviest first, onto the least loaded rank with a free slot;
    3. keep what stays: candidates are `previous` itself; a repair of it (only redundant slots change
       hands, to the experts whose replica count grew); a sticky packing (replicas return to ranks
       that held them while the rank stays within the plain packing's max load x (1 + tolerance));
       and the plain packing. Each is scored by its water-filled max rank load (`water_fill`, i.e.
       after trading); among those within (1 + tolerance) of the best, the one moving the fewest
       slots wins (ties in that order). Experts that stay on a rank keep their slot.
    """
    for name, v in (("ep_size", ep_size), ("slots_per_rank", slots_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(load_E, torch.Tensor) or load_E.dim() != 1:
        raise ConfigError(f"load_E must be a 1-D tensor [E], got {getattr(load_E, 'shape', type(load_E))}")
    E, R, S = load_E.numel(), ep_size, slots_per_rank
    if R * S < E:
        raise ConfigError(f"slots_per_rank ({S}) x ep_size ({R}) = {R * S} slots cannot hold {E} experts")
    shape = None if previous is None else (previous.num_experts, previous.ep_size, previous.slots_per_rank)
    if previous is not None and shape != (E, R, S):
        raise ConfigError(f"previous placement has {previous.num_experts} experts on {previous.ep_size} x "
                          f"{previous.slots_per_rank} slots; the plan is for {E} on {R} x {S}")
    loads = _loads("load_E", load_E, (E,))
    reps = _replica_counts(loads, R * S, R)
    plain = _to_slots(E, _pack(loads, reps, R, S, None, 0.0), S, previous)
    if previous is None:
        return plain
    plain_max = max(water_fill(loads, plain)[1])
    sticky = _to_slots(E, _pack(loads, reps, R, S, previous, plain_max * (1.0 + tolerance)), S, previous)
    scored = []
    for i, cand in enumerate((previous, _repair(loads, reps, previous), sticky, plain)):
        scored.append((max(water_fill(loads, cand)[1]), len(moved_slots(previous, cand)), i, cand))
    best = min(s[0] for s in scored)
    keep = [s for s in scored if s[0] <= best * (1.0 + tolerance) + 1e-12]
    return min(keep, key=lambda s: (s[1], s[2]))[3]
