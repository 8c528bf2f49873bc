"""Replace a node by the ATen ops of a Python function traced on the node's own inputs: how a
pass swaps an op for another formulation while every new node keeps its `meta["val"]` (which
the verifier, `torch.export.save` and the backends need)."""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from graphc.passes.manager import GraphInvariantError


def _trace(node: torch.fx.Node, function: Callable) -> torch.fx.GraphModule:
    """`function` traced on the node's fake tensor arguments, its other arguments baked in."""
    args = list(node.args)
    tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.fx.Node)]

    def call(*tensors):
        full = list(args)
        for i, t in zip(tensor_positions, tensors):
            full[i] = t
        return function(*full)

    fakes = [args[i].meta["val"] for i in tensor_positions]
    with detect_fake_mode(fakes):
        return make_fx(call, tracing_mode="real")(*fakes)


def inline_function(graph: torch.fx.Graph, node: torch.fx.Node, function: Callable, **meta) -> None:
    """Put the ops of function(*node.args) in the node's place and erase it.

    `meta` is added to every inserted node. Each inlined output records the node it stands for
    (`meta["graphc_replaces"]`), so `graphc probe` can pair it with the captured graph's. A
    node with several outputs must be read only through getitems.
    """
    traced = _trace(node, function)
    env = dict(zip((n for n in traced.graph.nodes if n.op == "placeholder"),
                   (a for a in node.args if isinstance(a, torch.fx.Node))))
    with graph.inserting_before(node):
        for inner in traced.graph.nodes:
            if inner.op == "get_attr":
                raise GraphInvariantError("an inlined function traced to a tensor constant", node)
            if inner.op == "output":
                result = inner.args[0]
            elif inner.op != "placeholder":
                env[inner] = graph.node_copy(inner, lambda n: env[n])
                env[inner].meta.update(meta, stack_trace=node.meta.get("stack_trace"))
    if isinstance(result, torch.fx.Node):  # one output: its users take the inlined value
        env[result].meta["graphc_replaces"] = node.name
        node.replace_all_uses_with(env[result])
    else:  # several: each is read through a getitem
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise GraphInvariantError("op output used other than through getitem", user)
            env[result[user.args[1]]].meta["graphc_replaces"] = user.name
            user.replace_all_uses_with(env[result[user.args[1]]])
            graph.erase_node(user)
    graph.erase_node(node)
