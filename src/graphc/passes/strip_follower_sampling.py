"""Followers do not sample: the leader samples and sends the tokens with the next step.

On every rank but 0 the step's outputs (tokens, logits) become zeros of the same shapes, so the
signature stays the one every rank is called with, and dead-code elimination then removes the
sampler, the LM head and the final norm from follower graphs.
"""

from __future__ import annotations

import torch
import torch.fx

from graphc.passes.manager import PassContext, PassResult


def strip_follower_sampling(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.rank == 0:
        return PassResult(gm, False)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    replaced = []
    with gm.graph.inserting_before(output):
        for value in output.args[0]:
            fake = value.meta["val"]
            zeros = gm.graph.call_function(torch.ops.aten.zeros.default, (list(fake.shape),),
                                           {"dtype": fake.dtype, "device": fake.device})
            zeros.meta["val"] = fake.new_zeros(fake.shape)
            replaced.append(zeros)
    output.args = (tuple(replaced),)
    return PassResult(gm, True)
