"""graphc:: custom ops: the places where parallel execution differs from one device.

Each op is defined from an explicit schema in the `graphc` library, with a real kernel and a fake
one, so `torch.export` keeps it as one `call_function` node (string and int arguments intact)
that topology passes can find and rewrite. (`torch.library.custom_op` would infer the schemas,
but its Python autograd wrapper costs about 35 us per call: most of a KV write on the CPU.)
The real kernels here are the single-device semantics; collectives carry a *semantic* group name
("cp", "ep", "world"), never a rank list.

Every op returns contiguous tensors, from its real kernel and its fake alike: compilers trust the
fake's strides, and a real output laid out differently is read as garbage (seen with AOTInductor
when a fake used `empty_like` of a permuted input).

Shape letters: B rows (sequences) of a step, Q query tokens per row, H heads, R latent width,
P rope width, C = R + P cached width, L layers, N pool blocks, S block size, M blocks per row,
T tokens, D hidden size, V vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.distributed import process_group

PADDING_SLOT = -1
"""Slot-mapping value of a padding token: its KV is not written."""

_LIBRARY = torch.library.Library("graphc", "DEF")


def define_op(schema: str, kernel, fake):
    """Register `graphc::<schema>` with its kernel (all devices) and fake; return the op."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphc::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.graphc, name)


def kv_write_reference(kv_pool: Tensor, layer: int, kv: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's cached vector into its slot of the paged pool (the kernel of
    `graphc::kv_write`, which stays an op on every backend: see `passes/inline_reference_kernels.py`).

    Args:
        kv_pool: [L, N, S, C] the whole pool; slot s of layer l is `kv_pool[l].view(-1, C)[s]`.
        layer: which layer's cache to write.
        kv: [B, Q, C] the tokens' latent ++ roped key.
        slot_mapping: [B, Q] flat slot per token; `PADDING_SLOT` leaves the pool untouched (padding,
            or, under context parallelism, a token whose block lives on another rank).
    """
    width = kv_pool.shape[-1]
    slots = slot_mapping.reshape(-1)  # [B*Q]
    real = slots != PADDING_SLOT
    kv_pool[layer].view(-1, width)[slots[real]] = kv.reshape(-1, width)[real].to(kv_pool.dtype)


kv_write = define_op(
    "kv_write(Tensor(a!) kv_pool, int layer, Tensor kv, Tensor slot_mapping) -> ()",
    kv_write_reference,
    lambda kv_pool, layer, kv, slot_mapping: None,
)


def context_block_table(block_table: Tensor, positions: Tensor, block_size: int, shard: int = 0,
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
    local_blocks = -(-block_table.shape[1] // num_shards)
    logical = torch.arange(local_blocks, device=block_table.device) * num_shards + shard  # [M']
    context_end = positions.amax(dim=1, keepdim=True)  # [B, 1] the row's last position
    holds_context = logical[None, :] * block_size <= context_end  # [B, M']
    return torch.where(holds_context, block_table[:, :local_blocks], 0)


def read_context_keys(kv_pool: Tensor, layer: int, block_table: Tensor, positions: Tensor, shard: int = 0,
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


def shard_key_positions(count: int, block_size: int, shard: int, num_shards: int, device=None) -> Tensor:
    """[count] the absolute position of each of a shard's local keys, in local order."""
    local = torch.arange(count, device=device)
    # Local key k sits in the row's logical block (k // S) * num_shards + shard.
    return ((local // block_size) * num_shards + shard) * block_size + local % block_size


def paged_mla_attention_reference(
    q_latent: Tensor,
    q_rope: Tensor,
    kv_pool: Tensor,
    layer: int,
    block_table: Tensor,
    positions: Tensor,
    softmax_scale: float,
    shard: int = 0,
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
    "Tensor positions, float softmax_scale, int shard=0, int num_shards=1) -> (Tensor, Tensor)",
    paged_mla_attention_reference,
    lambda q_latent, q_rope, kv_pool, layer, block_table, positions, softmax_scale, shard=0, num_shards=1: (
        q_latent.new_empty(q_latent.shape), q_latent.new_empty(q_latent.shape[:-1], dtype=torch.float32)),
)


def all_gather_group(tensor: Tensor, pg) -> Tensor:
    """[G, *tensor.shape]: every rank's tensor, in rank order."""
    gathered = tensor.new_empty((pg.size() * tensor.shape[0], *tensor.shape[1:]))
    torch.distributed.all_gather_single(gathered, tensor.contiguous(), group=pg)
    return gathered.view(pg.size(), *tensor.shape)


def _attention_combine(out: Tensor, lse: Tensor, group: str) -> Tensor:
    """Combine the partial attentions of a context-parallel `group` exactly.

    Each rank attended over its own shard of the keys; with L = logsumexp over ranks of lse,
    the full attention is sum over ranks of exp(lse_r - L) * out_r. On one device the identity.

    Args:
        out: [B, Q, H, R] this rank's partial output.
        lse: [B, Q, H] fp32 log-sum-exp of this rank's scores (-inf where it saw no key).
        group: semantic group name ("cp").

    Returns:
        [B, Q, H, R] the attention over every rank's keys, in out's dtype.
    """
    pg = process_group(group)
    if pg is None:
        return out.clone(memory_format=torch.contiguous_format)
    outs, lses = (all_gather_group(t, pg) for t in (out, lse))  # [G, B, Q, H, R], [G, B, Q, H]
    weights = torch.exp(lses - torch.logsumexp(lses, dim=0))  # [G, B, Q, H]; position 0 is always seen
    return (weights[..., None] * outs.float()).sum(dim=0).to(out.dtype).contiguous()


attention_combine = define_op("attention_combine(Tensor out, Tensor lse, str group) -> Tensor", _attention_combine,
                            lambda out, lse, group: out.new_empty(out.shape))


def _moe_dispatch(hidden: Tensor, group: str, group_size: int = 1) -> Tensor:
    """Bring every token of the expert-parallel `group` to this rank before routing.

    Captured with group_size 1 (the identity); the expert-sharding pass sets the group's size,
    and the static-MoE rewrite removes the op where the tokens are already replicated.

    Args:
        hidden: [T, D] this rank's tokens.
        group: semantic group name ("ep").
        group_size: ranks in the group.

    Returns:
        [T * group_size, D] the group's tokens, rank-major (an all-gather).
    """
    pg = process_group(group) if group_size > 1 else None
    if pg is None:
        return hidden.clone(memory_format=torch.contiguous_format)
    return all_gather_group(hidden, pg).reshape(-1, hidden.shape[-1])


moe_dispatch = define_op("moe_dispatch(Tensor hidden, str group, int group_size=1) -> Tensor", _moe_dispatch,
                       lambda hidden, group, group_size=1: hidden.new_empty(
                           (hidden.shape[0] * group_size, *hidden.shape[1:])))


def _moe_combine(partial: Tensor, group: str, group_size: int = 1) -> Tensor:
    """Sum the routed-expert outputs of the `group` and return this rank's tokens.

    Args:
        partial: [T * group_size, D] this rank's experts' contribution to every dispatched token.
        group: semantic group name ("ep").
        group_size: ranks in the group.

    Returns:
        [T, D] the group's summed expert output for this rank's tokens (a reduce-scatter).
    """
    pg = process_group(group) if group_size > 1 else None
    if pg is None:
        return partial.clone(memory_format=torch.contiguous_format)
    out = partial.new_empty((partial.shape[0] // group_size, *partial.shape[1:]))
    torch.distributed.reduce_scatter_single(out, partial.contiguous(), group=pg)
    return out


moe_combine = define_op("moe_combine(Tensor partial, str group, int group_size=1) -> Tensor", _moe_combine,
                      lambda partial, group, group_size=1: partial.new_empty(
                          (partial.shape[0] // group_size, *partial.shape[1:])))


def _all_reduce(partial: Tensor, group: str) -> Tensor:
    """Sum `partial` over the `group` (what the static-MoE rewrite puts in place of moe_combine)."""
    out = partial.clone(memory_format=torch.contiguous_format)
    pg = process_group(group)
    if pg is not None:
        torch.distributed.all_reduce(out, group=pg)
    return out


all_reduce = define_op("all_reduce(Tensor partial, str group) -> Tensor", _all_reduce,
                     lambda partial, group: partial.new_empty(partial.shape))


def expert_shard_reference(combine: Tensor, shard: int = 0, num_shards: int = 1) -> Tensor:
    """This rank's experts' columns of the [T, E] combine matrix: [T, E / num_shards].

    Captured with one shard (every column); the expert-sharding pass sets the rank's shard.
    """
    width = combine.shape[1] // num_shards
    return combine[:, shard * width : (shard + 1) * width].contiguous()


expert_shard = define_op("expert_shard(Tensor combine, int shard=0, int num_shards=1) -> Tensor", expert_shard_reference,
                       lambda combine, shard=0, num_shards=1: combine.new_empty(
                           (combine.shape[0], combine.shape[1] // num_shards)))


def _sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor) -> Tensor:
    """Pick one token per row: greedy where temperature is 0, else sampling with top-k / top-p.

    Sampling uses the Gumbel-max trick with noise drawn from a per-row generator seeded by `seed`,
    so the same (logits, seed) always gives the same token, whatever else is in the batch.

    Args:
        logits: [B, V].
        temperature: [B] fp32; 0 means greedy.
        top_k: [B] int64; 0 means no top-k limit.
        top_p: [B] fp32 in (0, 1]; 1 means no nucleus limit.
        seed: [B] int64 per-row noise seed (the host mixes request seed and step).

    Returns:
        [B] int64 token ids.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if not bool((temperature > 0).any()):
        return greedy
    scaled = logits / temperature.clamp_min(1e-6)[:, None]  # [B, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # [1, V]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    # Nucleus: keep the smallest prefix whose probability reaches top_p (the first token always stays).
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    noise = torch.stack([
        torch.rand(logits.shape[-1], generator=torch.Generator().manual_seed(int(s)), dtype=torch.float32)
        for s in seed.tolist()
    ]).to(logits.device)  # [B, V]
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    sampled = order.gather(-1, (sorted_logits + gumbel).argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


sample = define_op("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed) -> Tensor",
                 _sample, lambda logits, temperature, top_k, top_p, seed: logits.new_empty(
                     logits.shape[:-1], dtype=torch.int64))
