"""Graph helpers every pass shares: finding graphc:: ops, reading and setting their arguments by
schema name, the step's input placeholders, the collectives a graph issues."""

from __future__ import annotations

import torch
import torch.fx

from graphc.step import STEP_INPUTS

IDENTITY_AT_ONE_RANK = ("graphc::moe_dispatch", "graphc::moe_combine", "graphc::attention_combine",
                        "graphc::all_reduce", "graphc::all_reduce_max", "graphc::index_topk_combine",
                        "graphc::gather_columns")
"""Collectives whose value over a group of one rank is their first argument."""

COLLECTIVE_OPS = (*IDENTITY_AT_ONE_RANK, "graphc::moe_a2a_dispatch", "graphc::moe_a2a_combine")
"""Ops that move data between ranks; each names its group in its `group` argument. (The
all-to-all MoE is never captured for a group of one: `moe_forms.moe_exchange` picks `local`.)"""


def graphc_op(node: torch.fx.Node) -> str | None:
    """The `graphc::name` of a graphc custom-op node, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = node.target.name()
    return name if name.startswith("graphc::") else None


def op_argument(node: torch.fx.Node, name: str):
    """A graphc op node's argument by schema name (positional or keyword, else its default)."""
    schema = node.target._schema
    index = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, schema.arguments[index].default_value)


def step_placeholders(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """The per-step input placeholders by name (they follow the weights)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(STEP_INPUTS, placeholders[-len(STEP_INPUTS):]))
