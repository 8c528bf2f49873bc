"""Topology: ranks, their coordinates, and the semantic groups collectives run over.

The world is `dp` data-parallel attention replicas of `cp * tp` ranks each: replica r is ranks
[r * cp * tp, (r + 1) * cp * tp), and inside it rank `first + c * tp + t` has context-parallel
coordinate c and tensor-parallel coordinate t (tp innermost, so a tensor-parallel group, which
communicates at every layer, is contiguous ranks: the same chip or its neighbours). A replica
serves its own requests; within it prompt chunks run replicated on every rank, the KV cache is
sharded across its cp coordinates by sequence block (context parallelism, each cp group being the
ranks of one tp coordinate) and the attention heads, dense and shared FFN widths and the
vocabulary across its tp coordinates (tensor parallelism; the ranks of a tp group hold the same
KV blocks: MLA's latent is shared by every head). Expert-parallel groups are contiguous blocks of
`ep` ranks over the whole world, each rank holding `n_routed_experts / ep` routed experts. When
every EP group lies inside one replica its ranks hold the same tokens (the static MoE: no
dispatch); otherwise tokens travel to their experts' ranks and back (the all-to-all MoE,
`graphc.models.moe_forms.MOE_LOWERINGS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.errors import GraphcError

GROUPS = ("world", "cp", "tp", "ep")
"""Semantic group names that collectives may carry: every rank, the ranks of the rank's replica
that share its tp coordinate (its context-parallel group), the ranks that share its cp coordinate
(its tensor-parallel group), its expert-parallel group."""


@dataclass(frozen=True)
class Topology:
    """How ranks split the work: model.yaml's `topology`, the manifest's, the runtime's (one type)."""

    cp: int = 1
    """Context-parallel ranks per replica: prompt chunks replicated, KV cache sharded by sequence."""
    ep: int = 1
    """Expert-parallel ranks per group, over the whole world; must divide dp * cp * tp and the
    routed experts. Groups inside one replica share its tokens (static MoE); wider ones exchange them."""
    dp: int = 1
    """Data-parallel attention replicas: each serves its own requests (world = dp * cp * tp)."""
    tp: int = 1
    """Tensor-parallel ranks per replica and cp coordinate: attention heads, dense and shared FFN
    widths and the vocabulary split over them; must divide each of those (and V4's o_groups)."""

    def __post_init__(self) -> None:
        # The one place these rules live: model.yaml, manifests and `graphc sweep` build a Topology.
        for key, value in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp), ("ep", self.ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphcError(f"topology.{key}: {value} must be a positive integer")
        if self.world % self.ep:
            raise GraphcError(f"topology.ep: {self.ep} must divide the world size (dp * cp * tp = {self.world}); "
                              f"{self.world} % {self.ep} = {self.world % self.ep}")

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def replica(self) -> int:
        """Ranks of one attention replica (cp * tp)."""
        return self.cp * self.tp

    @property
    def tokens_replicated(self) -> bool:
        """Whether every EP group lies inside one replica, so its ranks hold the same tokens."""
        return self.replica % self.ep == 0

    def group_size(self, group: str) -> int:
        if group not in GROUPS:
            raise GraphcError(f"unknown group {group!r}; groups are {', '.join(GROUPS)}")
        return {"world": self.world, "cp": self.cp, "tp": self.tp, "ep": self.ep}[group]

    def group_ranks(self, group: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group named `group`, in the order of their coordinate in it."""
        if group == "world":
            return list(range(self.world))
        if group == "cp":  # one replica's ranks of `rank`'s tp coordinate: every tp-th
            first = self.dp_rank(rank) * self.replica + self.tp_rank(rank)
            return list(range(first, first + self.replica, self.tp))
        size = self.group_size(group)
        first = rank - rank % size
        return list(range(first, first + size))

    def groups(self, group: str) -> list[list[int]]:
        """Every group named `group`, ordered by its first rank."""
        found: dict[int, list[int]] = {}
        for rank in range(self.world):
            ranks = self.group_ranks(group, rank)
            found.setdefault(ranks[0], ranks)
        return [found[first] for first in sorted(found)]

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        """The attention replica `rank` belongs to."""
        return rank // self.replica

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def replica_leader(self, replica: int) -> int:
        """The rank that samples replica `replica`'s tokens (its first)."""
        return replica * self.replica

    def coordinates(self, rank: int) -> list[int]:
        """The step's `coordinates` input on `rank` (`graphc.step.COORDINATES`: cp rank, ep rank,
        whether it samples: the first rank of each replica). The tp coordinate is not among them:
        a rank's share of the split weights is its weights file, and no op of a step depends on it."""
        return [self.cp_rank(rank), self.ep_rank(rank), int(rank % self.replica == 0)]

    def weight_shard(self, rank: int) -> tuple[int, int]:
        """Which weights file `rank` reads: its (ep rank, tp rank); ranks that share both share it."""
        return self.ep_rank(rank), self.tp_rank(rank)

    def experts(self, rank: int, n_routed_experts: int) -> range:
        """The routed experts `rank` holds."""
        if n_routed_experts % self.ep:
            raise GraphcError(f"topology.ep: {self.ep} must divide the checkpoint's n_routed_experts "
                              f"({n_routed_experts}); {n_routed_experts} % {self.ep} = {n_routed_experts % self.ep}")
        per_rank = n_routed_experts // self.ep
        first = self.ep_rank(rank) * per_rank
        return range(first, first + per_rank)
