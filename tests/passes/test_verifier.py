"""The verifier's check that a bucket's programs (the leader's and the followers') issue the same
collectives: a followers' program that would skip one is refused before anything compiles."""

from __future__ import annotations

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket
from graphc.errors import GraphcError
from graphc.models.checkpoint import load_expert_shard
from graphc.models.deepseek_v3 import Parallelism
from graphc.passes.graph import graphc_op
from graphc.passes.strip_follower_sampling import strip_follower_sampling
from graphc.passes.verifier import check_program_agreement
from graphc.topology import Topology
from passes_support import context
from support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS, copy_program

BUCKET = Bucket("decode", 2)


def test_programs_issuing_the_same_collectives_agree_and_one_that_skips_one_is_refused(tiny_checkpoints):
    model = load_expert_shard(tiny_checkpoints["lora-groups"], Topology(2, 2), 0, torch.float32)
    leader = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE,
                            Parallelism(cp=2, ep=2, moe_exchange="static"))
    followers = copy_program(leader)
    strip_follower_sampling(followers.graph_module, context(BUCKET, 2, 2, "followers"))
    check_program_agreement({"leader": leader.graph_module, "followers": followers.graph_module}, BUCKET.name)
    reduce = next(n for n in followers.graph.nodes if graphc_op(n) == "graphc::all_reduce")
    reduce.replace_all_uses_with(reduce.args[0])
    followers.graph.erase_node(reduce)
    with pytest.raises(GraphcError, match=r"decode-2: the followers program would issue collectives .* but the "
                                          r"leader program .*; the ranks would deadlock"):
        check_program_agreement({"leader": leader.graph_module, "followers": followers.graph_module}, BUCKET.name)
