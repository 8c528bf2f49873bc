"""graphc:: ops of the all-to-all MoE: tokens routed at their source, sent to the ranks holding
their experts, and their expert outputs sent back (`graphc.models.moe_forms.MOE_LOWERINGS`).

Static shapes: a source sends each destination a fixed-position block of T rows (row t is token t
when it has an expert there, zeros otherwise), so a destination always computes G * T rows in
source-major order and no token is ever dropped (the per-(source, destination) capacity is the
step's T). The lowering changes only what crosses the wire:
- `a2a_even`: the whole [G, T] blocks (an even all-to-all, masked rows included);
- `a2a_v`: the sent rows alone, packed by destination; the G x G split matrix is all-gathered
  first, so every rank derives every send and receive size from the same numbers (never from its
  own splits alone, which on Neuron would let ranks pick different collective lowerings and
  hang). Received rows are unpacked into the same fixed positions, so both lowerings hand the
  experts the same buffers and give bit-identical results.

The kernels compute sizes on the host; inside a compiled graph each op is one opaque node (the
CPU backends call these kernels). Shape letters: G ranks of the EP group, T tokens of this rank,
K experts per token, D hidden size, E routed experts, E' = E / G per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from graphc.ops.distributed import process_group
from graphc.ops.library import define_op

A2A_LOWERINGS = ("a2a_even", "a2a_v")


def routes_by_destination(ids: Tensor, weights: Tensor, valid: Tensor, num_experts: int,
                          group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each token's routes as each destination sees them.

    Args:
        ids, weights: [T, K] chosen experts (global ids) and their fp32 combine weights.
        valid: [T] bool, False for padding tokens (never sent anywhere).
        num_experts: E; rank d of the group holds experts [d * E', (d + 1) * E').

    Returns:
        local_ids: [G, T, K] the expert's id on destination d, E' where d does not hold it.
        local_weights: [G, T, K] the weight, 0 where d does not hold the expert.
        sent: [G, T] bool, whether token t goes to d (valid, with at least one expert there).
    """
    local = num_experts // group_size
    destination = torch.arange(group_size, device=ids.device)[:, None, None]  # [G, 1, 1]
    held = (ids // local)[None] == destination  # [G, T, K]
    held = held & valid[None, :, None]
    local_ids = torch.where(held, ids[None] - destination * local, local)
    local_weights = torch.where(held, weights[None], torch.zeros_like(weights)[None])
    return local_ids, local_weights, held.any(-1)


def _exchange(tensor: Tensor, pg, send_sizes: list[int] | None = None,
              receive_sizes: list[int] | None = None) -> Tensor:
    """All-to-all of `tensor`'s rows over `pg`: even blocks, or the given split sizes."""
    if pg is None:
        return tensor.clone(memory_format=torch.contiguous_format)
    rows = tensor.shape[0] if receive_sizes is None else sum(receive_sizes)
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=receive_sizes,
                           input_split_sizes=send_sizes, group=pg)
    return out


def _split_matrix(sent: Tensor, pg) -> Tensor:
    """[G, G] rows each source sends each destination, the same on every rank (all-gathered)."""
    counts = sent.sum(1)  # [G]
    if pg is None:
        return counts[None]
    matrix = counts.new_empty(pg.size() * counts.shape[0])
    dist.all_gather_single(matrix, counts.contiguous(), group=pg)
    return matrix.view(pg.size(), -1)


def _moe_a2a_dispatch(hidden: Tensor, ids: Tensor, weights: Tensor, valid: Tensor, num_experts: int, group: str,
                      group_size: int, lowering: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Send each token to the ranks holding its experts, with its routes there.

    Args:
        hidden: [T, D] this rank's tokens. ids, weights: [T, K] their routes (global ids).
        valid: [T] bool, False for padding. group, group_size: the EP group. lowering: `A2A_LOWERINGS`.

    Returns:
        rows: [G * T, D] the tokens sent here, source-major at fixed positions (zeros elsewhere).
        local_ids, local_weights: [G * T, K] their routes renumbered to this rank's experts (E'
            and 0 for routes elsewhere and for positions nothing was sent to).
        sent: [G, T] bool, which of this rank's tokens went to each destination.
        received: [G, T] bool, which positions of `rows` hold a token.
    """
    if lowering not in A2A_LOWERINGS:
        raise ValueError(f"moe_a2a_dispatch: lowering {lowering!r} is not one of {', '.join(A2A_LOWERINGS)}")
    pg = process_group(group) if group_size > 1 else None
    tokens, per_token = ids.shape
    local_ids, local_weights, sent = routes_by_destination(ids, weights, valid, num_experts, group_size)
    # One fp32 table per route row (weights, then ids, exact in fp32), so routes cross in one collective.
    routes = torch.cat([local_weights, local_ids.float()], dim=-1)  # [G, T, 2K]
    if lowering == "a2a_even":
        rows = _exchange(torch.where(sent[..., None], hidden[None], torch.zeros_like(hidden)[None]).flatten(0, 1), pg)
        routes = _exchange(routes.flatten(0, 1), pg)
        received = (routes[:, per_token:] < num_experts // group_size).any(-1).view(group_size, tokens)
    else:
        matrix = _split_matrix(sent, pg)  # [G, G]
        me = 0 if pg is None else pg.rank()
        send_sizes, receive_sizes = matrix[me].tolist(), matrix[:, me].tolist()
        destination, token = sent.nonzero(as_tuple=True)  # destination-major, token order within
        packed_routes = torch.cat([routes[destination, token], token[:, None].float()], dim=-1)  # [n, 2K + 1]
        packed_rows = _exchange(hidden[token], pg, send_sizes, receive_sizes)
        packed_routes = _exchange(packed_routes, pg, send_sizes, receive_sizes)
        source = torch.repeat_interleave(torch.arange(group_size, device=ids.device),
                                         torch.as_tensor(receive_sizes, device=ids.device))
        position = source * tokens + packed_routes[:, -1].long()  # where each row sits in the fixed layout
        rows = hidden.new_zeros((group_size * tokens, hidden.shape[-1])).index_copy(0, position, packed_rows)
        unsent = torch.cat([torch.zeros(per_token), torch.full((per_token,), float(num_experts // group_size))])
        routes = unsent.to(routes).expand(group_size * tokens, -1).index_copy(0, position, packed_routes[:, :-1])
        received = torch.zeros(group_size * tokens, dtype=torch.bool, device=ids.device).index_fill(0, position, True)
        received = received.view(group_size, tokens)
    return (rows.contiguous(), routes[:, per_token:].long().contiguous(), routes[:, :per_token].contiguous(),
            sent.contiguous(), received.contiguous())


moe_a2a_dispatch = define_op(
    "moe_a2a_dispatch(Tensor hidden, Tensor ids, Tensor weights, Tensor valid, int num_experts, str group, "
    "int group_size, str lowering) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _moe_a2a_dispatch,
    lambda hidden, ids, weights, valid, num_experts, group, group_size, lowering: (
        hidden.new_empty((group_size * hidden.shape[0], hidden.shape[1])),
        ids.new_empty((group_size * ids.shape[0], ids.shape[1])),
        weights.new_empty((group_size * weights.shape[0], weights.shape[1])),
        valid.new_empty((group_size, valid.shape[0])),
        valid.new_empty((group_size, valid.shape[0])),
    ),
)


def _moe_a2a_combine(partial: Tensor, sent: Tensor, received: Tensor, group: str, group_size: int,
                     lowering: str) -> Tensor:
    """Send the expert outputs back to their sources and sum each token's over destinations.

    Args:
        partial: [G * T, D] this rank's experts' weighted output for the rows it received.
        sent, received: [G, T] from `moe_a2a_dispatch` (this rank as source, as destination).

    Returns:
        [T, D] every destination's contribution to this rank's tokens, summed in rank order (0
        for padding tokens).
    """
    if lowering not in A2A_LOWERINGS:
        raise ValueError(f"moe_a2a_combine: lowering {lowering!r} is not one of {', '.join(A2A_LOWERINGS)}")
    pg = process_group(group) if group_size > 1 else None
    tokens, width = sent.shape[1], partial.shape[-1]
    if lowering == "a2a_even":
        returned = _exchange(partial, pg).view(group_size, tokens, width)
    else:
        # The sizes mirror the dispatch's: what came from each source goes back to it.
        source, token = received.nonzero(as_tuple=True)
        back = _exchange(partial.view(group_size, tokens, width)[source, token], pg,
                         received.sum(1).tolist(), sent.sum(1).tolist())
        destination, token = sent.nonzero(as_tuple=True)
        returned = partial.new_zeros((group_size, tokens, width)).index_put((destination, token), back)
    return torch.where(sent[..., None], returned, torch.zeros_like(returned)).sum(0).contiguous()


moe_a2a_combine = define_op(
    "moe_a2a_combine(Tensor partial, Tensor sent, Tensor received, str group, int group_size, str lowering) -> Tensor",
    _moe_a2a_combine,
    lambda partial, sent, received, group, group_size, lowering: partial.new_empty(
        (sent.shape[1], partial.shape[-1])),
)
