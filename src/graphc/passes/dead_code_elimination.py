"""Remove nodes whose results nobody uses (side-effecting ops such as `graphc::kv_write` stay)."""

from __future__ import annotations

import torch.fx

from graphc.passes.manager import PassContext, PassResult


def dead_code_elimination(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    # FX keeps impure nodes: placeholders, outputs, and ops whose schema mutates an argument.
    return PassResult(gm, gm.graph.eliminate_dead_code())
