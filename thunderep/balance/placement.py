"""Where experts live: logical expert -> physical slots (rank, local slot).

Shape legend: E logical experts, R ranks of the expert-parallel group, S slots per rank,
P = R * S physical slots (global slot id p = rank * S + slot), T tokens, K experts per token.

A `Placement` is immutable; the balancer makes a new one at a step boundary. Every rank holds the same
number of slots S; an expert may have several replicas (redundant slots), and every expert has at
least one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import ConfigError

__all__ = ["Placement"]


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
