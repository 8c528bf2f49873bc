"""Replace a node by the ATen ops of a Python function traced on the node's own inputs: how a
pass swaps an op for another formulation while every new node keeps its `meta["val"]` (which
the verifier, `torch.export.save` and the backends need)."""

from __future__ import annotations

import operator
import weakref
from typing import Callable, Hashable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from graphc.passes.manager import GraphInvariantError


_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per graph being rewritten: the traces made so far, by function and signature. A program calls
the same op with the same shapes once a layer: traced once, inlined every time (`graph.node_copy`
copies each node and its meta, leaving the trace as it was). Keyed by the graph, which no trace
refers to, so an entry goes with its graph (a trace's fake tensors refer to their fake mode)."""


def _signature(value) -> Hashable:
    """What a trace depends on in one argument: a tensor's shape, stride and dtype (a size as its
    expression where the capture left it symbolic: equal expressions, equal sizes); any other
    value itself."""
    if isinstance(value, torch.fx.Node):
        fake = value.meta["val"]
        if not isinstance(fake, torch.Tensor):
            return ("symbol", str(fake))
        return ("tensor", tuple(map(str, fake.shape)), tuple(map(str, fake.stride())), fake.dtype, str(fake.device))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_signature, value))
    return ("value", type(value).__name__, value)  # the type too: True == 1, and both hash alike


def _trace(graph: torch.fx.Graph, node: torch.fx.Node, function: Callable) -> torch.fx.GraphModule:
    """`function` traced on the node's fake tensor arguments, its other arguments baked in; once
    per graph for each function and signature."""
    args = list(node.args)
    tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.fx.Node)]
    fakes = [args[i].meta["val"] for i in tensor_positions]
    fake_mode = detect_fake_mode(fakes)
    key = (function, tuple(_signature(a) for a in args))
    traces = _TRACED.setdefault(graph, {})
    if key not in traces:

        def call(*tensors):
            full = list(args)
            for i, t in zip(tensor_positions, tensors):
                full[i] = t
            return function(*full)

        with fake_mode:
            traces[key] = make_fx(call, tracing_mode="real")(*fakes)
    return traces[key]


def inline_function(graph: torch.fx.Graph, node: torch.fx.Node, function: Callable, **meta) -> None:
    """Put the ops of function(*node.args) in the node's place and erase it.

    `meta` is added to every inserted node. Each inlined output records the node it stands for
    (`meta["graphc_replaces"]`), so `graphc probe` can pair it with the captured graph's. A
    node with several outputs must be read only through getitems.
    """
    traced = _trace(graph, node, function)
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
