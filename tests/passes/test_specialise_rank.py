"""specialise_rank: each rank's graph computes that rank's eager model (its KV shard, its experts);
rank 0's graph is left as captured."""

from __future__ import annotations

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import StepGraph, capture_bucket
from graphc.models.checkpoint import load_expert_shard, load_model
from graphc.models.deepseek_v3 import Parallelism
from graphc.passes.graph import graphc_op, op_argument
from graphc.passes.manager import PassContext
from graphc.passes.specialise_rank import specialise_rank
from graphc.passes.verifier import verify
from graphc.topology import Topology
from support import SPARSE_V32
from passes_support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS, copy_program, run_program, run_step

BUCKET = Bucket("decode", 2)
TOPOLOGY = Topology(cp=2, ep=2)
KV_OPS = {"graphc::paged_mla_attention", "graphc::paged_indexer_logits", "graphc::index_candidates",
          "graphc::sparse_mla_attention"}
EXPERT_OPS = {"graphc::expert_shard", "graphc::expert_routes"}


def _shard_and_capture(checkpoint, rank: int, form: str):
    """Rank `rank`'s expert shard, captured as `graphc compile` captures it (with rank 0's numbers)."""
    model = load_expert_shard(checkpoint, TOPOLOGY, rank, torch.float32)
    parallel = Parallelism(cp=TOPOLOGY.cp, ep=TOPOLOGY.ep, tokens_replicated=True)
    return model, capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE, parallel, form)


def _shards(gm) -> dict[str, set[tuple[int, int]]]:
    found: dict[str, set[tuple[int, int]]] = {}
    for node in gm.graph.nodes:
        if graphc_op(node) in KV_OPS | EXPERT_OPS:
            found.setdefault(graphc_op(node), set()).add((op_argument(node, "shard"), op_argument(node, "num_shards")))
    return found


@pytest.mark.parametrize("form", ["dense", "gather"])
@pytest.mark.parametrize("rank", [1, 3])
def test_a_ranks_graph_computes_its_eager_model(tiny_checkpoints, rank, form):
    """On one device (collectives are the identity) the specialised graph of `rank` equals the
    eager model given that rank's numbers, and the captured graph (rank 0's numbers) does not."""
    model, program = _shard_and_capture(tiny_checkpoints["lora-groups"], rank, form)
    captured = copy_program(program)
    ctx = PassContext(TOPOLOGY, rank, BUCKET, BLOCKS_PER_ROW)

    result = specialise_rank(program.graph_module, ctx)

    assert result.modified
    kv, experts = (TOPOLOGY.cp_rank(rank), TOPOLOGY.cp), (TOPOLOGY.ep_rank(rank), TOPOLOGY.ep)
    shards = _shards(result.graph_module)
    assert shards["graphc::paged_mla_attention"] == {kv}
    assert shards["graphc::expert_shard" if form == "dense" else "graphc::expert_routes"] == {experts}
    verify(result.graph_module, ctx)
    eager = StepGraph(model, Parallelism(TOPOLOGY.cp_rank(rank), TOPOLOGY.cp, TOPOLOGY.ep_rank(rank), TOPOLOGY.ep,
                                         tokens_replicated=True), form)
    (_, logits), pool = run_program(program, model, BUCKET)
    (_, expected), expected_pool = run_step(eager, model, BUCKET)
    (_, rank0_logits), _ = run_program(captured, model, BUCKET)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (pool - expected_pool).abs().max() == 0
    assert (rank0_logits - expected).abs().max() > 1e-3 * expected.abs().max()


def test_rank_0_and_one_rank_topologies_are_left_as_captured(tiny_checkpoints):
    _, program = _shard_and_capture(tiny_checkpoints["lora-groups"], 0, "gather")
    assert not specialise_rank(program.graph_module, PassContext(TOPOLOGY, 0, BUCKET, BLOCKS_PER_ROW)).modified
    model = load_model(tiny_checkpoints["lora-groups"])
    single = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE)
    assert not specialise_rank(single.graph_module, PassContext(Topology(1, 1), 0, BUCKET, BLOCKS_PER_ROW)).modified


def test_sets_the_kv_shard_of_sparse_attention_ops(tiny_checkpoints):
    """V3.2: the indexer and sparse attention read the rank's KV shard too."""
    model = load_model(tiny_checkpoints[SPARSE_V32])
    program = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE, Parallelism(cp=2))
    result = specialise_rank(program.graph_module, PassContext(Topology(2, 1), 1, BUCKET, BLOCKS_PER_ROW))
    shards = _shards(result.graph_module)
    assert set(shards) >= KV_OPS - {"graphc::paged_mla_attention"}
    assert all(shards[op] == {(1, 2)} for op in KV_OPS & set(shards))
