"""Context and expert parallelism in the eager model, on real gloo ranks, equal to one rank (fp32).

CP: every sequence's KV blocks are spread over the ranks (block j on rank j % cp); attention
partials combine exactly by log-sum-exp. EP: each rank holds E / ep routed experts; in the
generic form the EP group's tokens are gathered before routing and reduce-scattered after, in
the static form (tokens already replicated) each rank computes its experts on its own tokens and
the group all-reduces.
"""

from __future__ import annotations

import pytest
import torch

from graphc.topology import Topology
from multirank import greedy_on_rank, run_ranks

pytestmark = pytest.mark.multirank

BLOCK_SIZE, BLOCKS_PER_SHARD, BLOCKS_PER_ROW = 4, 10, 12
PROMPT = [(11 * i) % 250 + 3 for i in range(30)]  # 8 blocks of 4: every shard owns some
CHUNK, DECODE_STEPS = 13, 6


def generate_on_rank(rank: int, topology: Topology, checkpoint: str, static_moe: bool):
    return greedy_on_rank(rank, topology, checkpoint, static_moe, PROMPT, CHUNK, DECODE_STEPS,
                          BLOCK_SIZE, BLOCKS_PER_SHARD, BLOCKS_PER_ROW)


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoints):
    return generate_on_rank(0, Topology(1, 1), str(tiny_checkpoints["wide-16e"]), False)


@pytest.mark.parametrize("cp, ep, static_moe", [
    (2, 1, False), (2, 2, True), (2, 2, False), (4, 2, True), (4, 4, True), (4, 4, False),
])
def test_ranks_give_single_rank_logits_and_tokens(cp, ep, static_moe, tiny_checkpoints, single_rank):
    single_logits, single_tokens = single_rank
    results = run_ranks(Topology(cp, ep), generate_on_rank, str(tiny_checkpoints["wide-16e"]), static_moe)
    for logits, tokens in results:
        assert tokens == single_tokens
        torch.testing.assert_close(logits, single_logits, rtol=1e-5, atol=1e-5)
