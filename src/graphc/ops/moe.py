"""graphc:: ops of the routed experts' sparse forms (see `models/layers.RoutedExperts`).

- `expert_routes`: the (token, expert) routes this rank's experts serve, renumbered locally.
  The shard is the step's `coordinates` input (one graph for every rank); CPU backends inline it.
- `grouped_mm`: one GEMM per expert over expert-sorted rows. It stays an op on every backend: its
  CPU kernel is ATen's `_grouped_mm`, which computes fp32 on the CPU but whose meta function
  admits only bf16, so it cannot be traced as itself; the neuron backend lowers it with its own XLA
  rule (a blocked GEMM over the routes' rows, or one over every local expert: whichever reads and
  computes less by the default Neuron target's rates, for the call's shapes).

Shape letters: T tokens, K experts per token, E routed experts (of the whole model), E' = E /
num_shards this rank's, D hidden size, I expert width, F = 2I (gate and up fused), M = T*K rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.library import Shard, define_op, shard_number


def expert_routes_reference(ids: Tensor, weights: Tensor, num_experts: int, shard: Shard = 0,
                            num_shards: int = 1) -> tuple[Tensor, Tensor]:
    """Renumber each route to this shard's experts; routes to other shards' experts get id E'
    (one past the last local expert: sorted after every local route) and weight 0.

    Args:
        ids: [T, K] chosen experts, global ids.
        weights: [T, K] fp32 combine weights.
        num_experts: E, the model's routed experts.
        shard, num_shards: this rank's place in the expert-parallel group; it holds experts
            [shard * E', (shard + 1) * E').

    Returns:
        local_ids: [T, K] in [0, E'], E' where another shard holds the expert.
        local_weights: [T, K] the weights, 0 where another shard holds the expert.
    """
    local_experts = num_experts // num_shards
    shifted = ids - shard_number(shard) * local_experts
    mine = (shifted >= 0) & (shifted < local_experts)
    return (torch.where(mine, shifted, local_experts).contiguous(),
            torch.where(mine, weights, torch.zeros_like(weights)).contiguous())


expert_routes = define_op(
    "expert_routes(Tensor ids, Tensor weights, int num_experts, Tensor? shard=None, int num_shards=1) "
    "-> (Tensor, Tensor)",
    expert_routes_reference,
    lambda ids, weights, num_experts, shard=None, num_shards=1: (ids.new_empty(ids.shape), weights.new_empty(weights.shape)),
)


def _aten_computes(rows: Tensor, weights: Tensor) -> bool:
    """Whether ATen's CPU `_grouped_mm` takes these: fp32 / bf16 / fp16, every matrix width a
    multiple of 16 bytes (its stride rule)."""
    widths = (rows.shape[-1], *weights.shape[-2:])
    return (rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(w * rows.element_size() % 16 == 0 for w in widths))


def _grouped_mm(rows: Tensor, weights: Tensor, offsets: Tensor, local_rows: int = -1) -> Tensor:
    """rows [M, D] sorted by expert @ weights [E', D, F] of each row's expert -> [M, F].

    Args:
        rows: [M, D] rows grouped by expert: expert e's rows are offsets[e-1]:offsets[e].
        weights: [E', D, F] one matrix per local expert (any strides: a transposed view of the
            stored [E', F, D] is read in place).
        offsets: [E'] int32 inclusive prefix sums of each expert's row count.
        local_rows: a static bound on offsets[-1] (`moe_forms.local_rows_bound`), -1 for M: a
            static-shape lowering sizes its blocks by it (this kernel needs none).

    Returns:
        [M, F] each row times its expert's matrix; rows past offsets[-1] (routes to experts this
        rank does not hold) are 0. An expert with no rows costs nothing: its weights are not read.
    """
    if _aten_computes(rows, weights):
        out = torch._grouped_mm(rows, weights, offs=offsets)
    else:  # float64 (`graphc probe`'s reference), or widths ATen refuses: one matmul per expert
        out, start = rows.new_empty((rows.shape[0], weights.shape[-1])), 0
        for expert, end in enumerate(offsets.tolist()):
            out[start:end], start = rows[start:end] @ weights[expert], end
    out[int(offsets[-1]):] = 0  # ATen leaves them uninitialised
    return out


grouped_mm = define_op("grouped_mm(Tensor rows, Tensor weights, Tensor offsets, int local_rows=-1) -> Tensor",
                       _grouped_mm,
                       lambda rows, weights, offsets, local_rows=-1: rows.new_empty((rows.shape[0], weights.shape[-1])))
