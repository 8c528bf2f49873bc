"""Check that a captured step's inputs have exactly its bucket's shapes; changes nothing."""

from __future__ import annotations

import torch.fx

from graphc.passes.graph import step_placeholders
from graphc.passes.manager import GraphInvariantError, PassContext, PassResult
from graphc.step import POOL_BLOCKS_DIM, step_shapes


def verify_bucket_shapes(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    inputs = step_placeholders(gm)
    for name, shape in step_shapes(ctx.bucket.rows, ctx.bucket.width, ctx.blocks_per_row).items():
        actual = tuple(inputs[name].meta["val"].shape)
        if actual != shape:
            raise GraphInvariantError(f"{name} has shape {actual}, bucket {ctx.bucket.name} needs {shape}", inputs[name])
    pool = inputs["kv_pool"].meta["val"]
    if pool.dim() != 4 or isinstance(pool.shape[POOL_BLOCKS_DIM], int):
        raise GraphInvariantError(f"kv_pool must be [L, N, S, C] with a symbolic N, got {tuple(pool.shape)}",
                                  inputs["kv_pool"])
    return PassResult(gm, modified=False)
