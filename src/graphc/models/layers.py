"""What every family's model is built from: RMSNorm, RoPE, the SwiGLU MLP, and the MoE over its
routed experts in their three forms.

Shape letters: B rows, Q tokens per row, T = B*Q tokens, D hidden, P roped dims, E routed experts
(E' this rank's), K experts per token, I expert width, F = 2I fused gate and up rows.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.weights.hf_config import RopeArgs, yarn_mscale
from graphc.models.moe_forms import (contributes_shared_partial, local_rows_bound, moe_form_for,
                                      shared_experts_reduced_with_routed)
from graphc.models.step_model import ModelArgs, StepInputs
from graphc.ops import all_to_all, collectives, moe
from graphc.step import PADDING_SLOT


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, cast back, then scale: the order transformers uses, so bf16 rounds alike.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inverse_frequencies(rope: RopeArgs, dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin attention factor (YaRN when configured).

    Returns:
        inv_freq: [P/2] fp32.
        attention_factor: multiplier of cos and sin (1 without YaRN).
    """
    # Built on the CPU even under a meta-device context: the loader moves it with the module.
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)  # [P/2]
    if rope.yarn_factor is None:
        return 1.0 / base, 1.0
    factor = rope.yarn_factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.yarn_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.yarn_beta_fast), correction_dim(rope.yarn_beta_slow)
    if rope.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # [P/2]
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 interpolates it fully
    inv_freq = (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate
    if rope.yarn_attention_factor is not None:
        attention_factor = float(rope.yarn_attention_factor)
    elif rope.yarn_mscale and rope.yarn_mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.yarn_mscale) / yarn_mscale(factor, rope.yarn_mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeArgs, dim: int):
        super().__init__()
        inv_freq, self.attention_factor = rope_inverse_frequencies(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = rope.interleave

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, Q, P/2] of every position."""
        angles = positions.float()[..., None] * self.inv_freq  # [B, Q, P/2]
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate x [..., P] in the model's layout (see `rotate`)."""
        return rotate(x, cos, sin, self.interleave)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """Rotate x [..., P]; cos/sin broadcast against x[..., P/2].

    Interleaved pairs come out de-interleaved ([rotated evens, rotated odds]); queries and keys
    get the same permutation, so their dot products are unchanged. Otherwise the two halves are
    the pairs (the layout of V3.2's indexer).
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def swiglu(gate: Tensor, up: Tensor, limit: float | None) -> Tensor:
    """silu(gate) * up; with `limit` (DeepSeek-V4's), gate clamped above and up both ways first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def row_parallel(linear: nn.Linear, x: Tensor, tp: int) -> Tensor:
    """`linear` over this rank's slice of its input features (a tensor-parallel rank's heads or FFN
    columns), summed over the tp group: its bias added once, after the sum."""
    if tp == 1:
        return linear(x)
    out = collectives.all_reduce(F.linear(x, linear.weight), "tp")
    return out if linear.bias is None else out + linear.bias


def gather_over_tp(part: Tensor, tp: int) -> Tensor:
    """The whole of a tensor whose last dim is split over the tp group (this rank's `part`)."""
    return part if tp == 1 else collectives.gather_columns(part, "tp", tp)


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and the shared experts.

    Under tensor parallelism (`tp` > 1) a rank holds `hidden / tp` of the width: its gate and up
    rows (column-parallel) and the matching down columns (row-parallel), summed over the tp group.
    """

    def __init__(self, dim: int, hidden: int, swiglu_limit: float | None = None, fp32_activation: bool = False,
                 tp: int = 1):
        super().__init__()
        self.tp = tp
        self.gate_proj = nn.Linear(dim, hidden // tp, bias=False)
        self.up_proj = nn.Linear(dim, hidden // tp, bias=False)
        self.down_proj = nn.Linear(hidden // tp, dim, bias=False)
        self.swiglu_limit = swiglu_limit
        self.fp32_activation = fp32_activation
        """SwiGLU in fp32, rounded once (DeepSeek-V4.1's order); else in the model dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return row_parallel(self.down_proj, self._activation(x), self.tp)

    def partial(self, x: Tensor) -> Tensor:
        """This rank's share of the output, before the sum over the tp group (its caller sums it)."""
        return self.down_proj(self._activation(x))

    def _activation(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fp32_activation:
            return swiglu(gate.float(), up.float(), self.swiglu_limit).to(x.dtype)
        return swiglu(gate, up, self.swiglu_limit)


STACKED_EXPERT = re.compile(r"^(model\.(?:layers|mtp)\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
"""The names of `RoutedExperts`' stacked parameters in every family's model (the loader stacks
them from the stored per-expert tensors)."""


class RoutedExperts(nn.Module):
    """The routed experts as stacked weights, in one of three static-shape forms (`MOE_FORMS`).

    - `dense`: every expert on every token, weighed by a [T, E'] combine matrix zero off the
      chosen experts; reads every expert's weights. The reference.
    - `gather`: each route (token, chosen expert) reads its expert's weights by id and computes
      one row: T*K expert reads, no sort. For decode-sized steps.
    - `grouped`: the routes sorted by expert, one GEMM per expert over its rows
      (`graphc::grouped_mm`), unsorted and weighed: T*K rows of compute, each used expert read
      once. For prefill-sized steps.

    Expert parallelism shards E: a rank holds E' = E / ep experts and takes routes renumbered
    to them (`graphc::expert_routes`, or the all-to-all dispatch): off-shard routes get id E' and
    weight 0; the dense form drops their column, the grouped form computes no row for them.

    Weights are stored in the layout the forms read: gate and up fused into one [E', 2I, D]
    matrix per expert (one gather, one GEMM), down as [E', D, I]; both reduce over their
    contiguous last dim, and the grouped form reads them through transposed views.
    """

    def __init__(self, args: ModelArgs, local_experts: int | None = None, swiglu_limit: float | None = None,
                 weigh_before_down: bool = False):
        super().__init__()
        self.n_routed_experts = args.n_routed_experts
        self.swiglu_limit = swiglu_limit
        self.weigh_before_down = weigh_before_down
        """DeepSeek-V4.1's expert arithmetic: SwiGLU in fp32 times the route's weight, rounded once
        before the down projection (whose outputs then only sum); else the down projection's
        outputs are weighed."""
        experts, dim, hidden = local_experts or args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))  # [E', F, D]: gate rows, then up
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))  # [E', D, I]

    @property
    def local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor, form: str) -> Tensor:
        """x [T, D], weights/ids [T, K] routes renumbered to this rank's experts (ids in [0, E'],
        E' for an expert another rank holds, with weight 0) -> [T, D] this rank's experts' share.

        One function for the three forms: torch.export records the stack of `forward` frames
        only, and `graphc probe` names the source line of each op from it.
        """
        width = self.down_proj.shape[-1]
        if form == "dense":
            # Column E' collects the other ranks' routes (weight 0) and is dropped.
            combine = torch.zeros(x.shape[0], self.local_experts + 1, dtype=weights.dtype, device=x.device)
            combine = combine.scatter(1, ids, weights)[:, :-1]  # [T, E']
            gate, up = torch.einsum("td,efd->etf", x, self.gate_up_proj).split(width, dim=-1)  # [E', T, I] each
            if self.weigh_before_down:
                out = torch.einsum("eti,edi->etd", self._weighed(gate, up, combine.t()), self.down_proj)  # [E', T, D]
                return out.float().sum(dim=0).to(x.dtype)
            out = torch.einsum("eti,edi->etd", swiglu(gate, up, self.swiglu_limit), self.down_proj)  # [E', T, D]
            # Weigh and sum the experts in fp32 (the weights are fp32): one rounding, not E of them.
            return torch.einsum("etd,te->td", out.float(), combine).to(x.dtype)  # [T, D]
        if form == "gather":
            # Multiply-and-sum over gathered weights, so a compiler fuses the gather into the
            # reduction (each weight read once, never copied); products accumulate in fp32, as a
            # matmul's would. Off-shard routes (weight 0) read a real expert.
            experts = ids.clamp(max=self.local_experts - 1)  # [T, K]
            gate_up = (x.float()[:, None, None, :] * self.gate_up_proj[experts].float()).sum(-1)  # [T, K, F]
            gate, up = gate_up.to(x.dtype).split(width, dim=-1)  # [T, K, I] each
            hidden = (self._weighed(gate, up, weights) if self.weigh_before_down
                      else swiglu(gate, up, self.swiglu_limit)).float()  # [T, K, I]
            routed = (hidden[:, :, None, :] * self.down_proj[experts].float()).sum(-1).to(x.dtype)  # [T, K, D]
        else:
            tokens, per_token = ids.shape
            routes = ids.reshape(-1)  # [M] local expert of each route, E' off-shard
            order = routes.argsort(stable=True)  # [M] routes grouped by expert, off-shard last
            counts = torch.zeros(self.local_experts + 1, dtype=torch.int64, device=x.device)
            counts = counts.scatter_add(0, routes, torch.ones_like(routes))[:-1]  # [E'] routes per local expert
            offsets = counts.cumsum(0).to(torch.int32)  # [E']
            rows = x[order // per_token]  # [M, D] each route's token
            local = local_rows_bound(tokens, per_token, self.local_experts)  # a static bound on offsets[-1]
            gate, up = moe.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offsets, local).split(width, dim=-1)
            hidden = (self._weighed(gate, up, weights.reshape(-1)[order]) if self.weigh_before_down
                      else swiglu(gate, up, self.swiglu_limit))
            out = moe.grouped_mm(hidden, self.down_proj.transpose(1, 2), offsets, local)  # [M, D]; 0 off-shard
            unsort = torch.zeros_like(order).scatter(0, order, torch.arange(order.shape[0], device=x.device))  # [M]
            routed = out[unsort].view(tokens, per_token, -1)  # [T, K, D]
        if self.weigh_before_down:
            return routed.float().sum(dim=1).to(x.dtype)
        # Weigh and sum the routes in fp32 (the weights are fp32): one rounding, not K of them.
        return torch.einsum("tkd,tk->td", routed.float(), weights).to(x.dtype)  # [T, D]

    def _weighed(self, gate: Tensor, up: Tensor, weights: Tensor) -> Tensor:
        """fp32 SwiGLU times each route's weight (broadcast over the last dim), rounded once."""
        return (swiglu(gate.float(), up.float(), self.swiglu_limit) * weights[..., None]).to(gate.dtype)


class MoE(nn.Module):
    """Router, routed experts (this rank's) and shared experts, over the step's MoE exchange."""

    def __init__(self, gate: nn.Module, experts: RoutedExperts, shared_experts: MLP):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    def route(self, tokens: Tensor, step: "StepInputs") -> tuple[Tensor, Tensor]:
        """Combine weights [T, K] and expert ids [T, K] of tokens [T, D]."""
        return self.gate(tokens)

    def forward(self, x: Tensor, step: "StepInputs") -> Tensor:
        """x [B, Q, D] -> [B, Q, D]."""
        parallel, experts = step.parallel, self.experts.n_routed_experts
        tokens = x.reshape(-1, x.shape[-1])  # [T, D]
        if parallel.moe_exchange in ("local", "static"):
            # The EP group (if any) already shares these tokens: each rank adds its experts' share.
            weights, ids = self.route(tokens, step)  # [T, K]
            ids, weights = moe.expert_routes(ids, weights, experts, parallel.expert_shard(), parallel.ep)
            routed = self.experts(tokens, weights, ids, self._form(tokens, step))  # [T, D]
            tp = self.shared_experts.tp
            if shared_experts_reduced_with_routed(parallel.moe_exchange, parallel.ep, tp):
                shared = self.shared_experts.partial(tokens)
                if parallel.ep > tp:  # the group's other cp coordinates hold copies of this partial
                    shared = shared * contributes_shared_partial(parallel.kv_shard(), parallel.ep, tp).to(shared.dtype)
                return collectives.all_reduce(routed + shared, "ep").view_as(x)
            if parallel.moe_exchange == "static":
                routed = collectives.all_reduce(routed, "ep")
        elif parallel.moe_exchange == "ag_rs":
            # Route after an all-gather, so every rank routes the tokens it computes on.
            dispatched = collectives.moe_dispatch(tokens, "ep", parallel.ep)  # [T * ep, D]
            weights, ids = self.route(dispatched, step)  # [T * ep, K]
            ids, weights = moe.expert_routes(ids, weights, experts, parallel.expert_shard(), parallel.ep)
            partial = self.experts(dispatched, weights, ids, self._form(dispatched, step))  # [T * ep, D]
            routed = collectives.moe_combine(partial, "ep", parallel.ep)  # [T, D]
        else:
            # Route once at the source; each token travels only to its experts' ranks (padding nowhere).
            weights, ids = self.route(tokens, step)  # [T, K]
            valid = step.slot_mapping.reshape(-1) != PADDING_SLOT  # [T]
            rows, ids, weights, sent, received = all_to_all.moe_a2a_dispatch(
                tokens, ids, weights, valid, experts, "ep", parallel.ep, parallel.moe_exchange)  # [T * ep, ...]
            partial = self.experts(rows, weights, ids, self._form(rows, step))  # [T * ep, D]
            routed = all_to_all.moe_a2a_combine(partial, sent, received, "ep", parallel.ep, parallel.moe_exchange)
        return (routed + self.shared_experts(tokens)).view_as(x)

    def _form(self, rows: Tensor, step: "StepInputs") -> str:
        """The step's routed-expert form: fixed by the caller, or chosen by `moe_form_for`."""
        return step.moe_form or moe_form_for(rows.shape[0], self.gate.top_k, self.experts.local_experts)


