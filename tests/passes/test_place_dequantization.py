"""place_dequantization: each weight kept as stored is dequantised right before its first reader
instead of at the top of the step; every other node keeps its order; the outputs are unchanged."""

from __future__ import annotations

import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket
from graphc.weights.checkpoint import load_model
from graphc.passes.graph import graphc_op
from graphc.passes.place_dequantization import place_dequantization
from graphc.passes.verifier import verify
from support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS, copy_program
from passes_support import assert_same_step, context

BUCKET = Bucket("decode", 2)


def _dequantizations(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if graphc_op(n) == "graphc::dequantize"]


def test_moves_each_dequantisation_next_to_its_first_reader_and_keeps_outputs(fp8_checkpoints):
    model = load_model(fp8_checkpoints["lora-groups"], as_stored=True)
    program = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE)
    before = copy_program(program)
    gm = program.graph_module
    nodes = list(gm.graph.nodes)
    # As captured, the step dequantises every weight before the model's first op (the embedding).
    assert len(_dequantizations(gm)) == len(model.quantized_weights)
    embedding = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.embedding.default)
    assert all(nodes.index(n) < embedding for n in _dequantizations(gm))
    others = [n.name for n in nodes if graphc_op(n) != "graphc::dequantize"]

    result = place_dequantization(gm, context(BUCKET))

    assert result.modified
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in _dequantizations(gm):
        assert node.next is min(node.users, key=order.__getitem__)
    assert [n.name for n in gm.graph.nodes if graphc_op(n) != "graphc::dequantize"] == others
    verify(gm, context(BUCKET))
    assert_same_step(program, before, model, BUCKET)
    assert not place_dequantization(gm, context(BUCKET)).modified  # placed already: nothing to move


def test_leaves_a_step_without_weights_kept_as_stored_alone(fp8_checkpoints):
    model = load_model(fp8_checkpoints["lora-groups"])  # dequantised on load
    program = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE)
    names = [n.name for n in program.graph.nodes]
    assert not place_dequantization(program.graph_module, context(BUCKET)).modified
    assert [n.name for n in program.graph.nodes] == names
