"""lower_trivial_collectives: collectives over one-rank groups disappear; numerics unchanged."""

from __future__ import annotations

from graphc.buckets.selection import Bucket
from graphc.passes.lower_trivial_collectives import lower_trivial_collectives
from graphc.passes.manager import op_counts
from graphc.passes.verifier import verify
from support import GENERIC_MOE, captured, copy_program
from passes_support import assert_same_step, context

BUCKET = Bucket("decode", 2)


def test_removes_dispatch_and_combine_at_ep_1_and_keeps_outputs(tiny_checkpoints):
    model, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    before = copy_program(program)
    moe_layers = sum(model.args.is_moe_layer(i) for i in range(model.args.num_hidden_layers))
    assert op_counts(program.graph_module)["graphc::moe_dispatch"] == moe_layers == 2

    result = lower_trivial_collectives(program.graph_module, context(BUCKET))

    assert result.modified
    counts = op_counts(result.graph_module)
    assert not {"graphc::moe_dispatch", "graphc::moe_combine", "graphc::attention_combine"} & set(counts)
    assert counts["graphc::kv_write"] == counts["graphc::paged_mla_attention"] == model.args.num_hidden_layers
    verify(result.graph_module, context(BUCKET))
    assert_same_step(program, before, model, BUCKET)


def test_keeps_collectives_of_groups_larger_than_one(tiny_checkpoints):
    """cp = ep = 2: the context-parallel combine and the MoE collectives move data; they stay."""
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    result = lower_trivial_collectives(program.graph_module, context(BUCKET, cp=2, ep=2))
    assert not result.modified
    counts = op_counts(result.graph_module)
    assert counts["graphc::moe_combine"] == 2 and counts["graphc::attention_combine"] == 3
