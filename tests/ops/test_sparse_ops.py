"""DeepSeek Sparse Attention's kernels (graphc.ops.sparse) against independent implementations.

- sparse MLA, fp32-P mode: equal (1e-5) to a plain softmax over each query's selected keys, in
  float64 with no blocking;
- sparse MLA, bf16-P mode: equal (1e-5) to the kernel's recurrence written out key block by key
  block for one query and head at a time, and different from fp32-P only by the documented
  rounding: |out_bf16 - out_fp32| <= 2**-8 * sum(p |v|) / sum(p) (bf16's unit roundoff on each p);
- the indexer's logits equal transformers' formula over the unpaged keys;
- the top-k selection orders by score, breaks ties to the lower position, pads with NO_KEY;
- a block table filled past the context with out-of-range ids gives identical results, no errors.
"""

from __future__ import annotations

import pytest
import torch

from graphc.ops.paged_attention import paged_mla_attention_reference
from graphc.ops.sparse import (KERNEL_KEY_BLOCK, NO_KEY, index_candidates_reference, paged_indexer_logits_reference,
                               sparse_mla_attention_reference)

ROWS, QUERIES, HEADS, LATENT, ROPE, INDEX_DIM, INDEX_HEADS = 2, 3, 4, 16, 8, 12, 5
BLOCK, POOL_BLOCKS, TABLE_WIDTH = 16, 24, 12
SCALE = 0.2


@pytest.fixture(scope="module")
def setup():
    """A pool whose rows own scattered blocks; queries at the end of contexts of 170 and 90 tokens."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1, POOL_BLOCKS, BLOCK, LATENT + ROPE + INDEX_DIM, generator=g)
    table = torch.stack([torch.randperm(POOL_BLOCKS, generator=g)[:TABLE_WIDTH] for _ in range(ROWS)])
    positions = torch.tensor([[167, 168, 169], [87, 88, 89]])
    q_latent = torch.randn(ROWS, QUERIES, HEADS, LATENT, generator=g)
    q_rope = torch.randn(ROWS, QUERIES, HEADS, ROPE, generator=g)
    # 150 selected keys per query (3 kernel blocks: 64, 64, 22), in a shuffled order; the short
    # row's queries see only 88..90 keys, the rest of their slots are NO_KEY.
    selected = torch.full((ROWS, QUERIES, 150), NO_KEY)
    for b in range(ROWS):
        for q in range(QUERIES):
            visible = int(positions[b, q]) + 1
            chosen = torch.randperm(visible, generator=g)[:150]
            selected[b, q, : len(chosen)] = chosen
    return pool, table, positions, q_latent, q_rope, selected


def _selected_keys(pool, table, b, q, selected):
    """float64 latent and rope keys of one query's selected positions (read without the pool's paging helpers)."""
    positions = [p for p in selected[b, q].tolist() if p != NO_KEY]
    slots = [int(table[b, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]
    keys = pool[0].reshape(-1, pool.shape[-1])[slots].double()
    return keys[:, :LATENT], keys[:, LATENT : LATENT + ROPE]


def test_fp32_probabilities_equal_a_plain_softmax_over_the_selected_keys(setup):
    pool, table, positions, q_latent, q_rope, selected = setup
    out, lse = sparse_mla_attention_reference(q_latent, q_rope, pool, 0, table, positions, selected, SCALE, False)
    for b in range(ROWS):
        for q in range(QUERIES):
            latent, rope = _selected_keys(pool, table, b, q, selected)
            scores = (q_latent[b, q].double() @ latent.T + q_rope[b, q].double() @ rope.T) * SCALE  # [H, k]
            torch.testing.assert_close(out[b, q].double(), scores.softmax(-1) @ latent, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[b, q].double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


def _kernel_recurrence(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """FlashMLA's sparse recurrence for one query and head, key block by key block: running max m,
    p = exp(s - m) in fp32, P rounded to bf16 for P @ V, the denominator over unrounded p."""
    m, l, acc = float("-inf"), torch.tensor(0.0), torch.zeros(values.shape[-1])
    for start in range(0, len(scores), KERNEL_KEY_BLOCK):
        s, v = scores[start : start + KERNEL_KEY_BLOCK], values[start : start + KERNEL_KEY_BLOCK]
        new_m = max(m, float(s.max()))
        p = torch.exp(s - new_m)
        alpha = torch.exp(torch.tensor(m - new_m))
        l = l * alpha + p.sum()
        acc = acc * alpha + (p.to(torch.bfloat16).float()[:, None] * v).sum(0)
        m = new_m
    return acc / l


def test_bf16_probabilities_follow_the_kernel_and_differ_only_by_rounding(setup, report):
    pool, table, positions, q_latent, q_rope, selected = setup
    rounded, _ = sparse_mla_attention_reference(q_latent, q_rope, pool, 0, table, positions, selected, SCALE, True)
    exact, _ = sparse_mla_attention_reference(q_latent, q_rope, pool, 0, table, positions, selected, SCALE, False)
    worst_ratio = 0.0
    for b in range(ROWS):
        for q in range(QUERIES):
            latent, rope = (t.float() for t in _selected_keys(pool, table, b, q, selected))
            scores = (q_latent[b, q] @ latent.T + q_rope[b, q] @ rope.T) * SCALE  # [H, k] fp32
            for h in range(HEADS):
                torch.testing.assert_close(rounded[b, q, h], _kernel_recurrence(scores[h], latent), rtol=1e-5,
                                           atol=1e-5)
            p = scores.double().softmax(-1)  # [H, k]
            bound = 2.0**-8 * (p @ latent.double().abs())  # [H, R]
            difference = (rounded[b, q] - exact[b, q]).double().abs()
            assert (difference <= bound + 1e-6).all()
            worst_ratio = max(worst_ratio, float((difference / bound).max()))
    assert (rounded != exact).any()  # the rounding happened
    report(f"sparse MLA bf16-P vs fp32-P: largest difference {worst_ratio:.2f} of the documented bound "
           "2^-8 * sum(p|v|)/sum(p)")


def test_indexer_logits_equal_the_transformers_formula(setup):
    pool, table, positions, *_ = setup
    g = torch.Generator().manual_seed(1)
    q = torch.randn(ROWS, QUERIES, INDEX_HEADS, INDEX_DIM, generator=g)
    weights = torch.randn(ROWS, QUERIES, INDEX_HEADS, generator=g)
    offset, scale = LATENT + ROPE, INDEX_DIM**-0.5
    logits = paged_indexer_logits_reference(q, weights, pool, 0, table, positions, offset, scale)
    assert logits.shape == (ROWS, QUERIES, TABLE_WIDTH * BLOCK)
    for b in range(ROWS):
        keys = pool[0][table[b]].reshape(-1, pool.shape[-1])[:, offset:]  # [K, J] in position order
        # transformers: relu(q . k * scale), weighed per head and summed, -inf past the query.
        scores = torch.relu(torch.einsum("qij,kj->qik", q[b], keys) * scale)
        expected = torch.einsum("qi,qik->qk", weights[b], scores)
        causal = torch.arange(keys.shape[0])[None, :] <= positions[b][:, None]
        expected = expected.masked_fill(~causal, float("-inf"))
        torch.testing.assert_close(logits[b], expected, rtol=1e-5, atol=1e-5)


def test_top_k_orders_by_score_breaks_ties_low_and_pads():
    logits = torch.tensor([[[0.5, 2.0, 0.5, 3.0, float("-inf"), 0.5]]])  # keys at positions 0..5
    positions, scores = index_candidates_reference(logits, 4, block_size=8)
    assert positions.tolist() == [[[3, 1, 0, 2]]]  # the three 0.5s tie: lowest positions first
    assert scores.tolist() == [[[3.0, 2.0, 0.5, 0.5]]]
    positions, _ = index_candidates_reference(logits, 8, block_size=8)  # more than the visible 5
    assert positions.tolist() == [[[3, 1, 0, 2, 5, NO_KEY, NO_KEY, NO_KEY]]]


def test_top_k_maps_a_shards_keys_to_their_positions():
    # Shard 1 of 2, blocks of 2: its local keys 0..3 are positions 2, 3, 6, 7.
    logits = torch.tensor([[[1.0, 4.0, 3.0, 2.0]]])
    positions, _ = index_candidates_reference(logits, 3, block_size=2, shard=1, num_shards=2)
    assert positions.tolist() == [[[3, 6, 7]]]


def test_block_table_past_the_context_is_never_dereferenced(setup):
    pool, table, positions, q_latent, q_rope, selected = setup
    garbage = table.clone()
    for b in range(ROWS):
        used = -(-(int(positions[b].max()) + 1) // BLOCK)  # blocks holding the context
        garbage[b, used:] = torch.tensor([10**9, -7, POOL_BLOCKS, -1, 2**40, 123456])[: TABLE_WIDTH - used]
    assert (garbage != table).any()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(ROWS, QUERIES, INDEX_HEADS, INDEX_DIM, generator=g)
    weights = torch.randn(ROWS, QUERIES, INDEX_HEADS, generator=g)

    def outputs(block_table):
        return [
            *paged_mla_attention_reference(q_latent, q_rope, pool, 0, block_table, positions, SCALE),
            paged_indexer_logits_reference(q, weights, pool, 0, block_table, positions, LATENT + ROPE,
                                           INDEX_DIM**-0.5),
            *sparse_mla_attention_reference(q_latent, q_rope, pool, 0, block_table, positions, selected, SCALE, True),
        ]

    for dirty, clean in zip(outputs(garbage), outputs(table)):
        assert torch.equal(dirty, clean)
