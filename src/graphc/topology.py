"""Topology: ranks, their coordinates, and the semantic groups collectives run over.

All ranks form one attention replica (world = cp): prompt chunks run replicated on every rank and
the KV cache is sharded across them by sequence block. Expert-parallel groups are contiguous
blocks of `ep` ranks, each holding `n_routed_experts / ep` routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.errors import GraphcError

GROUPS = ("world", "cp", "ep")
"""Semantic group names that collectives may carry."""


@dataclass(frozen=True)
class Topology:
    cp: int = 1
    """Context-parallel ranks (the world)."""
    ep: int = 1
    """Expert-parallel group size; divides the world."""

    def __post_init__(self) -> None:
        # The one place these rules live: model.yaml, manifests and `graphc sweep` build a Topology.
        for key, value in (("cp", self.cp), ("ep", self.ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphcError(f"topology.{key}: {value} must be a positive integer")
        if self.cp % self.ep:
            raise GraphcError(f"topology.ep: {self.ep} must divide the world size (cp = {self.cp}); "
                              f"{self.cp} % {self.ep} = {self.cp % self.ep}")

    @property
    def world(self) -> int:
        return self.cp

    def group_size(self, group: str) -> int:
        if group not in GROUPS:
            raise GraphcError(f"unknown group {group!r}; groups are {', '.join(GROUPS)}")
        return self.ep if group == "ep" else self.cp

    def group_ranks(self, group: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group named `group`."""
        if group == "ep":
            first = rank - rank % self.ep
            return list(range(first, first + self.ep))
        self.group_size(group)
        return list(range(self.world))

    def ep_groups(self) -> list[list[int]]:
        return [list(range(first, first + self.ep)) for first in range(0, self.world, self.ep)]

    def cp_rank(self, rank: int) -> int:
        return rank

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def coordinates(self, rank: int) -> list[int]:
        """The step's `coordinates` input on `rank` (`graphc.step.COORDINATES`: cp rank, ep rank,
        whether it samples: only the leader, rank 0)."""
        return [self.cp_rank(rank), self.ep_rank(rank), int(rank == 0)]

    def experts(self, rank: int, n_routed_experts: int) -> range:
        """The routed experts `rank` holds."""
        if n_routed_experts % self.ep:
            raise GraphcError(f"topology.ep: {self.ep} must divide the checkpoint's n_routed_experts "
                              f"({n_routed_experts}); {n_routed_experts} % {self.ep} = {n_routed_experts % self.ep}")
        per_rank = n_routed_experts // self.ep
        first = self.ep_rank(rank) * per_rank
        return range(first, first + per_rank)
