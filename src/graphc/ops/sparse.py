"""graphc:: ops of DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer's logits over
the paged cache, the top-k selection (global across a context-parallel group), and sparse MLA
with the production kernel's numerics.

A query's selection is the list of the absolute positions of its top-k keys, ordered by score
(descending) with ties going to the lower position, padded with -1 when fewer keys are visible.
That total order is what makes the selection the same at every CP degree: each rank's local
top-k holds every key of that rank that is in the global top-k, and the CP combine re-sorts the
gathered candidates by the same order.

Shape letters as in `graphc.ops.paged_attention`, plus: I indexer heads, J indexer head width, K keys of this
shard, k selected keys per query.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.collectives import all_gather_group
from graphc.ops.distributed import process_group
from graphc.ops.library import Shard, define_op, shard_number
from graphc.ops.paged_attention import context_block_table, read_context_keys, shard_key_positions
from graphc.step import ceil_div

NO_KEY = -1
"""A selection slot that holds no key (fewer visible keys than k)."""

KERNEL_KEY_BLOCK = 64
"""Selected keys per online-softmax block, as in FlashMLA's sparse decode/prefill kernels."""


def paged_indexer_logits_reference(
    q_index: Tensor,
    head_weights: Tensor,
    kv_pool: Tensor,
    layer: int,
    block_table: Tensor,
    positions: Tensor,
    key_offset: int,
    softmax_scale: float,
    shard: Shard = 0,
    num_shards: int = 1,
) -> Tensor:
    """The indexer's score of every visible key of this shard, read through the block table.

    score[b, q, k] = sum_i head_weights[b, q, i] * relu(softmax_scale * q_index[b, q, i] . key[b, k]),
    in fp32 (transformers' formulation of DeepSeek's indexer, without the FP8 quantisation of the
    released kernel). Only blocks holding the row's context are dereferenced
    (`paged_attention.context_block_table`); keys past the query's position score -inf.

    Args:
        q_index: [B, Q, I, J] roped indexer queries.
        head_weights: [B, Q, I] fp32 per-head weights (already scaled by I ** -0.5).
        kv_pool: [L, N, S, C] the paged pool; the indexer key is dims key_offset.. of each slot.
        layer: which layer's cache to read.
        block_table, positions, shard, num_shards: as for `paged_attention.paged_mla_attention`.
        key_offset: where the indexer key starts in a cached vector.
        softmax_scale: J ** -0.5.

    Returns:
        [B, Q, K] fp32 scores of this shard's keys, -inf where not visible.
    """
    index_keys, key_positions = read_context_keys(kv_pool, layer, block_table, positions, shard, num_shards,
                                                  slice(key_offset, None))
    index_keys = index_keys.float()  # [B, K, J]
    scores = torch.einsum("bqij,bkj->bqik", q_index.float(), index_keys) * softmax_scale  # [B, Q, I, K]
    logits = torch.einsum("bqik,bqi->bqk", torch.relu(scores), head_weights.float())  # [B, Q, K]
    visible = key_positions[None, None, :] <= positions[:, :, None]  # [B, Q, K]
    return logits.masked_fill(~visible, float("-inf")).contiguous()


paged_indexer_logits = define_op(
    "paged_indexer_logits(Tensor q_index, Tensor head_weights, Tensor kv_pool, int layer, Tensor block_table, "
    "Tensor positions, int key_offset, float softmax_scale, Tensor? shard=None, int num_shards=1) -> Tensor",
    paged_indexer_logits_reference,
    lambda q_index, head_weights, kv_pool, layer, block_table, positions, key_offset, softmax_scale, shard=None,
    num_shards=1: q_index.new_empty(
        (*q_index.shape[:2], ceil_div(block_table.shape[1], num_shards) * kv_pool.shape[2]), dtype=torch.float32),
)


def top_by_score(positions: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best candidates along the last dim, by score descending, ties to the lower position.

    Candidates must come in ascending position order (NO_KEY last): the stable sort then keeps
    equal scores in that order. Candidates scoring -inf become NO_KEY.
    """
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, Q, k]
    top_scores = scores.gather(-1, order)
    top_positions = positions.gather(-1, order).masked_fill(top_scores == float("-inf"), NO_KEY)
    return top_positions.contiguous(), top_scores.contiguous()


def index_candidates_reference(logits: Tensor, k: int, block_size: int, shard: Shard = 0,
                               num_shards: int = 1) -> tuple[Tensor, Tensor]:
    """This shard's top-k keys of each query: its candidates for the global top-k.

    Args:
        logits: [B, Q, K] indexer scores of this shard's keys (-inf: not visible).
        k: keys to select.
        block_size: S, to turn local key indices into absolute positions.
        shard, num_shards: this rank's place in the context-parallel group.

    Returns:
        positions: [B, Q, k] int64 absolute positions (NO_KEY padding), best first.
        scores: [B, Q, k] fp32 their scores (-inf for NO_KEY).
    """
    rows, queries, local = logits.shape
    key_positions = shard_key_positions(local, block_size, shard, num_shards, logits.device)  # [K], ascending
    if local < k:  # a shard may hold fewer keys than are selected
        pad = logits.new_full((rows, queries, k - local), float("-inf"))
        logits = torch.cat([logits, pad], dim=-1)  # [B, Q, k]
        key_positions = torch.cat([key_positions, key_positions.new_full((k - local,), NO_KEY)])
    return top_by_score(key_positions.expand(rows, queries, -1), logits, k)


index_candidates = define_op(
    "index_candidates(Tensor logits, int k, int block_size, Tensor? shard=None, int num_shards=1) -> (Tensor, Tensor)",
    index_candidates_reference,
    lambda logits, k, block_size, shard=None, num_shards=1: (
        logits.new_empty((*logits.shape[:2], k), dtype=torch.int64), logits.new_empty((*logits.shape[:2], k))),
)


def _index_topk_combine(positions: Tensor, scores: Tensor, group: str) -> Tensor:
    """The global top-k of a context-parallel `group` from every rank's candidates.

    On one rank (group of one) the candidates are the answer; the collective is removed by
    `lower_trivial_collectives`.

    Args:
        positions: [B, Q, k] this rank's candidates (`index_candidates`).
        scores: [B, Q, k] their scores.
        group: semantic group name ("cp").

    Returns:
        [B, Q, k] int64 the group's best k positions, best first (NO_KEY padding).
    """
    pg = process_group(group)
    if pg is None:
        return positions.clone(memory_format=torch.contiguous_format)
    k = positions.shape[-1]
    candidates = all_gather_group(positions, pg).permute(1, 2, 0, 3).flatten(2)  # [B, Q, G*k]
    candidate_scores = all_gather_group(scores, pg).permute(1, 2, 0, 3).flatten(2)  # [B, Q, G*k]
    # Ascending position first (NO_KEY last), so the score sort breaks ties as one rank does.
    by_position = candidates.masked_fill(candidates == NO_KEY, torch.iinfo(torch.int64).max).argsort(dim=-1)
    return top_by_score(candidates.gather(-1, by_position), candidate_scores.gather(-1, by_position), k)[0]


index_topk_combine = define_op(
    "index_topk_combine(Tensor positions, Tensor scores, str group) -> Tensor", _index_topk_combine,
    lambda positions, scores, group: positions.new_empty(positions.shape),
)


def sparse_mla_attention_reference(
    q_latent: Tensor,
    q_rope: Tensor,
    kv_pool: Tensor,
    layer: int,
    block_table: Tensor,
    positions: Tensor,
    selected: Tensor,
    softmax_scale: float,
    bf16_probabilities: bool,
    shard: Shard = 0,
    num_shards: int = 1,
) -> tuple[Tensor, Tensor]:
    """Absorbed MLA of each query over its selected keys, as FlashMLA's sparse kernel computes it
    (one function on purpose: its body is the kernel's loop, in the kernel's order).

    The selected keys are visited in the order given, KERNEL_KEY_BLOCK at a time, with an online
    softmax: per block, m' = max(m, max s), p = exp(s - m') in fp32, l = l * exp(m - m') + sum(p),
    acc = acc * exp(m - m') + P @ V. With `bf16_probabilities` P is rounded to bf16 before P @ V
    (products of bf16 values accumulated in fp32) while l sums the unrounded p, as the kernel does;
    without it P stays fp32 (the public reference's numerics). out = acc / l, lse = m + log(l).

    Under context parallelism each shard attends over the selected keys it holds and returns its
    (out, lse) partial; `collectives.attention_combine` merges them exactly as for dense MLA.

    Args:
        q_latent, q_rope, kv_pool, layer, block_table, positions, softmax_scale, shard, num_shards:
            as for `paged_attention.paged_mla_attention`.
        selected: [B, Q, k] absolute positions of each query's keys (NO_KEY: none); a position
            past the query's own or on another shard contributes nothing.
        bf16_probabilities: round P to bf16 for the P @ V product.

    Returns:
        out: [B, Q, H, R] in the query dtype (0 where this shard holds none of the keys).
        lse: [B, Q, H] fp32 (-inf where this shard holds none of the keys).
    """
    block_size = kv_pool.shape[2]
    latent_dim, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
    rows, queries, k = selected.shape
    block = selected // block_size  # [B, Q, k] logical block of each selected key
    here = (selected != NO_KEY) & (selected <= positions[..., None]) & (block % num_shards == shard_number(shard))
    table = context_block_table(block_table, positions, block_size, shard, num_shards)  # [B, M']
    column = torch.where(here, block // num_shards, 0).view(rows, -1)  # [B, Q*k]
    pool_block = table.gather(1, column).view(rows, queries, k)  # [B, Q, k]
    slots = torch.where(here, pool_block * block_size + selected % block_size, 0)  # [B, Q, k]
    keys = kv_pool[layer, :, :, : latent_dim + rope_dim].reshape(-1, latent_dim + rope_dim)[slots].float()
    latent, k_rope = keys[..., :latent_dim], keys[..., latent_dim:]  # [B, Q, k, R], [B, Q, k, P]
    scores = torch.einsum("bqhr,bqkr->bqhk", q_latent.float(), latent)  # [B, Q, H, k]
    scores = (scores + torch.einsum("bqhp,bqkp->bqhk", q_rope.float(), k_rope)) * softmax_scale
    scores = scores.masked_fill(~here[:, :, None, :], float("-inf"))

    running_max = scores.new_full(scores.shape[:-1], float("-inf"))  # [B, Q, H]
    denominator = scores.new_zeros(scores.shape[:-1])  # [B, Q, H]
    acc = scores.new_zeros((*scores.shape[:-1], latent_dim))  # [B, Q, H, R]
    for start in range(0, k, KERNEL_KEY_BLOCK):
        block_scores = scores[..., start : start + KERNEL_KEY_BLOCK]  # [B, Q, H, 64]
        new_max = torch.maximum(running_max, block_scores.amax(dim=-1))
        finite_max = torch.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: p = 0
        p = torch.exp(block_scores - finite_max[..., None])  # [B, Q, H, 64] fp32
        rescale = torch.exp(running_max - finite_max)  # [B, Q, H]
        denominator = denominator * rescale + p.sum(dim=-1)
        weights = p.to(torch.bfloat16).float() if bf16_probabilities else p
        values = latent[:, :, start : start + KERNEL_KEY_BLOCK]  # [B, Q, 64, R]
        acc = acc * rescale[..., None] + torch.einsum("bqhk,bqkr->bqhr", weights, values)
        running_max = new_max
    seen = denominator > 0
    out = torch.where(seen[..., None], acc / torch.where(seen, denominator, 1.0)[..., None], 0.0)
    lse = torch.where(seen, running_max + torch.log(torch.where(seen, denominator, 1.0)), float("-inf"))
    return out.to(q_latent.dtype).contiguous(), lse.contiguous()


sparse_mla_attention = define_op(
    "sparse_mla_attention(Tensor q_latent, Tensor q_rope, Tensor kv_pool, int layer, Tensor block_table, "
    "Tensor positions, Tensor selected, float softmax_scale, bool bf16_probabilities, Tensor? shard=None, "
    "int num_shards=1) -> (Tensor, Tensor)",
    sparse_mla_attention_reference,
    lambda q_latent, q_rope, kv_pool, layer, block_table, positions, selected, softmax_scale, bf16_probabilities,
    shard=None, num_shards=1: (q_latent.new_empty(q_latent.shape),
                            q_latent.new_empty(q_latent.shape[:-1], dtype=torch.float32)),
)
