"""Topology: ranks, their coordinates, and the semantic groups collectives run over.

The world is `dp` data-parallel attention replicas of `cp` ranks each: replica r is ranks
[r * cp, (r + 1) * cp). A replica serves its own requests; within it prompt chunks run replicated
on every rank and the KV cache is sharded across them by sequence block (context parallelism).
Expert-parallel groups are contiguous blocks of `ep` ranks over the whole world, each rank holding
`n_routed_experts / ep` routed experts. When every EP group lies inside one replica its ranks
hold the same tokens (the static MoE: no dispatch); otherwise tokens travel to their experts'
ranks and back (the all-to-all MoE, `graphc.models.moe_forms.MOE_LOWERINGS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.errors import GraphcError

GROUPS = ("world", "cp", "ep")
"""Semantic group names that collectives may carry: every rank, the rank's attention replica
(its context-parallel group), its expert-parallel group."""


@dataclass(frozen=True)
class Topology:
    cp: int = 1
    """Context-parallel ranks of each attention replica."""
    ep: int = 1
    """Expert-parallel group size; divides the world."""
    dp: int = 1
    """Data-parallel attention replicas."""

    def __post_init__(self) -> None:
        # The one place these rules live: model.yaml, manifests and `graphc sweep` build a Topology.
        for key, value in (("dp", self.dp), ("cp", self.cp), ("ep", self.ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphcError(f"topology.{key}: {value} must be a positive integer")
        if self.world % self.ep:
            raise GraphcError(f"topology.ep: {self.ep} must divide the world size (dp * cp = {self.world}); "
                              f"{self.world} % {self.ep} = {self.world % self.ep}")

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def tokens_replicated(self) -> bool:
        """Whether every EP group lies inside one replica, so its ranks hold the same tokens."""
        return self.cp % self.ep == 0

    def group_size(self, group: str) -> int:
        if group not in GROUPS:
            raise GraphcError(f"unknown group {group!r}; groups are {', '.join(GROUPS)}")
        return {"world": self.world, "cp": self.cp, "ep": self.ep}[group]

    def group_ranks(self, group: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group named `group`."""
        if group == "world":
            return list(range(self.world))
        size = self.group_size(group)
        first = rank - rank % size
        return list(range(first, first + size))

    def groups(self, group: str) -> list[list[int]]:
        """Every group named `group`, in rank order."""
        size = self.group_size(group)
        return [self.group_ranks(group, first) for first in range(0, self.world, size)]

    def cp_rank(self, rank: int) -> int:
        return rank % self.cp

    def dp_rank(self, rank: int) -> int:
        """The attention replica `rank` belongs to."""
        return rank // self.cp

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def replica_leader(self, replica: int) -> int:
        """The rank that samples replica `replica`'s tokens (its first)."""
        return replica * self.cp

    def coordinates(self, rank: int) -> list[int]:
        """The step's `coordinates` input on `rank` (`graphc.step.COORDINATES`: cp rank, ep rank,
        whether it samples: the first rank of each replica)."""
        return [self.cp_rank(rank), self.ep_rank(rank), int(self.cp_rank(rank) == 0)]

    def experts(self, rank: int, n_routed_experts: int) -> range:
        """The routed experts `rank` holds."""
        if n_routed_experts % self.ep:
            raise GraphcError(f"topology.ep: {self.ep} must divide the checkpoint's n_routed_experts "
                              f"({n_routed_experts}); {n_routed_experts} % {self.ep} = {n_routed_experts % self.ep}")
        per_rank = n_routed_experts // self.ep
        first = self.ep_rank(rank) * per_rank
        return range(first, first + per_rank)
