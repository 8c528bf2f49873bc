"""Shared by the pass tests: a pass context, and a step run before and after a rewrite (the step
programs they run are in support.py)."""

from __future__ import annotations

import torch

from graphc.buckets.selection import Bucket
from graphc.passes.manager import PassContext
from graphc.topology import Topology
from support import BLOCKS_PER_ROW, run_program


def context(bucket: Bucket, cp: int = 1, ep: int = 1) -> PassContext:
    return PassContext(Topology(cp, ep), bucket, BLOCKS_PER_ROW)


def assert_same_step(program, before, model, bucket: Bucket) -> None:
    """The rewritten `program` gives `before`'s tokens, logits and written pool, bit for bit."""
    (tokens, logits), pool = run_program(program, model, bucket)
    (tokens_before, logits_before), pool_before = run_program(before, model, bucket)
    assert torch.equal(tokens, tokens_before)
    assert torch.equal(logits, logits_before) and torch.equal(pool, pool_before)
