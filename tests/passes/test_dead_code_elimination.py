"""dead_code_elimination: unused nodes go; the KV writes (used by no one, but mutating) stay."""

from __future__ import annotations

import torch

from graphc.buckets.selection import Bucket
from graphc.passes.dead_code_elimination import dead_code_elimination
from graphc.passes.manager import op_counts
from support import captured, copy_program
from passes_support import assert_same_step, context

BUCKET = Bucket("prefill", 8)


def test_removes_an_unused_node_and_keeps_kv_writes(tiny_checkpoints):
    model, program = captured(tiny_checkpoints["direct-q-yarn"], BUCKET)
    before = copy_program(program)
    graph = program.graph_module.graph
    embedding = next(n for n in graph.nodes if n.target == torch.ops.aten.embedding.default)
    with graph.inserting_after(embedding):
        graph.call_function(torch.ops.aten.mul.Tensor, (embedding, 2.0))  # an unused result
    program.graph_module.recompile()
    counts_with_junk = op_counts(program.graph_module)

    result = dead_code_elimination(program.graph_module, context(BUCKET))

    assert result.modified
    counts = op_counts(result.graph_module)
    assert counts["aten::mul.Tensor"] == counts_with_junk["aten::mul.Tensor"] - 1
    assert counts["graphc::kv_write"] == model.args.num_hidden_layers  # no users, but mutates the pool
    for node in result.graph_module.graph.nodes:
        if node.op == "call_function":
            assert node.users or node.is_impure(), node.format_node()
    assert_same_step(program, before, model, BUCKET)


def test_reports_no_change_on_a_clean_graph(tiny_checkpoints):
    _, program = captured(tiny_checkpoints["direct-q-yarn"], BUCKET)
    dead_code_elimination(program.graph_module, context(BUCKET))
    assert not dead_code_elimination(program.graph_module, context(BUCKET)).modified
