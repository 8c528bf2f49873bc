"""The graph verifier run before and after every pass (invariants in README.md)."""

from __future__ import annotations

import torch
import torch.fx

from graphc.passes.graph import COLLECTIVE_OPS, graphc_op, op_argument, step_placeholders
from graphc.passes.manager import GraphInvariantError, PassContext
from graphc.step import POOL_BLOCKS_DIM
from graphc.topology import GROUPS

def verify(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    gm.graph.lint()
    pool_blocks = step_placeholders(gm)["kv_pool"].meta["val"].shape[POOL_BLOCKS_DIM]
    allowed = _symbols(pool_blocks)
    for node in gm.graph.nodes:
        op = graphc_op(node)
        if op in COLLECTIVE_OPS:
            group = op_argument(node, "group")
            if group not in GROUPS:
                raise GraphInvariantError(f"collective group {group!r} is not one of {', '.join(GROUPS)}", node)
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        stray = [d for d, size in enumerate(value.shape) if not _symbols(size) <= allowed]
        if stray:
            raise GraphInvariantError(f"shape {tuple(value.shape)} has symbolic dims {stray} not derived from the "
                                      f"kv_pool block count ({pool_blocks}); every other size must be static", node)


def _symbols(size) -> set:
    """The free symbols of a (possibly symbolic) size; none for an int."""
    return set() if isinstance(size, int) else set(size.node.expr.free_symbols)
