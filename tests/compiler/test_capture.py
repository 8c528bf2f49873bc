"""The model's contract with the compiler: torch.export keeps every graphc:: op as one node.

Later passes find the KV writes, the paged attention and the MoE dispatch/combine by these nodes,
so their count per layer is part of the model's interface.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from graphc.weights.checkpoint import load_model
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata


ROUTED_EXPERT_OPS = {
    "dense": {"graphc::expert_routes": 1},
    "gather": {"graphc::expert_routes": 1},
    "grouped": {"graphc::expert_routes": 1, "graphc::grouped_mm": 2},
}
"""Per MoE layer, the graphc ops of each routed-expert form."""


@pytest.mark.parametrize("preset", ["lora-groups", "direct-q-yarn"])
@pytest.mark.parametrize("moe_form", list(ROUTED_EXPERT_OPS))
def test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager(preset, moe_form, tiny_checkpoints):
    model = load_model(tiny_checkpoints[preset])
    args = model.args
    seq = SequenceBlocks(16)
    seq.reserve(8, BlockAllocator(4))
    inputs = step_metadata([(seq, list(range(3, 11)), 0)], width=8, blocks_per_row=4)
    ids, positions, table, slots, last = inputs
    with torch.no_grad():
        exported = torch.export.export(model, (ids, positions, table, slots, model.new_kv_pool(4, 16), last),
                                       {"moe_form": moe_form})
    counts = Counter(
        node.target.name() for node in exported.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("graphc.")
    )
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers))
    assert counts == {
        "graphc::kv_write": args.num_hidden_layers,
        "graphc::paged_mla_attention": args.num_hidden_layers,
        "graphc::attention_combine": args.num_hidden_layers,
        **{op: n * moe_layers for op, n in ROUTED_EXPERT_OPS[moe_form].items()},
    }
    eager_pool, exported_pool = model.new_kv_pool(4, 16), model.new_kv_pool(4, 16)
    with torch.no_grad():
        expected = model(ids, positions, table, slots, eager_pool, last, moe_form=moe_form)
        actual = exported.module()(ids, positions, table, slots, exported_pool, last, moe_form=moe_form)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(exported_pool, eager_pool, rtol=0, atol=0)
