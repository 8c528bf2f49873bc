"""Shared by the pass tests: a pass context (the step programs they run are in support.py)."""

from __future__ import annotations

from graphc.buckets.selection import Bucket
from graphc.passes.manager import PassContext
from graphc.topology import Topology
from support import BLOCKS_PER_ROW


def context(bucket: Bucket, cp: int = 1, ep: int = 1, leader: bool = True) -> PassContext:
    return PassContext(Topology(cp, ep), leader, bucket, BLOCKS_PER_ROW)
