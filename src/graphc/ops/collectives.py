"""graphc:: collectives: the places where parallel execution differs from one device.

On one device (no process group for the semantic group) each is the identity or a copy; the
passes set group sizes per rank and drop the ones a topology makes trivial. Shape letters as in
`graphc.ops.paged_attention`; G ranks of a group, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.distributed import process_group
from graphc.ops.library import define_op


def all_gather_group(tensor: Tensor, pg) -> Tensor:
    """[G, *tensor.shape]: every rank's tensor, in rank order."""
    gathered = tensor.new_empty((pg.size() * tensor.shape[0], *tensor.shape[1:]))
    torch.distributed.all_gather_single(gathered, tensor.contiguous(), group=pg)
    return gathered.view(pg.size(), *tensor.shape)


GATHER_LIMIT = 1 << 20
"""Bytes a rank may receive from an attention combine's all-gather. Below it the collective is
latency-bound (the Neuron runtime runs its mesh algorithm below 1 MB; gloo's ring, a round a
call), so one all-gather costs less than two all-reduces; above it the all-reduces move less."""


def combine_gathers(payload_bytes: int, group_size: int) -> bool:
    """Whether `attention_combine` of a [B, Q, H, R + 1] fp32 `payload_bytes` over `group_size`
    ranks all-gathers the partials (one collective) rather than all-reducing them (two): a pure
    rule of the shapes, so every rank, backend and `graphc plan` pick the same form."""
    return payload_bytes * group_size <= GATHER_LIMIT


def merge_partials(gathered: Tensor) -> Tensor:
    """[G, B, Q, H, R + 1] every rank's fp32 partial output with its lse as the last channel ->
    [B, Q, H, R] the attention over every rank's keys (module docstring of `_attention_combine`)."""
    lse = gathered[..., -1:]
    weights = torch.exp(lse - lse.amax(dim=0))  # [G, B, Q, H, 1]; 0 where a rank saw no key
    return (weights * gathered[..., :-1]).sum(dim=0) / weights.sum(dim=0)


def _attention_combine(out: Tensor, lse: Tensor, group: str) -> Tensor:
    """Combine the partial attentions of a context-parallel `group` exactly.

    Each rank attended over its own shard of the keys; with M the maximum over ranks of lse and
    w_r = exp(lse_r - M), the full attention is sum_r w_r out_r / sum_r w_r. Two forms, by
    `combine_gathers`: for a small payload one all-gather of every rank's [B, Q, H, R + 1] partial
    and lse, merged locally; else two all-reduces (the maximum of lse, then the weighted outputs
    with their weights as one more channel), so a rank holds one [B, Q, H, R + 1] sum whatever the
    group's size (all-gathered, a 256-token chunk of DeepSeek-V3 at cp = 64 would hold 4 GiB).
    On one device the identity.

    Args:
        out: [B, Q, H, R] this rank's partial output.
        lse: [B, Q, H] fp32 log-sum-exp of this rank's scores (-inf where it saw no key).
        group: semantic group name ("cp").

    Returns:
        [B, Q, H, R] the attention over every rank's keys, in out's dtype (garbage where no rank
        saw a key: position 0 always is, a pooled window that closes none may not be).
    """
    pg = process_group(group)
    if pg is None:
        return out.clone(memory_format=torch.contiguous_format)
    payload = torch.cat([out.float(), lse[..., None]], dim=-1)  # [B, Q, H, R + 1]
    if combine_gathers(payload.numel() * 4, pg.size()):
        return merge_partials(all_gather_group(payload, pg)).to(out.dtype).contiguous()
    top = lse.clone(memory_format=torch.contiguous_format)
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=pg)
    weights = torch.exp(lse - top)[..., None]  # [B, Q, H, 1]; 0 where this rank saw no key
    summed = torch.cat([weights * out.float(), weights], dim=-1)  # [B, Q, H, R + 1]
    torch.distributed.all_reduce(summed, group=pg)
    return (summed[..., :-1] / summed[..., -1:]).to(out.dtype).contiguous()


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


def _all_reduce_max(partial: Tensor, group: str) -> Tensor:
    """The elementwise maximum of `partial` over the `group` (DeepSeek-V4.1's candidate blocks: a
    block's score is its best entry, wherever in the context-parallel group that entry lives)."""
    out = partial.clone(memory_format=torch.contiguous_format)
    pg = process_group(group)
    if pg is not None:
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=pg)
    return out


all_reduce_max = define_op("all_reduce_max(Tensor partial, str group) -> Tensor", _all_reduce_max,
                           lambda partial, group: partial.new_empty(partial.shape))


def _gather_columns(part: Tensor, group: str, group_size: int = 1) -> Tensor:
    """Every rank's columns of a tensor split along its last dim over the `group`, side by side
    in rank order (a tensor-parallel embedding's hidden slice, an LM head's vocabulary slice).

    Args:
        part: [..., N] this rank's columns.
        group: semantic group name ("tp").
        group_size: ranks in the group (G).

    Returns:
        [..., G * N] the whole tensor.
    """
    pg = process_group(group) if group_size > 1 else None
    if pg is None:
        return part.clone(memory_format=torch.contiguous_format)
    gathered = all_gather_group(part, pg)  # [G, ..., N]
    return torch.movedim(gathered, 0, -2).reshape(*part.shape[:-1], -1).contiguous()


gather_columns = define_op("gather_columns(Tensor part, str group, int group_size=1) -> Tensor", _gather_columns,
                           lambda part, group, group_size=1: part.new_empty((*part.shape[:-1], part.shape[-1] * group_size)))
