"""Shared by the pass tests: a pass context (the step programs they run are in support.py)."""

from __future__ import annotations

from graphc.backends import EVERY_RANK
from graphc.buckets.selection import Bucket
from graphc.passes.manager import PassContext
from graphc.topology import Topology
from support import BLOCKS_PER_ROW


def context(bucket: Bucket, cp: int = 1, ep: int = 1, program: str = EVERY_RANK) -> PassContext:
    return PassContext(Topology(cp, ep), program, bucket, BLOCKS_PER_ROW)
