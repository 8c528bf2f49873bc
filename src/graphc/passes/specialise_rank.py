"""Give each rank its own numbers: its KV shard in the attention (and in V3.2's indexer and sparse
attention), its experts' combine columns or routes.

Captures carry rank 0's values; only op arguments change here, never a shape, so every rank's
graph has the captured signature.
"""

from __future__ import annotations

import torch.fx

from graphc.passes.graph import graphc_op, op_argument, set_op_argument
from graphc.passes.manager import PassContext, PassResult


def specialise_rank(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    topology, modified = ctx.topology, False
    kv_shard = {"shard": topology.cp_rank(ctx.rank), "num_shards": topology.cp}
    expert_shard = {"shard": topology.ep_rank(ctx.rank), "num_shards": topology.ep}
    wanted = {
        "graphc::paged_mla_attention": kv_shard,
        "graphc::paged_indexer_logits": kv_shard,
        "graphc::index_candidates": kv_shard,
        "graphc::sparse_mla_attention": kv_shard,
        "graphc::expert_shard": expert_shard,
        "graphc::expert_routes": expert_shard,
    }
    for node in gm.graph.nodes:
        for name, value in wanted.get(graphc_op(node), {}).items():
            if op_argument(node, name) != value:
                set_op_argument(node, name, value)
                modified = True
    return PassResult(gm, modified)
