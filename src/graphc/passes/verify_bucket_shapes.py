"""Check that a captured step's inputs have exactly its bucket's shapes; changes nothing."""

from __future__ import annotations

import torch.fx

from graphc.capture import POOL_BLOCKS_DIM
from graphc.passes.manager import GraphInvariantError, PassContext, PassResult
from graphc.passes.verifier import step_placeholders


def expected_step_shapes(ctx: PassContext) -> dict[str, tuple[int, ...]]:
    rows, width = ctx.bucket.rows, ctx.bucket.width
    per_row = (rows,)
    return {
        "input_ids": (rows, width),
        "positions": (rows, width),
        "block_table": (rows, ctx.blocks_per_row),
        "slot_mapping": (rows, width),
        "logits_index": per_row,
        "temperature": per_row,
        "top_k": per_row,
        "top_p": per_row,
        "seed": per_row,
    }


def verify_bucket_shapes(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    inputs = step_placeholders(gm)
    for name, shape in expected_step_shapes(ctx).items():
        actual = tuple(inputs[name].meta["val"].shape)
        if actual != shape:
            raise GraphInvariantError(f"{name} has shape {actual}, bucket {ctx.bucket.name} needs {shape}", inputs[name])
    pool = inputs["kv_pool"].meta["val"]
    if pool.dim() != 4 or isinstance(pool.shape[POOL_BLOCKS_DIM], int):
        raise GraphInvariantError(f"kv_pool must be [L, N, S, C] with a symbolic N, got {tuple(pool.shape)}",
                                  inputs["kv_pool"])
    return PassResult(gm, modified=False)
