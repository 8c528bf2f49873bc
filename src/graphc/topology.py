"""Topology: how many ranks, and which semantic group each collective runs over.

All ranks form one attention replica (world = cp). Expert-parallel groups are contiguous blocks
of `ep` ranks; `ep` divides the world.
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
    """Expert-parallel group size."""

    def __post_init__(self) -> None:
        if self.cp < 1 or self.ep < 1:
            raise GraphcError(f"topology: cp ({self.cp}) and ep ({self.ep}) must be >= 1")
        if self.cp % self.ep:
            raise GraphcError(f"topology: ep ({self.ep}) must divide the world (cp = {self.cp}); "
                              f"{self.cp} % {self.ep} = {self.cp % self.ep}")

    @property
    def world(self) -> int:
        return self.cp

    def group_size(self, group: str) -> int:
        if group not in GROUPS:
            raise GraphcError(f"unknown group {group!r}; groups are {', '.join(GROUPS)}")
        return self.ep if group == "ep" else self.cp
