"""Lowering rules for the graphc:: ops that reach the XLA lowering (the others are inlined to
ATen by `passes/inline_reference_kernels.py` first): the KV write, the sampler, the grouped
expert GEMM, DeepSeek-V4's Sinkhorn normalisation and the collectives (the all-to-all MoE's
included).

Each rule takes the `Lowering` (topology groups, HLO variant, the sampler's noise), the node's
`Out` and the op's arguments; each follows its torch kernel in `graphc.ops` (tested against it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from graphc.backends.xla import collectives
from graphc.backends.xla.ngram_hash import ngram_hash
from graphc.backends.xla.aten import Out, first_argmax
from graphc.errors import GraphcError
from graphc.models.moe_forms import expert_blocks
from graphc.ops.collectives import combine_gathers
from graphc.perf.device import neuron_grouped_block
from graphc.ops.sampler import SAMPLER_CANDIDATES
from graphc.ops.sparse import NO_KEY

SAMPLER_MIN_TEMPERATURE = 1e-6
"""As `graphc.ops.sampler`: temperatures are clamped to this before dividing."""


def kv_write(lowering, out: Out, kv_pool, layer: int, kv, slot_mapping):
    """The pool with each token's vector in its slot; tokens with no slot here (negative) write the
    reserved scratch slot (the pool's last block, never allocated) instead of being dropped as
    out-of-bounds writes: Neuron's scatter has no drop mode."""
    layers, blocks, block_size, width = kv_pool.shape
    slots = slot_mapping.reshape(-1)
    slots = jnp.where(slots < 0, (blocks - 1) * block_size, slots)
    layer_slots = kv_pool[layer].reshape(blocks * block_size, width)
    written = layer_slots.at[slots].set(kv.reshape(-1, width).astype(kv_pool.dtype), unique_indices=False)
    return (None, kv_pool.at[layer].set(written.reshape(blocks, block_size, width)))


def _candidates(lowering, logits, temperature, top_k, top_p):
    """`graphc.ops.sampler.candidates` of the scaled logits [..., V] (rows' parameters [...]): the
    kept candidates' logits at -inf where top-k and top-p drop them, and their token ids (int32),
    each [..., min(SAMPLER_CANDIDATES, V)]; the top-k as the variant takes one (neuron: its custom
    call), so no sort or scan spans the vocabulary."""
    scaled = logits / jnp.maximum(temperature, SAMPLER_MIN_TEMPERATURE)[..., None]
    count = min(SAMPLER_CANDIDATES, scaled.shape[-1])
    top = lowering.variant.rules.get(torch.ops.aten.topk.default)
    values, ids = top(None, scaled, count) if top is not None else jax.lax.top_k(scaled, count)
    probs = jnp.exp(values - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    rank = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    drop = (top_k[..., None] > 0) & (rank >= top_k[..., None])
    drop = drop | (jnp.cumsum(probs, axis=-1) - probs >= top_p[..., None])
    return jnp.where(drop, -jnp.inf, values), ids.astype(jnp.int32)


def _gumbel(noise):
    return -jnp.log(-jnp.log(jnp.clip(noise, 1e-20, 1.0 - 1e-7)))


def sample(lowering, out: Out, logits, temperature, top_k, top_p, seed, samples=None):
    """`graphc.ops.sampler._sample` with its Gumbel noise taken from the program's `noise` input
    (the host draws it from each row's seed: Neuron's RNG ignores seeds), so a seed samples the
    same token on every backend."""
    logits = logits.astype(jnp.float32)
    greedy = first_argmax(logits)
    kept, ids = _candidates(lowering, logits, temperature, top_k, top_p)
    pick = first_argmax(kept + _gumbel(jnp.take_along_axis(lowering.noise, ids, axis=1)))
    sampled = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
    tokens = jnp.where(temperature > 0, sampled, greedy)
    return tokens if samples is None else jnp.where(samples != 0, tokens, 0)


def verify_drafts(lowering, out: Out, logits, drafts, draft_count, temperature, top_k, top_p, seed):
    """`graphc.ops.sampler._verify_drafts`, every row and position at once, with position j's
    noise from the program's `noise` input [B, 1 + k, V] (the host draws it from seed + j)."""
    logits = logits.astype(jnp.float32)
    rows, positions, _ = logits.shape
    k = positions - 1
    greedy = first_argmax(logits)  # [B, 1 + k]
    expand = lambda v: jnp.broadcast_to(v[:, None], (rows, positions))  # noqa: E731
    candidate_logits, ids = _candidates(lowering, logits, expand(temperature), expand(top_k), expand(top_p))
    # Back to vocabulary order: each candidate's kept logit, -inf for the rest; then probabilities.
    kept = jnp.full_like(logits, -jnp.inf).at[
        jnp.arange(rows)[:, None, None], jnp.arange(positions)[None, :, None], ids].set(candidate_logits)
    probabilities = jax.nn.softmax(kept, axis=-1)  # [B, 1 + k, V]
    noise = lowering.noise
    proposed = jnp.concatenate([drafts, jnp.zeros((rows, 1), drafts.dtype)], axis=1)  # [B, 1 + k]
    at_draft = lambda values: jnp.take_along_axis(values, proposed[..., None], axis=2)[..., 0]  # noqa: E731
    sampling = (temperature > 0)[:, None]
    agrees = jnp.where(sampling, at_draft(noise) < at_draft(probabilities), greedy == proposed)[:, :k]
    valid = jnp.arange(k)[None, :] < draft_count[:, None]
    accepted = jnp.sum(jnp.cumprod((agrees & valid).astype(jnp.int32), axis=1), axis=1)  # [B]
    # Position j's draw: from p_j without d_j where d_j was proposed and rejected, else from p_j.
    rejected_here = jnp.arange(positions)[None, :] < draft_count[:, None]
    excluded = rejected_here[..., None] & (jax.lax.broadcasted_iota(jnp.int32, kept.shape, 2) == proposed[..., None])
    scores = jnp.where(excluded | (probabilities <= 0), -jnp.inf, jnp.log(probabilities)) + _gumbel(noise)
    drawn = jnp.where(sampling, first_argmax(scores), greedy)  # [B, 1 + k]
    last = jnp.take_along_axis(drawn, accepted[:, None], axis=1)  # [B, 1]
    index = jnp.arange(positions)[None, :]
    tokens = jnp.where(index < accepted[:, None], proposed, jnp.where(index == accepted[:, None], last, 0))
    return jnp.concatenate([accepted[:, None], tokens], axis=1).astype(jnp.int32)


def grouped_mm(lowering, out: Out, rows, weights, offsets, local_rows: int = -1):
    """rows [M, D] sorted by expert @ their expert's weights [E', D, F] -> [M, F]; rows past
    offsets[-1] (routes to other ranks' experts) are 0. Two static-shape forms, the one whose
    larger of weight reads and FLOPs (at the dense rate, no PE-array utilisation) is lower for
    these shapes on graphc's default Neuron target (`perf.device.neuron_grouped_block`):
    - blocked: each expert's rows in blocks of B, ceil(L / B) + E' - 1 blocks (L the call's bound
      on local rows), each one GEMM of B rows against its expert's matrix read by index, the
      results put back at their rows: FLOPs grow with the routed rows plus bounded padding;
    - expert-major: every row times every local expert's weights in one batched GEMM ([E', M, F]),
      each row's result taken from its expert's: each weight read once, E' times the rows' FLOPs.
    Never a matrix gathered per row (at DeepSeek-V3's width a 256-token chunk's would be 168 GiB)."""
    experts, dim, width = weights.shape
    total = rows.shape[0]
    local = total if local_rows < 0 else min(local_rows, total)
    block = neuron_grouped_block(local, total, experts, dim, width, weights.dtype.itemsize)
    if block == 0:
        # Compare-all, not a binary search: no while loop in the module.
        expert = jnp.searchsorted(offsets, jnp.arange(total), side="right", method="compare_all")  # [M]
        products = jnp.einsum("md,edf->emf", rows, weights, precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)  # [E', M, F]
        mine = expert[None, :, None] == jnp.arange(experts)[:, None, None]  # [E', M, 1]
        return jnp.where(mine, products, 0).sum(axis=0).astype(out.dtype)
    blocks = expert_blocks(local, experts, block)
    ends = offsets.astype(jnp.int32)  # [E'] inclusive ends of each expert's rows
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    block_ends = jnp.cumsum((ends - starts + block - 1) // block)  # [E'] blocks through each expert
    index = jnp.arange(blocks, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(block_ends, index, side="right", method="compare_all"), experts - 1)  # [N]
    first_block = block_ends[owner] - (ends[owner] - starts[owner] + block - 1) // block
    row = starts[owner][:, None] + (index - first_block)[:, None] * block + jnp.arange(block)[None, :]  # [N, B]
    valid = row < ends[owner][:, None]
    target = jnp.where(valid, row, total)  # the rows past every expert's go to one spare row
    taken = jnp.where(valid[..., None], rows[jnp.minimum(target, total - 1)], 0)  # [N, B, D]
    products = jnp.einsum("nbd,ndf->nbf", taken, weights[owner], precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)  # [N, B, F]
    placed = jnp.zeros((total + 1, width), jnp.float32).at[target.reshape(-1)].set(products.reshape(-1, width))
    return placed[:total].astype(out.dtype)


def attention_combine(lowering, out: Out, partial, lse, group: str):
    """`graphc.ops.collectives._attention_combine`: one all-gather merged locally for a small
    payload (`combine_gathers`), else two all-reduces (nothing a group's size holds)."""
    groups = lowering.groups(group)
    payload = jnp.concatenate([partial.astype(jnp.float32), lse[..., None]], axis=-1)  # [B, Q, H, R + 1]
    if combine_gathers(payload.size * 4, len(groups[0])):
        gathered = collectives.all_gather(payload, groups)  # [G, B, Q, H, R + 1]
        weights = jnp.exp(gathered[..., -1:] - gathered[..., -1:].max(axis=0))
        return ((weights * gathered[..., :-1]).sum(axis=0) / weights.sum(axis=0)).astype(out.dtype)
    weights = jnp.exp(lse - collectives.all_reduce_max(lse, groups))[..., None]  # [B, Q, H, 1]
    summed = collectives.all_reduce(jnp.concatenate([weights * partial.astype(jnp.float32), weights], axis=-1), groups)
    return (summed[..., :-1] / summed[..., -1:]).astype(out.dtype)


def moe_dispatch(lowering, out: Out, hidden, group: str, group_size: int = 1):
    return collectives.all_gather(hidden, lowering.groups(group)).reshape(out.shape)


def moe_combine(lowering, out: Out, partial, group: str, group_size: int = 1):
    return collectives.reduce_scatter(partial, lowering.groups(group))


def moe_a2a_dispatch(context, outs, hidden, ids, weights, valid, num_experts: int, group: str, group_size: int,
                     lowering: str):
    """`graphc.ops.all_to_all._moe_a2a_dispatch`'s `a2a_even` form: every source's [G, T] blocks,
    masked rows included, cross in one even all-to-all, and their routes (weights, then ids,
    exact in fp32) in another."""
    _check_even(lowering)
    groups = context.groups(group)
    tokens, per_token = ids.shape
    local = num_experts // group_size
    destination = jnp.arange(group_size)[:, None, None]  # [G, 1, 1]
    held = ((ids // local)[None] == destination) & valid[None, :, None]  # [G, T, K]
    local_ids = jnp.where(held, ids[None] - destination * local, local)
    local_weights = jnp.where(held, weights[None], jnp.zeros_like(weights)[None])
    sent = held.any(-1)  # [G, T]
    blocks = jnp.where(sent[..., None], hidden[None], jnp.zeros_like(hidden)[None]).reshape(-1, hidden.shape[-1])
    routes = jnp.concatenate([local_weights, local_ids.astype(jnp.float32)], axis=-1).reshape(-1, 2 * per_token)
    rows = collectives.all_to_all(blocks, groups)
    routes = collectives.all_to_all(routes, groups)
    received = (routes[:, per_token:] < local).any(-1).reshape(group_size, tokens)
    return rows, routes[:, per_token:].astype(ids.dtype), routes[:, :per_token], sent, received


def moe_a2a_combine(context, out: Out, partial, sent, received, group: str, group_size: int, lowering: str):
    """`graphc.ops.all_to_all._moe_a2a_combine`'s `a2a_even` form: the expert outputs back to
    their sources in one even all-to-all, summed over destinations in rank order."""
    _check_even(lowering)
    tokens, width = sent.shape[1], partial.shape[-1]
    returned = collectives.all_to_all(partial, context.groups(group)).reshape(group_size, tokens, width)
    return jnp.where(sent[..., None], returned, jnp.zeros_like(returned)).sum(0)


def _check_even(lowering: str) -> None:
    # The backend compiles a2a_even in a2a_v's place (`Backend.stand_ins`); a program that still
    # holds a2a_v was not compiled by graphc's pipeline.
    if lowering != "a2a_even":
        raise GraphcError(f"xla lowering: the {lowering} all-to-all has no XLA rule; only a2a_even is lowered")


def all_reduce(lowering, out: Out, partial, group: str):
    return collectives.all_reduce(partial, lowering.groups(group))


def all_reduce_max(lowering, out: Out, partial, group: str):
    return collectives.all_reduce_max(partial, lowering.groups(group))


def hc_sinkhorn(lowering, out: Out, comb, iterations: int, eps: float):
    """`graphc.ops.hyper_connections.hc_sinkhorn_reference`, unrolled: columns normalised, then
    `iterations` - 1 rounds of rows then columns."""
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def gather_columns(lowering, out: Out, part, group: str, group_size: int = 1):
    gathered = collectives.all_gather(part, lowering.groups(group))  # [G, ..., N]
    return jnp.moveaxis(gathered, 0, -2).reshape(out.shape)


def index_topk_combine(lowering, out: Out, positions, scores, group: str):
    """`graphc.ops.sparse._index_topk_combine`: the group's candidates in ascending position
    (NO_KEY last), then the best k by score with ties to the lower position."""
    groups = lowering.groups(group)
    k = positions.shape[-1]
    candidates = jnp.moveaxis(collectives.all_gather(positions, groups), 0, 2).reshape(*positions.shape[:2], -1)
    candidate_scores = jnp.moveaxis(collectives.all_gather(scores, groups), 0, 2).reshape(*scores.shape[:2], -1)
    key = jnp.where(candidates == NO_KEY, jnp.iinfo(jnp.int32).max, candidates)
    _, candidates, candidate_scores = jax.lax.sort((key, candidates, candidate_scores), dimension=2,
                                                   is_stable=True, num_keys=1)
    iota = jax.lax.broadcasted_iota(jnp.int32, candidate_scores.shape, 2)
    _, order = jax.lax.sort((-candidate_scores, iota), dimension=2, is_stable=True, num_keys=1)
    order = order[..., :k]
    top_scores = jnp.take_along_axis(candidate_scores, order, axis=2)
    top = jnp.take_along_axis(candidates, order, axis=2)
    return jnp.where(top_scores == -jnp.inf, NO_KEY, top)


ops = torch.ops.graphc
RULES = {
    ops.kv_write.default: kv_write,
    ops.sample.default: sample,
    ops.verify_drafts.default: verify_drafts,
    ops.grouped_mm.default: grouped_mm,
    ops.attention_combine.default: attention_combine,
    ops.moe_dispatch.default: moe_dispatch,
    ops.moe_combine.default: moe_combine,
    ops.all_reduce.default: all_reduce,
    ops.all_reduce_max.default: all_reduce_max,
    ops.hc_sinkhorn.default: hc_sinkhorn,
    ops.moe_a2a_dispatch.default: moe_a2a_dispatch,
    ops.moe_a2a_combine.default: moe_a2a_combine,
    ops.gather_columns.default: gather_columns,
    ops.index_topk_combine.default: index_topk_combine,
    ops.ngram_hash.default: ngram_hash,
}
"""graphc op -> rule (taking the `Lowering` first)."""
