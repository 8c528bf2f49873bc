"""graphc:: ops of the paged KV cache: the KV write and MLA attention over a row's blocks, with
the helpers DeepSeek Sparse Attention's ops share (a shard's block table, its keys, their positions).

Shape letters: B rows (sequences) of a step, Q query tokens per row, H heads, R latent width,
P rope width, C = R + P cached width, L layers, N pool blocks, S block size, M blocks per row,
T tokens, D hidden size, V vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.library import Shard, define_op, shard_number
from graphc.step import ceil_div


def kv_write_reference(kv_pool: Tensor, layer: int, kv: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's cached vector into its slot of the paged pool (the kernel of
    `graphc::kv_write`, which stays an op on every backend: see `passes/inline_reference_kernels.py`).

    Args:
        kv_pool: [L, N, S, C] the whole pool; slot s of layer l is `kv_pool[l].view(-1, C)[s]`.
        layer: which layer's cache to write.
        kv: [B, Q, C] the tokens' latent ++ roped key.
        slot_mapping: [B, Q] flat slot per token; a negative slot leaves the pool untouched
            (`PADDING_SLOT`, or `ELSEWHERE_SLOT`: a token whose block lives on another rank).
    """
    width = kv_pool.shape[-1]
    slots = slot_mapping.reshape(-1)  # [B*Q]
    real = slots >= 0
    kv_pool[layer].view(-1, width)[slots[real]] = kv.reshape(-1, width)[real].to(kv_pool.dtype)


kv_write = define_op(
    "kv_write(Tensor(a!) kv_pool, int layer, Tensor kv, Tensor slot_mapping) -> ()",
    kv_write_reference,
    lambda kv_pool, layer, kv, slot_mapping: None,
)


def context_block_table(block_table: Tensor, positions: Tensor, block_size: int, shard: Shard = 0,
                        num_shards: int = 1) -> Tensor:
    """This shard's columns of the block table, with every entry past its row's context replaced by
    block 0, so whatever the table holds there (stale ids, garbage) never indexes the pool.

    A row's context is positions 0..max(positions[b]); under context parallelism local column i is
    the row's logical block i * num_shards + shard. Keys read through the replaced entries are
    masked by the caller's causal mask (they sit past every query's position). A kernel with
    dynamic loop bounds would skip those blocks; a static-shape graph reads a fixed number and
    makes them harmless instead.

    Args:
        block_table: [B, M] pool block of each row's logical blocks (this shard's, when sharded).
        positions: [B, Q] absolute position of each query token.
        block_size: S, tokens per pool block.
        shard, num_shards: this rank's place in the context-parallel group.

    Returns:
        [B, ceil(M / num_shards)] pool block ids, each a block of the row's context or 0.
    """
    local_blocks = ceil_div(block_table.shape[1], num_shards)
    logical = torch.arange(local_blocks, device=block_table.device) * num_shards + shard_number(shard)  # [M']
    context_end = positions.amax(dim=1, keepdim=True)  # [B, 1] the row's last position
    holds_context = logical[None, :] * block_size <= context_end  # [B, M']
    return torch.where(holds_context, block_table[:, :local_blocks], 0)


def read_context_keys(kv_pool: Tensor, layer: int, block_table: Tensor, positions: Tensor, shard: Shard = 0,
                      num_shards: int = 1, dims: slice = slice(None)) -> tuple[Tensor, Tensor]:
    """`dims` of every cached vector of this shard's blocks of each row's context, in logical order
    (only those dims are gathered: the indexer reads its 128 of DeepSeek-V3.2's 704).

    Returns:
        keys: [B, K, C'] in the pool dtype, K = ceil(M / num_shards) * S; slots past the context
            hold block 0's vectors (mask them with `key_positions`).
        key_positions: [K] the absolute position of each local key.
    """
    block_size = kv_pool.shape[2]
    table = context_block_table(block_table, positions, block_size, shard, num_shards)  # [B, M']
    cached = kv_pool[layer, :, :, dims]  # [N, S, C']
    keys = cached[table].reshape(table.shape[0], -1, cached.shape[-1])  # [B, K, C']
    return keys, shard_key_positions(keys.shape[1], block_size, shard, num_shards, keys.device)


def shard_key_positions(count: int, block_size: int, shard: Shard, num_shards: int, device=None) -> Tensor:
    """[count] the absolute position of each of a shard's local keys, in local order."""
    local = torch.arange(count, device=device)
    # Local key k sits in the row's logical block (k // S) * num_shards + shard.
    return ((local // block_size) * num_shards + shard_number(shard)) * block_size + local % block_size


def paged_mla_attention_reference(
    q_latent: Tensor,
    q_rope: Tensor,
    kv_pool: Tensor,
    layer: int,
    block_table: Tensor,
    positions: Tensor,
    softmax_scale: float,
    shard: Shard = 0,
    num_shards: int = 1,
) -> tuple[Tensor, Tensor]:
    """Absorbed multi-head latent attention of each row's queries over that row's paged cache.

    Plain torch ops: the kernel of `graphc::paged_mla_attention`, and what CPU backends inline in
    its place (`passes/inline_reference_kernels.py`).

    A query at position p sees the row's cached tokens at positions 0..p (causal); the cache must
    already hold them (`kv_write` runs first). Scores and softmax are fp32.

    With the cache sharded across `num_shards` context-parallel ranks, a row's logical block j
    lives on shard j % num_shards, and this shard's block table lists only its own blocks, in
    order: the result is the attention over this shard's keys, and (out, lse) of all shards
    combine exactly (`attention_combine`). A query that sees none of this shard's keys gets
    out = 0 and lse = -inf, which the combination weighs to nothing.

    Args:
        q_latent: [B, Q, H, R] queries projected into the latent space (q_nope @ W_uk).
        q_rope: [B, Q, H, P] roped query part.
        kv_pool: [L, N, S, C] the paged pool.
        layer: which layer's cache to read.
        block_table: [B, M] pool block of each row's i-th S positions (of this shard's blocks
            when sharded; only the first ceil(M / num_shards) columns are read, and only those
            holding the row's context are dereferenced: `context_block_table`).
        positions: [B, Q] absolute position of each query.
        softmax_scale: multiplier of the scores before softmax.
        shard, num_shards: this rank's place in the context-parallel group.

    Returns:
        out: [B, Q, H, R] softmax-weighted latent, in the query dtype.
        lse: [B, Q, H] fp32 log-sum-exp of the scaled scores, so partial attentions over disjoint
            key sets can be combined exactly.
    """
    latent_dim, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
    keys, key_positions = read_context_keys(kv_pool, layer, block_table, positions, shard, num_shards,
                                            slice(0, latent_dim + rope_dim))
    keys = keys.float()  # [B, K, R + P]
    latent, k_rope = keys[..., :latent_dim], keys[..., latent_dim:]  # [B, K, R], [B, K, P]
    scores = torch.einsum("bqhr,bkr->bqhk", q_latent.float(), latent)  # [B, Q, H, K]
    scores = scores + torch.einsum("bqhp,bkp->bqhk", q_rope.float(), k_rope)
    scores = scores * softmax_scale
    visible = key_positions[None, None, None, :] <= positions[:, :, None, None]  # [B, Q, 1, K]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Q, H]; -inf where no key of this shard is visible
    probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])  # [B, Q, H, K]; 0 where none
    out = torch.einsum("bqhk,bkr->bqhr", probs, latent)  # [B, Q, H, R]
    return out.to(q_latent.dtype).contiguous(), lse.contiguous()


paged_mla_attention = define_op(
    "paged_mla_attention(Tensor q_latent, Tensor q_rope, Tensor kv_pool, int layer, Tensor block_table, "
    "Tensor positions, float softmax_scale, Tensor? shard=None, int num_shards=1) -> (Tensor, Tensor)",
    paged_mla_attention_reference,
    lambda q_latent, q_rope, kv_pool, layer, block_table, positions, softmax_scale, shard=None, num_shards=1: (
        q_latent.new_empty(q_latent.shape), q_latent.new_empty(q_latent.shape[:-1], dtype=torch.float32)),
)
