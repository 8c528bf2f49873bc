"""Remove collectives over a group of one rank: they are identities.

On a single rank (or for `ep` = 1), `graphc::moe_dispatch`, `graphc::moe_combine` and
`graphc::attention_combine` move no data; keeping them would make every backend implement a no-op
collective. Each is replaced by its first argument (the rank's own data).
"""

from __future__ import annotations

import torch.fx

from graphc.passes.graph import IDENTITY_AT_ONE_RANK, graphc_op, op_argument
from graphc.passes.manager import PassContext, PassResult


def lower_trivial_collectives(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for node in list(gm.graph.nodes):
        if graphc_op(node) in IDENTITY_AT_ONE_RANK and ctx.topology.group_size(op_argument(node, "group")) == 1:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            modified = True
    return PassResult(gm, modified)
