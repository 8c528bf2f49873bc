"""Followers do not sample: the leader samples and sends the tokens with the next step.

In the followers' program (every rank but 0, on a backend that compiles the sampler into the
graph: `Backend.follower_programs`) the sampler is replaced by zeros of its shape, so the signature stays the one
every rank is called with. The logits stay: they keep the last layer live, and with it that
layer's collectives, which every rank must issue in the same order (dropping them on followers
alone would deadlock the group).
"""

from __future__ import annotations

import torch
import torch.fx

from graphc.backends import FOLLOWERS
from graphc.passes.graph import graphc_op
from graphc.passes.manager import PassContext, PassResult


def strip_follower_sampling(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.program != FOLLOWERS:
        return PassResult(gm, False)
    modified = False
    for node in list(gm.graph.nodes):
        if graphc_op(node) != "graphc::sample":
            continue
        fake = node.meta["val"]
        with gm.graph.inserting_before(node):
            zeros = gm.graph.call_function(torch.ops.aten.zeros.default, (list(fake.shape),),
                                           {"dtype": fake.dtype, "device": fake.device})
        zeros.meta["val"] = fake.new_zeros(fake.shape)
        node.replace_all_uses_with(zeros)
        gm.graph.erase_node(node)
        modified = True
    return PassResult(gm, modified)
