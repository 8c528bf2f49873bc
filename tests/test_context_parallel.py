"""Context parallelism on real gloo ranks: the KV cache sharded by block, attention partials
combined by log-sum-exp, equal to one rank (fp32)."""

from __future__ import annotations

import pytest
import torch

from graphc.models.checkpoint import load_model
from graphc.paged import BlockAllocator, SequenceBlocks, step_metadata
from graphc.topology import Topology
from multirank import run_ranks

BLOCK_SIZE, BLOCKS_PER_SHARD, BLOCKS_PER_ROW = 4, 10, 12
PROMPT = [(11 * i) % 250 + 3 for i in range(30)]  # 8 blocks of 4: every shard owns some
CHUNK, DECODE_STEPS = 13, 6


def generate_on_shard(rank: int, topology: Topology, checkpoint: str) -> tuple[torch.Tensor, list[int]]:
    """Chunked prefill then greedy decode on `rank`'s shard; every rank runs the same host logic
    (as the leader would) and keeps only its own blocks. Returns (logits per step, tokens)."""
    model = load_model(checkpoint)
    shards = topology.cp
    pool = model.new_kv_pool(BLOCKS_PER_SHARD, BLOCK_SIZE)
    allocators = [BlockAllocator(BLOCKS_PER_SHARD) for _ in range(shards)]
    seq = SequenceBlocks(BLOCK_SIZE, num_shards=shards)
    seq.reserve(len(PROMPT) + DECODE_STEPS, allocators)
    logits, tokens = [], []

    def step(run, start):
        ids, positions, table, slots, last = step_metadata([(seq, run, start)], len(run), BLOCKS_PER_ROW, shard=rank)
        with torch.no_grad():
            return model(ids, positions, table, slots, pool, last, shard=rank, num_shards=shards)[0]

    for start in range(0, len(PROMPT), CHUNK):
        out = step(PROMPT[start : start + CHUNK], start)
    for i in range(DECODE_STEPS):
        logits.append(out)
        tokens.append(int(out.argmax()))
        out = step([tokens[-1]], len(PROMPT) + i)
    return torch.stack(logits), tokens


@pytest.mark.parametrize("cp", [2, 4])
def test_sharded_kv_cache_gives_single_rank_logits_and_tokens(cp, tiny_checkpoints):
    checkpoint = str(tiny_checkpoints["lora-groups"])
    single_logits, single_tokens = generate_on_shard(0, Topology(1, 1), checkpoint)
    for logits, tokens in run_ranks(Topology(cp, 1), generate_on_shard, checkpoint):
        assert tokens == single_tokens
        torch.testing.assert_close(logits, single_logits, rtol=1e-5, atol=1e-5)
