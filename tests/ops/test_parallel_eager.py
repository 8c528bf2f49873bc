"""Context, expert, tensor and data parallelism in the eager model, on real gloo ranks, equal to
one rank (fp32).

CP: every sequence's KV blocks are spread over the ranks (block j on rank j % cp); attention
partials combine exactly by log-sum-exp. EP: each rank holds E / ep routed experts; with the
tokens replicated over the EP group each rank computes its experts on its own tokens and the group
all-reduces (`static`), or the group's tokens are gathered before routing and reduce-scattered
after (`ag_rs`). DP: each replica serves its own prompt, and the MoE exchanges tokens across
replicas (`ag_rs`, `a2a_even`, `a2a_v`). TP: each rank holds 1 / tp of the heads, FFN widths,
embedding columns and vocabulary, its partial sums all-reduced and its slices gathered over tp.
"""

from __future__ import annotations

import pytest
import torch

from graphc.topology import Topology
from multirank import greedy_on_rank, run_ranks
from support import SPARSE_V32

pytestmark = pytest.mark.multirank

BLOCK_SIZE, BLOCKS_PER_SHARD, BLOCKS_PER_ROW = 4, 10, 12
PROMPT = [(11 * i) % 250 + 3 for i in range(30)]  # 8 blocks of 4: every shard owns some
OTHER_PROMPT = [(7 * i + 5) % 250 + 3 for i in range(30)]  # a second replica's, as long (same steps)
CHUNK, DECODE_STEPS = 13, 6


def generate_on_rank(rank: int, topology: Topology, checkpoint: str, moe_exchange: str, prompts: list[list[int]]):
    return greedy_on_rank(rank, topology, checkpoint, moe_exchange, prompts, CHUNK, DECODE_STEPS,
                          BLOCK_SIZE, BLOCKS_PER_SHARD, BLOCKS_PER_ROW)


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoints):
    """One rank's (logits, tokens) for each prompt."""
    return {tuple(p): generate_on_rank(0, Topology(1, 1), str(tiny_checkpoints["wide-16e"]), "local", [p])
            for p in (PROMPT, OTHER_PROMPT)}


def _check_against_single_rank(results, topology, prompts, single_rank):
    for rank, (logits, tokens) in enumerate(results):
        single_logits, single_tokens = single_rank[tuple(prompts[topology.dp_rank(rank)])]
        assert tokens == single_tokens, f"rank {rank}"
        torch.testing.assert_close(logits, single_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp, ep, moe_exchange", [
    (2, 1, "local"), (2, 2, "static"), (2, 2, "ag_rs"), (4, 2, "static"), (4, 4, "static"), (4, 4, "ag_rs"),
])
def test_ranks_give_single_rank_logits_and_tokens(cp, ep, moe_exchange, tiny_checkpoints, single_rank):
    results = run_ranks(Topology(cp, ep), generate_on_rank, str(tiny_checkpoints["wide-16e"]), moe_exchange, [PROMPT])
    _check_against_single_rank(results, Topology(cp, ep), [PROMPT], single_rank)


# Compiled, runtime/test_data_parallel.py serves (2, 1, 2) with every lowering and (2, 2, 4) with auto
# (a2a_v) per commit; these four-rank eager cases are the nightly tier's.
@pytest.mark.parametrize("dp, cp, ep", [pytest.param(4, 1, 4, marks=pytest.mark.slow),
                                        pytest.param(2, 2, 4, marks=pytest.mark.slow)])
def test_data_parallel_replicas_give_single_rank_tokens_with_every_lowering(dp, cp, ep, tiny_checkpoints,
                                                                          single_rank):
    """Each replica its own prompt; the all-to-all lowerings are bit-identical to each other."""
    topology, prompts = Topology(cp, ep, dp), [PROMPT, OTHER_PROMPT] * (dp // 2)
    checkpoint = str(tiny_checkpoints["wide-16e"])
    by_lowering = {lowering: run_ranks(topology, generate_on_rank, checkpoint, lowering, prompts)
                   for lowering in ("ag_rs", "a2a_even", "a2a_v")}
    for results in by_lowering.values():
        _check_against_single_rank(results, topology, prompts, single_rank)
    for (even_logits, _), (v_logits, _) in zip(by_lowering["a2a_even"], by_lowering["a2a_v"]):
        assert torch.equal(even_logits, v_logits)


@pytest.fixture(scope="module")
def single_rank_v4(tiny_checkpoints):
    return generate_on_rank(0, Topology(1, 1), str(tiny_checkpoints["v4"]), "local", [PROMPT])


@pytest.mark.parametrize("cp, ep, moe_exchange", [(2, 1, "local"), (2, 2, "static"), (4, 4, "static")])
def test_v4_ranks_give_single_rank_logits_and_tokens(cp, ep, moe_exchange, tiny_checkpoints, single_rank_v4):
    """DeepSeek-V4 over blocks of 4 spread on the CP ranks: its sliding windows, compressor windows
    (4 and 8 tokens, CSA's overlapping 8) and compressed entries all cross shards."""
    results = run_ranks(Topology(cp, ep), generate_on_rank, str(tiny_checkpoints["v4"]), moe_exchange, [PROMPT])
    _check_against_single_rank(results, Topology(cp, ep), [PROMPT], {tuple(PROMPT): single_rank_v4})


# Per commit: tp with ep at two ranks, and with dp replicas exchanging tokens; cp composed, tp = 4
# and all four axes at 8 ranks in the slow tier.
@pytest.mark.parametrize("dp, cp, tp, ep, moe_exchange", [
    (1, 1, 2, 2, "static"), (2, 1, 2, 4, "a2a_v"),
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in ((1, 2, 2, 4, "static"), (1, 1, 4, 4, "static"), (2, 2, 2, 8, "a2a_even"))),
])
def test_tensor_parallel_ranks_give_single_rank_logits_and_tokens(dp, cp, tp, ep, moe_exchange, tiny_checkpoints,
                                                                   single_rank):
    """Heads, FFN widths, the embedding's columns and the vocabulary split over tp, composed with
    KV blocks over cp, experts over ep and replicas over dp (each replica its own prompt)."""
    topology, prompts = Topology(cp, ep, dp, tp), [PROMPT, OTHER_PROMPT][:dp]
    results = run_ranks(topology, generate_on_rank, str(tiny_checkpoints["wide-16e"]), moe_exchange, prompts)
    _check_against_single_rank(results, topology, prompts, single_rank)


@pytest.mark.parametrize("cp, tp, ep", [(1, 2, 2), pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_v32_indexer_heads_split_over_tp_give_single_rank_tokens(cp, tp, ep, tiny_checkpoints):
    """DeepSeek-V3.2 with the indexer's heads split too: its head-summed scores are all-reduced
    over tp before each shard's top-k (index_topk below the context, so the selection matters)."""
    checkpoint = str(tiny_checkpoints[SPARSE_V32])
    single = generate_on_rank(0, Topology(1, 1), checkpoint, "local", [PROMPT])
    topology = Topology(cp, ep, 1, tp)
    results = run_ranks(topology, generate_on_rank, checkpoint, "static", [PROMPT])
    _check_against_single_rank(results, topology, [PROMPT], {tuple(PROMPT): single})


@pytest.mark.parametrize("cp, tp, ep", [(1, 2, 2), pytest.param(2, 2, 4, marks=pytest.mark.slow)])
def test_v4_heads_and_output_groups_split_over_tp_give_single_rank_tokens(cp, tp, ep, tiny_checkpoints,
                                                                          single_rank_v4):
    """DeepSeek-V4 with its query heads, sinks, output groups, CSA indexer heads and shared experts
    split: the shared K = V head, compressors and mHC streams whole on every rank."""
    topology = Topology(cp, ep, 1, tp)
    results = run_ranks(topology, generate_on_rank, str(tiny_checkpoints["v4"]), "static", [PROMPT])
    _check_against_single_rank(results, topology, [PROMPT], {tuple(PROMPT): single_rank_v4})


@pytest.mark.parametrize("cp, tp, ep", [(1, 2, 2), pytest.param(2, 2, 4, marks=pytest.mark.slow)])
def test_v41_heads_output_groups_and_index_heads_split_over_tp_give_single_rank_tokens(cp, tp, ep, tiny_checkpoints):
    """DeepSeek-V4.1 with V4's split, its index layers' scores all-reduced over tp before the
    candidate blocks and the top-k, Engram tables over ep, the n-gram halo over cp."""
    checkpoint = str(tiny_checkpoints["v41"])
    single = generate_on_rank(0, Topology(1, 1), checkpoint, "local", [PROMPT])
    topology = Topology(cp, ep, 1, tp)
    results = run_ranks(topology, generate_on_rank, checkpoint, "static", [PROMPT])
    _check_against_single_rank(results, topology, [PROMPT], {tuple(PROMPT): single})


def _combine_on_rank(rank: int, topology: Topology, tokens: int):
    """Each cp rank's partial of the same attention (its shard of the keys) combined over the
    group; returns the largest error and the collectives the combine called."""
    from graphc.ops import collectives

    called = []
    gather, reduce = collectives.all_gather_group, torch.distributed.all_reduce
    collectives.all_gather_group = lambda *a, **k: called.append("all_gather") or gather(*a, **k)
    torch.distributed.all_reduce = lambda *a, **k: called.append("all_reduce") or reduce(*a, **k)
    g = torch.Generator().manual_seed(2)
    scores, values = torch.randn(1, tokens, 4, 12, generator=g), torch.randn(1, tokens, 4, 12, 31, generator=g)
    keys = slice(6 * rank, 6 * rank + 6)
    shard = scores[..., keys]
    out = (torch.softmax(shard, -1)[..., None] * values[..., keys, :]).sum(-2)  # [B, Q, H, R]
    combined = collectives.attention_combine(out, torch.logsumexp(shard, -1), "cp")
    full = (torch.softmax(scores, -1)[..., None] * values).sum(-2)
    return (combined - full).abs().max().item(), called


@pytest.mark.parametrize("tokens, calls", [(8, ["all_gather"]), (4096, ["all_reduce", "all_reduce"])])
def test_both_attention_combine_forms_give_the_attention_over_every_ranks_keys(tokens, calls):
    """A small payload's one all-gather and a large one's two all-reduces (`combine_gathers`: 8
    tokens x 4 heads x 32 fp32 over 2 ranks is 8 KiB; 4,096 tokens 4 MiB), on real gloo ranks."""
    for error, called in run_ranks(Topology(2, 1), _combine_on_rank, tokens):
        assert called == calls and error < 1e-5
