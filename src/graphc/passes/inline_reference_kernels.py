"""Replace the paged attention ops (dense, and V3.2's indexer, top-k candidates and sparse attention),
the expert-shard and expert-routes ops and the dequantisation of weights kept as stored with the
ATen ops of their reference kernels.

For the CPU backends a custom op is a Python kernel: called from an AOTInductor package it costs
a round trip into the interpreter per layer per step, and inductor cannot fuse across it. Inlined,
the attention compiles like the rest of the graph (halving a decode step of the tiny model).
The neuron backend runs it too: its XLA lowering covers core ATen, so the inlined ops need no
rules of their own (NKI attention kernels in their place are future work).

`graphc::grouped_mm` stays an op: its kernel is ATen's own `_grouped_mm` (see ops/moe.py).
`graphc::kv_write` stays an op on purpose: inlined, its in-place write into the `kv_pool` input
is functionalised into a copy of the whole pool per layer per step (measured: a decode step
twice as slow on the tiny model, and proportional to the pool on a real one), while the opaque
mutating op is re-inplaced.
"""

from __future__ import annotations

import torch.fx

from graphc.ops.dequantize import dequantize_reference
from graphc.ops.moe import expert_routes_reference
from graphc.ops.paged_attention import paged_mla_attention_reference
from graphc.ops.sparse import (index_candidates_reference, paged_indexer_logits_reference,
                               sparse_mla_attention_reference)
from graphc.passes.graph import graphc_op
from graphc.passes.inline import inline_function
from graphc.passes.manager import PassContext, PassResult

REFERENCE_KERNELS = {
    "graphc::paged_mla_attention": paged_mla_attention_reference,
    "graphc::paged_indexer_logits": paged_indexer_logits_reference,
    "graphc::index_candidates": index_candidates_reference,
    "graphc::sparse_mla_attention": sparse_mla_attention_reference,
    # A renumbering of the routes by the rank's coordinates: no reason to leave Python.
    "graphc::expert_routes": expert_routes_reference,
    # Elementwise scaling of a weight kept as stored: fused into the op that reads it.
    "graphc::dequantize": dequantize_reference,
}


def inline_kernels(gm: torch.fx.GraphModule, kernels: dict) -> PassResult:
    """Replace each call of an op named in `kernels` (graphc op name -> kernel) by its kernel's ATen ops."""
    modified = False
    for node in list(gm.graph.nodes):
        kernel = kernels.get(graphc_op(node))
        if kernel is not None:
            # Where the inlined ops came from, for `graphc probe` and graph dumps.
            inline_function(gm.graph, node, kernel, graphc_inlined_from=graphc_op(node))
            modified = True
    return PassResult(gm, modified)


def inline_reference_kernels(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return inline_kernels(gm, REFERENCE_KERNELS)
