"""Move each `graphc::dequantize` node right before the first node that reads its output.

Capture dequantises every weight kept as stored at the top of the step (the step graph does so
before it calls the model), so in capture order every dequantised weight is live from the first
op to its reader: on the export backend, which runs the graph op by op and frees a value after
its last use, a step would hold the whole model in the compute dtype beside its stored copy.
Placed next to its reader, a dequantised weight lives from just before its matmul to its last
use (one layer's weights at a time), and inlined (`inline_reference_kernels`) its ops sit where
the compilers fuse them into that reader. Moving a node whose inputs are placeholders changes no
value; the order of every other node is kept.
"""

from __future__ import annotations

import torch.fx

from graphc.passes.graph import graphc_op
from graphc.passes.manager import PassContext, PassResult


def place_dequantization(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    modified = False
    for node in [n for n in gm.graph.nodes if graphc_op(n) == "graphc::dequantize" and n.users]:
        reader = min(node.users, key=order.__getitem__)
        if node.next is not reader:
            reader.prepend(node)
            modified = True
    return PassResult(gm, modified)
