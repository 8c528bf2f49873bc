"""inline_int64_kernels: V4.1's n-gram hash becomes int64 ATen ops on export / inductor (same outputs,
bit for bit), and stays an op where neuron lowers it in 32-bit words."""

from __future__ import annotations

import pytest

from graphc.buckets.selection import Bucket
from graphc.passes.inline_int64_kernels import inline_int64_kernels
from graphc.passes.manager import op_counts
from graphc.passes.registry import backend_passes
from graphc.passes.verifier import verify
from passes_support import assert_same_step, context
from support import captured, copy_program


@pytest.mark.parametrize("bucket", [Bucket("decode", 3), Bucket("prefill", 8)])
def test_the_ngram_hash_is_inlined_with_the_same_outputs(tiny_checkpoints, bucket):
    model, program = captured(tiny_checkpoints["v41"], bucket)
    before = copy_program(program)
    engram_layers = len(model.args.engram.layer_ids)
    assert op_counts(program.graph_module)["graphc::ngram_hash"] == engram_layers

    result = inline_int64_kernels(program.graph_module, context(bucket))

    assert result.modified and "graphc::ngram_hash" not in op_counts(result.graph_module)
    assert op_counts(result.graph_module)["aten::bitwise_xor.Tensor"] == engram_layers * (model.args.engram.max_ngram - 1)
    verify(result.graph_module, context(bucket))
    assert_same_step(program, before, model, bucket)
    assert not inline_int64_kernels(result.graph_module, context(bucket)).modified


def test_only_the_backends_that_compute_in_int64_inline_it():
    runs = {backend: "inline_int64_kernels" in dict(backend_passes(backend)) for backend in ("export", "inductor", "neuron")}
    assert runs == {"export": True, "inductor": True, "neuron": False}
