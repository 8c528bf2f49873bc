"""The rank's coordinates are a step input: one captured program serves every rank, and run with a
rank's coordinates it computes that rank's eager model (its KV shard, its experts)."""

from __future__ import annotations

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket, weight_names
from graphc.compiler.emit import program_digest
from graphc.weights.checkpoint import load_rank_shard, load_model
from graphc.models.step_model import Parallelism
from graphc.topology import Topology
from support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS, SPARSE_V32, run_program, run_step

BUCKET = Bucket("decode", 2)
TOPOLOGY = Topology(cp=2, ep=2)


class EagerModel(torch.nn.Module):
    """The model called directly with one rank's numbers as plain ints (no coordinates input)."""

    def __init__(self, model, parallel: Parallelism, moe_form: str | None):
        super().__init__()
        self.model, self.parallel, self.moe_form = [model], parallel, moe_form

    def forward(self, weights, input_ids, positions, block_table, slot_mapping, kv_pool, logits_index, *_):
        logits = torch.func.functional_call(
            self.model[0], dict(zip(weight_names(self.model[0]), weights)),
            (input_ids, positions, block_table, slot_mapping, kv_pool, logits_index),
            {"parallel": self.parallel, "moe_form": self.moe_form})
        return None, logits


def _capture(model, form: str | None = None, topology: Topology = TOPOLOGY):
    parallel = Parallelism(cp=topology.cp, ep=topology.ep, moe_exchange="static" if topology.ep > 1 else "local")
    return capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE, parallel, form)


@pytest.mark.parametrize("form", ["dense", "gather", "grouped"])
def test_one_program_serves_every_rank_with_its_coordinates(tiny_checkpoints, form):
    """The programs captured from different ranks' expert shards are the same program (same
    content digest, so one compiled file); each, fed rank r's coordinates, equals the eager model
    given rank r's numbers, and differs from it fed another rank's."""
    checkpoint = tiny_checkpoints["lora-groups"]
    shards = {rank: load_rank_shard(checkpoint, TOPOLOGY, rank, torch.float32) for rank in (0, 1)}
    programs = {rank: _capture(model, form) for rank, model in shards.items()}
    assert program_digest(programs[0]) == program_digest(programs[1])
    model, program = shards[1], programs[1]
    coordinates = tuple(TOPOLOGY.coordinates(1))
    eager = EagerModel(model, Parallelism(*coordinates[:1], TOPOLOGY.cp, coordinates[1], TOPOLOGY.ep,
                                          moe_exchange="static"), form)
    (_, expected), expected_pool = run_step(eager, model, BUCKET)
    (_, logits), pool = run_program(program, model, BUCKET, coordinates=coordinates)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(pool, expected_pool)
    (_, other), _ = run_program(program, model, BUCKET, coordinates=(0, 0, 0))
    assert (other - expected).abs().max() > 1e-3 * expected.abs().max()


def test_sparse_attention_reads_the_kv_shard_of_its_coordinates(tiny_checkpoints):
    """V3.2: the indexer, its top-k candidates and the sparse attention take the KV shard from the
    coordinates too."""
    model = load_model(tiny_checkpoints[SPARSE_V32])
    topology = Topology(2, 1)
    program = _capture(model, topology=topology)
    eager = EagerModel(model, Parallelism(1, 2), None)
    (_, expected), _ = run_step(eager, model, BUCKET)
    (_, logits), _ = run_program(program, model, BUCKET, coordinates=(1, 0, 0))
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    (_, other), _ = run_program(program, model, BUCKET, coordinates=(0, 0, 0))
    assert (other - expected).abs().max() > 1e-3 * expected.abs().max()
