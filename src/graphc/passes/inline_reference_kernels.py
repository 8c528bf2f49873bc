"""Replace the paged attention ops (dense, and V3.2's indexer, top-k candidates and sparse attention)
and the expert-shard and expert-routes ops with the ATen ops of their reference kernels.

For the CPU backends a custom op is a Python kernel: called from an AOTInductor package it costs
a round trip into the interpreter per layer per step, and inductor cannot fuse across it. Inlined,
the attention compiles like the rest of the graph (halving a decode step of the tiny model).
Targets with their own kernels (Neuron) skip this pass and lower the op to that kernel instead.

`graphc::grouped_mm` stays an op: its kernel is ATen's own `_grouped_mm` (see moe_ops.py).
`graphc::kv_write` stays an op on purpose: inlined, its in-place write into the `kv_pool` input
is functionalised into a copy of the whole pool per layer per step (measured: a decode step
twice as slow on the tiny model, and proportional to the pool on a real one), while the opaque
mutating op is re-inplaced.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from graphc.moe_ops import expert_routes_reference
from graphc.ops import expert_shard_reference, paged_mla_attention_reference
from graphc.sparse_ops import (index_candidates_reference, paged_indexer_logits_reference,
                               sparse_mla_attention_reference)
from graphc.passes.manager import GraphInvariantError, PassContext, PassResult
from graphc.passes.verifier import graphc_op

REFERENCE_KERNELS = {
    "graphc::paged_mla_attention": paged_mla_attention_reference,
    "graphc::paged_indexer_logits": paged_indexer_logits_reference,
    "graphc::index_candidates": index_candidates_reference,
    "graphc::sparse_mla_attention": sparse_mla_attention_reference,
    # A column slice of the combine matrix, or a renumbering of the routes, once the rank's shard
    # is set: no reason to leave Python.
    "graphc::expert_shard": expert_shard_reference,
    "graphc::expert_routes": expert_routes_reference,
}


def _trace_reference(node: torch.fx.Node, kernel) -> torch.fx.GraphModule:
    """The kernel traced on the node's fake inputs, its non-tensor arguments baked in."""
    args = list(node.args)
    tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.fx.Node)]

    def call(*tensors):
        full = list(args)
        for i, t in zip(tensor_positions, tensors):
            full[i] = t
        return kernel(*full)

    fakes = [args[i].meta["val"] for i in tensor_positions]
    with detect_fake_mode(fakes):
        return make_fx(call, tracing_mode="real")(*fakes)


def inline_reference_kernels(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    graph, modified = gm.graph, False
    for node in list(graph.nodes):
        kernel = REFERENCE_KERNELS.get(graphc_op(node))
        if kernel is None:
            continue
        traced = _trace_reference(node, kernel)
        env = dict(zip((n for n in traced.graph.nodes if n.op == "placeholder"),
                       (a for a in node.args if isinstance(a, torch.fx.Node))))
        with graph.inserting_before(node):
            for inner in traced.graph.nodes:
                if inner.op == "get_attr":
                    raise GraphInvariantError("a reference kernel traced to a tensor constant", node)
                if inner.op == "output":
                    result = inner.args[0]
                elif inner.op != "placeholder":
                    env[inner] = graph.node_copy(inner, lambda n: env[n])
                    # Where the inlined ops came from, for `graphc probe` and graph dumps.
                    env[inner].meta.update(graphc_inlined_from=graphc_op(node), stack_trace=node.meta.get("stack_trace"))
        # Each inlined output records the node it stands for, so `graphc probe` can pair it with
        # the captured graph's.
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
        modified = True
    return PassResult(gm, modified)
