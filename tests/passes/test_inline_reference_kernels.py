"""inline_reference_kernels: the paged attention becomes ATen ops; KV writes stay ops; same outputs."""

from __future__ import annotations

import operator

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.passes.inline_reference_kernels import inline_reference_kernels
from graphc.passes.manager import op_counts
from graphc.passes.verifier import verify
from support import GENERIC_MOE, captured, copy_program
from passes_support import assert_same_step, context


@pytest.mark.parametrize("bucket", [Bucket("decode", 3), Bucket("prefill", 8)])
def test_replaces_every_attention_and_keeps_outputs(tiny_checkpoints, bucket):
    model, program = captured(tiny_checkpoints["yarn-mscale"], bucket)
    before = copy_program(program)
    layers = model.args.num_hidden_layers
    assert op_counts(program.graph_module)["graphc::paged_mla_attention"] == layers

    result = inline_reference_kernels(program.graph_module, context(bucket))

    assert result.modified
    counts = op_counts(result.graph_module)
    assert "graphc::paged_mla_attention" not in counts
    assert counts["graphc::kv_write"] == layers  # stays an op: see the pass docstring
    assert counts["aten::logsumexp"] == layers  # one softmax normaliser per inlined attention
    # Each KV write still precedes the attention ops that read its layer's cache.
    order = {node: i for i, node in enumerate(result.graph_module.graph.nodes)}
    writes = [n for n in order if n.op == "call_function" and n.target == torch.ops.graphc.kv_write.default]
    softmaxes = [n for n in order if n.op == "call_function" and n.target == torch.ops.aten.logsumexp.default]
    assert all(order[w] < order[s] for w, s in zip(writes, softmaxes))
    assert not any(n.target is operator.getitem and n.args[0] not in order for n in order if n.op == "call_function")
    verify(result.graph_module, context(bucket))

    assert_same_step(program, before, model, bucket)


def test_leaves_kv_writes_grouped_gemms_and_collectives_alone(tiny_checkpoints):
    """What it must not inline: the KV write, the grouped GEMM (ATen's meta refuses fp32) and every
    collective; on an already inlined graph it finds nothing."""
    bucket = Bucket("prefill", 8)  # rows x K above the experts: the grouped form
    _, program = captured(tiny_checkpoints["lora-groups"], bucket, GENERIC_MOE)
    ctx = context(bucket, cp=2, ep=2)
    kept = ("graphc::kv_write", "graphc::grouped_mm", "graphc::moe_dispatch", "graphc::moe_combine",
            "graphc::attention_combine")
    before = op_counts(program.graph_module)
    assert all(before.get(op) for op in kept)

    inline_reference_kernels(program.graph_module, ctx)
    after = op_counts(program.graph_module)

    assert {op: after.get(op) for op in kept} == {op: before[op] for op in kept}
    assert not inline_reference_kernels(program.graph_module, ctx).modified
