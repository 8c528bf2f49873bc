"""The graph verifier run before and after every pass (invariants in README.md), and the check
that a bucket's programs (the leader's and the followers') issue the same collectives."""

from __future__ import annotations

import torch
import torch.fx

from graphc.errors import GraphcError
from graphc.passes.graph import COLLECTIVE_OPS, collective_sequence, graphc_op, op_argument, step_placeholders
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


def check_program_agreement(graphs: dict[str, torch.fx.GraphModule], bucket_name: str) -> None:
    """Every rank of a bucket must issue the same collectives, in the same order, on the same
    groups with the same shapes, or the job hangs; refuse programs (`graphs` by name: the
    leader's and the followers') that would not."""
    sequences = {name: collective_sequence(gm) for name, gm in graphs.items()}
    (first, expected), *others = sequences.items()
    for name, issued in others:
        if issued != expected:
            raise GraphcError(f"{bucket_name}: the {name} program would issue collectives {issued} but the {first} "
                              f"program {expected}; the ranks would deadlock")
