"""Where experts live (`Placement`) and which replica each pair uses (`TradePlan`).

Shape legend: E logical experts, R ranks of the expert-parallel group, S slots per rank,
P = R * S physical slots (global slot id p = rank * S + slot), T tokens, K experts per token,
N = T * K (token, k) pairs.

A `Placement` is immutable; the balancer makes a new one at a step boundary. Every rank holds the same
number of slots S; an expert may have several replicas (redundant slots), and every expert has at
least one. A `TradePlan` (also immutable) says, for each source rank, how the pairs of each expert
split across that expert's replicas; `TradePlan.identity` is the `Placement.slot_table` rule. The
planners that make both live in `planner.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import ConfigError

__all__ = ["QUOTA_ONE", "Placement", "TradePlan"]

_FEW_SPLIT = 8  # assign(): up to this many split experts per source use a one-hot running count
_QUOTA_BITS = 16
QUOTA_ONE = 1 << _QUOTA_BITS  # a quota of QUOTA_ONE: all of a (source, expert)'s pairs go to that slot


@dataclass(frozen=True, eq=False)
class Placement:
    """slot_expert_RS[r][s] = the logical expert held by slot s of rank r (a tuple of tuples)."""

    num_experts: int
    slot_expert_RS: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        rows = self.slot_expert_RS
        if not rows or any(len(row) != len(rows[0]) or not row for row in rows):
            raise ConfigError(
                f"Placement.slot_expert_RS must give every rank the same, non-zero number of slots; "
                f"got slots per rank {[len(row) for row in rows]}"
            )
        flat = [e for row in rows for e in row]
        bad = [e for e in flat if not 0 <= e < self.num_experts]
        if bad:
            raise ConfigError(f"Placement: expert ids {bad[:5]} are outside [0, {self.num_experts})")
        missing = sorted(set(range(self.num_experts)) - set(flat))
        if missing:
            raise ConfigError(f"Placement: experts {missing[:8]} have no slot; every expert needs one")

    # -- constructors

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int, slots_per_rank: int | None = None) -> "Placement":
        """Experts in contiguous blocks: rank r holds experts [r*S, (r+1)*S). With `slots_per_rank`
        larger than num_experts / ep_size, the extra slots replicate experts round-robin."""
        if ep_size <= 0 or num_experts <= 0:
            raise ConfigError(f"num_experts ({num_experts}) and ep_size ({ep_size}) must be positive")
        if slots_per_rank is None:
            if num_experts % ep_size:
                raise ConfigError(
                    f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size}); or give "
                    f"slots_per_rank >= {-(-num_experts // ep_size)} so redundant slots fill the ranks"
                )
            slots_per_rank = num_experts // ep_size
        if slots_per_rank * ep_size < num_experts:
            raise ConfigError(
                f"slots_per_rank ({slots_per_rank}) x ep_size ({ep_size}) = {slots_per_rank * ep_size} "
                f"slots cannot hold num_experts ({num_experts})"
            )
        flat = [p % num_experts for p in range(slots_per_rank * ep_size)]
        rows = tuple(tuple(flat[r * slots_per_rank:(r + 1) * slots_per_rank]) for r in range(ep_size))
        return cls(num_experts, rows)

    # -- derived views

    @property
    def ep_size(self) -> int:
        return len(self.slot_expert_RS)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slot_expert_RS[0])

    @property
    def num_slots(self) -> int:
        return self.ep_size * self.slots_per_rank

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each local slot of `rank`."""
        return self.slot_expert_RS[rank]

    def replicas(self, expert: int) -> list[int]:
        """Global slot ids holding `expert`, ascending."""
        return list(self._replicas[expert])

    @cached_property
    def _replicas(self) -> tuple[tuple[int, ...], ...]:
        flat = [e for row in self.slot_expert_RS for e in row]
        return tuple(tuple(p for p, e in enumerate(flat) if e == x) for x in range(self.num_experts))

    def slot_table(self, src_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[E] int64: the global slot that tokens of `src_rank` use for each logical expert.

        Rule (until the balancer's trade plan takes over): a replica on `src_rank` itself if there is
        one (no PCIe bytes), else the replicas are shared round-robin by source rank.
        """
        key = ("slot", src_rank, str(device))
        if key not in self._tables:
            table = []
            for reps in self._replicas:
                local = [p for p in reps if p // self.slots_per_rank == src_rank]
                table.append(local[0] if local else reps[src_rank % len(reps)])
            self._tables[key] = torch.tensor(table, dtype=torch.int64, device=device)
        return self._tables[key]

    def owner_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[E] int64: the one global slot that computes each expert when all ranks hold the same tokens
        (latency mode): its first replica."""
        key = ("owner", str(device))
        if key not in self._tables:
            self._tables[key] = torch.tensor([reps[0] for reps in self._replicas], dtype=torch.int64,
                                             device=device)
        return self._tables[key]

    def local_slots(self, ids_TK: torch.Tensor, rank: int) -> torch.Tensor:
        """[T, K] int64: for each (token, k) pair whose expert's first replica (`owner_table`) is on EP
        rank `rank`, that rank's local slot; -1 for the pairs other ranks compute (latency and
        all-gather mode, where every rank holds the same tokens)."""
        S = self.slots_per_rank
        slots_TK = self.owner_table(ids_TK.device)[ids_TK]
        return torch.where(slots_TK // S == rank, slots_TK % S, -1)

    @staticmethod
    def sorted_local_pairs(local_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pairs_M, slots_M) int64: the flat (token * K + k) index of every pair with a local slot (>= 0
        in `local_slots`), ordered by slot (stable), and that slot: the rows a rank's experts compute."""
        local_N = local_TK.reshape(-1)
        pairs_M = (local_N >= 0).nonzero().squeeze(1)
        slots_M = local_N[pairs_M]
        order_M = torch.argsort(slots_M, stable=True)
        return pairs_M[order_M], slots_M[order_M]

    @cached_property
    def slot_experts_P(self) -> torch.Tensor:
        """[P] int64 (CPU): the logical expert of every global slot."""
        return torch.tensor([e for row in self.slot_expert_RS for e in row], dtype=torch.int64)

    @cached_property
    def _tables(self) -> dict:
        return {}

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Placement) and other.num_experts == self.num_experts
                and other.slot_expert_RS == self.slot_expert_RS)

    def __hash__(self) -> int:
        return hash((self.num_experts, self.slot_expert_RS))

    def __repr__(self) -> str:
        return f"Placement(experts={self.num_experts}, ranks={self.ep_size}, slots={self.slots_per_rank})"


@dataclass(frozen=True, eq=False)
class TradePlan:
    """How each source rank's pairs of each expert split across the expert's replicas.

    quota_RP[r][p]: the share, in units of 1 / QUOTA_ONE, of the pairs that source rank r routes to
    expert(p) which slot p computes. For every source rank r and expert e the quotas of e's replicas
    sum to QUOTA_ONE; a non-replicated expert's only slot always has QUOTA_ONE. Integer quotas make
    `assign` exact and identical on every rank.
    """

    placement: Placement
    quota_RP: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        pl, R, P = self.placement, self.placement.ep_size, self.placement.num_slots
        if len(self.quota_RP) != R or any(len(row) != P for row in self.quota_RP):
            lengths = sorted({len(r) for r in self.quota_RP})
            raise ConfigError(f"TradePlan.quota_RP must be {R} x {P} (ranks x slots of {pl!r}); got "
                              f"{len(self.quota_RP)} rows of lengths {lengths}")
        for r, row in enumerate(self.quota_RP):
            if any(type(q) is not int or not 0 <= q <= QUOTA_ONE for q in row):
                raise ConfigError(f"TradePlan: quotas of source rank {r} must be ints in [0, {QUOTA_ONE}]")
            for e, reps in enumerate(pl._replicas):
                total = sum(row[p] for p in reps)
                if total != QUOTA_ONE:
                    raise ConfigError(f"TradePlan: the quotas of expert {e}'s replicas {list(reps)} for "
                                      f"source rank {r} sum to {total}, not {QUOTA_ONE}")

    @classmethod
    def identity(cls, placement: Placement) -> "TradePlan":
        """No trading: every pair goes where `placement.slot_table(src_rank)` sends it."""
        rows = []
        for r in range(placement.ep_size):
            row = [0] * placement.num_slots
            for p in placement.slot_table(r).tolist():
                row[p] = QUOTA_ONE
            rows.append(tuple(row))
        return cls(placement, tuple(rows))

    # -- queries

    def split(self, src_rank: int, expert: int) -> dict[int, float]:
        """{global slot: fraction} of `expert`'s pairs from `src_rank` (slots with a zero quota omitted)."""
        row = self.quota_RP[src_rank]
        return {p: row[p] / QUOTA_ONE for p in self.placement._replicas[expert] if row[p]}

    def split_experts(self, src_rank: int) -> tuple[int, ...]:
        """Experts whose pairs from `src_rank` are shared by more than one slot."""
        row = self.quota_RP[src_rank]
        return tuple(e for e, reps in enumerate(self.placement._replicas)
                     if sum(1 for p in reps if row[p]) > 1)

    @property
    def is_identity(self) -> bool:
        return self == TradePlan.identity(self.placement)

    def slot_loads(self, load_RE: torch.Tensor) -> torch.Tensor:
        """Predicted pairs per slot: load_RE [R, E] (pairs from each source rank per expert) -> [P].

        An integer load_RE gives int64 in units of 1 / QUOTA_ONE pair: exact, so every rank compares
        the same numbers; a floating load_RE gives float64 pairs."""
        R, E = self.placement.ep_size, self.placement.num_experts
        if not isinstance(load_RE, torch.Tensor) or tuple(load_RE.shape) != (R, E):
            shape = tuple(load_RE.shape) if isinstance(load_RE, torch.Tensor) else type(load_RE).__name__
            raise ConfigError(f"load_RE must be a [{R}, {E}] tensor (ranks x experts), got {shape}")
        quota_RP, expert_P = self._dense
        if load_RE.is_floating_point():
            return (load_RE.detach().to("cpu", torch.float64)[:, expert_P] * quota_RP).sum(0) / QUOTA_ONE
        return (load_RE.detach().to("cpu", torch.int64)[:, expert_P] * quota_RP).sum(0)

    def rank_loads(self, load_RE: torch.Tensor) -> torch.Tensor:
        """[R] predicted pairs each rank computes (units as in `slot_loads`)."""
        return self.slot_loads(load_RE).view(self.placement.ep_size, -1).sum(1)

    def imbalance(self, load_RE: torch.Tensor) -> float:
        """max rank load / mean rank load under this plan (1.0 when there is no load)."""
        load_R = self.rank_loads(load_RE)
        total = load_R.sum().item()
        return load_R.max().item() * load_R.numel() / total if total > 0 else 1.0

    # -- the hot path

    def assign(self, src_rank: int, ids_TK: torch.Tensor) -> torch.Tensor:
        """Global slot of every (token, k) pair of `src_rank`: ids_TK int [T, K] (or any shape) ->
        int64 [T * K] on ids_TK's device.

        For each expert split across replicas, its pairs in token order (flattened (t, k) order) go to
        the replicas in ascending slot order: replica j takes positions [ceil(c_{j-1} n), ceil(c_j n))
        of the expert's n pairs, c_j the cumulative quota fraction. Deterministic; vectorized."""
        if not 0 <= src_rank < self.placement.ep_size:
            raise ConfigError(f"src_rank ({src_rank}) must be in [0, {self.placement.ep_size})")
        table_E, split_E, slots_EJ, cum_EJ, compact_E, C = self._tables_for(src_rank, ids_TK.device)
        ids_N = ids_TK.reshape(-1)
        slots_N = table_E.index_select(0, ids_N)
        if slots_EJ is None:
            return slots_N
        idx_M = split_E.index_select(0, ids_N).nonzero().squeeze(1)
        if idx_M.numel() == 0:
            return slots_N
        sub_M = ids_N.index_select(0, idx_M)
        counts_E = torch.bincount(sub_M, minlength=self.placement.num_experts)
        if compact_E is not None:  # few split experts: position in the expert = running count - 1
            c_M = compact_E.index_select(0, sub_M).unsqueeze(1)
            onehot_MC = (c_M == torch.arange(C, device=c_M.device)).to(torch.int32)
            running_MC = onehot_MC.cumsum(0, dtype=torch.int32)
            pos_M = running_MC.gather(1, c_M).squeeze(1) - 1
        else:  # many: stable sort by expert, position = index - start of the expert's run
            order_M = torch.argsort(sub_M, stable=True)
            start_E = torch.cumsum(counts_E, 0) - counts_E
            pos_M = torch.empty_like(order_M)
            pos_M[order_M] = torch.arange(sub_M.numel(), device=ids_N.device) - start_E[sub_M[order_M]]
        n_M1 = counts_E.index_select(0, sub_M).unsqueeze(1)
        bound_MJ = (cum_EJ.index_select(0, sub_M) * n_M1 + (QUOTA_ONE - 1)) >> _QUOTA_BITS  # ceil
        j_M = (pos_M.unsqueeze(1) >= bound_MJ).sum(1)
        slots_N.index_copy_(0, idx_M, slots_EJ.view(-1).index_select(0, sub_M * slots_EJ.shape[1] + j_M))
        return slots_N

    @cached_property
    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.quota_RP, dtype=torch.int64), self.placement.slot_experts_P

    @cached_property
    def _tables(self) -> dict:
        return {}

    def _tables_for(self, src_rank: int, device: torch.device):
        key = (src_rank, str(device))
        if key not in self._tables:
            row, reps_E = self.quota_RP[src_rank], self.placement._replicas
            used_E = [[p for p in reps if row[p]] for reps in reps_E]
            table_E = torch.tensor([used[0] for used in used_E], dtype=torch.int64, device=device)
            split = [len(used) > 1 for used in used_E]
            if not any(split):
                self._tables[key] = (table_E, None, None, None, None, 0)
            else:
                J = max(len(used) for used in used_E)
                slots, cums = [], []
                for used in used_E:
                    cum = [sum(row[p] for p in used[:j + 1]) for j in range(len(used))]
                    slots.append(used + [used[-1]] * (J - len(used)))
                    cums.append(cum + [QUOTA_ONE] * (J - len(used)))
                compact, c = [], 0
                for is_split in split:
                    compact.append(c if is_split else -1)
                    c += is_split
                self._tables[key] = (table_E, torch.tensor(split, device=device),
                                     torch.tensor(slots, dtype=torch.int64, device=device),
                                     torch.tensor(cums, dtype=torch.int64, device=device),
                                     torch.tensor(compact, dtype=torch.int64, device=device)
                                     if c <= _FEW_SPLIT else None, c)
        return self._tables[key]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TradePlan) and other.placement == self.placement
                and other.quota_RP == self.quota_RP)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.placement, self.quota_RP))

    def __repr__(self) -> str:
        split = sorted({e for r in range(self.placement.ep_size) for e in self.split_experts(r)})
        return f"TradePlan({self.placement!r}, split experts {split})"
