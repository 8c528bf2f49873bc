"""DeepSeek-V3 and V3.2 on one device, over a paged KV cache.

Every forward is one *step* in a uniform layout: B rows (sequences) of Q tokens each. A prefill
chunk is B = 1, Q = chunk; a decode step is B = batch, Q = 1. Each token carries its absolute
position and the flat pool slot its KV goes to (`PADDING_SLOT` for padding); each row carries
the block table of its sequence. The parallel-sensitive places (KV write, attention over the
cache, MoE dispatch/combine) are `graphc::` ops, so the module never imports `torch.distributed`.

Parameter names are the HF checkpoint names, except the routed experts, which are stacked into
[E, ...] tensors (see `checkpoint.py`).

DeepSeek-V3.2 (`args.sparse_attention`) adds a lightning indexer to every attention layer: it
caches one key per token beside the MLA latent, scores every visible key for each query, and MLA
attends only to each query's top `index_topk` keys (`graphc.ops.sparse`).

Shape letters: B rows, Q tokens per row, T = B*Q tokens, D hidden, H heads, R kv_lora_rank,
P qk_rope_head_dim, C = R + P (+ J under sparse attention), E routed experts, K experts per
token, I expert width, V vocab, L layers, N pool blocks, S block size, M blocks per row, G indexer
heads, J indexer head width, k keys selected per query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.models.args import ModelArgs, RopeArgs, yarn_mscale
from graphc.models.moe_forms import MOE_FORMS, moe_form_for
from graphc.ops import all_to_all, collectives, moe, paged_attention, sparse
from graphc.step import PADDING_SLOT

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "self_attn.indexer.weights_proj.weight")
"""Parameters that stay fp32 whatever the model dtype, as DeepSeek (and transformers) keep them:
the router, and the indexer's per-head weights."""

SPARSE_PROBABILITIES = ("bf16", "fp32")
"""Precision of P in sparse attention's P @ V: FlashMLA's bf16 rounding, or the reference's fp32."""

LATENT_NORM_EPS = 1e-6
"""The q and kv LoRA norms use a fixed eps, not `rms_norm_eps` (DeepSeek and transformers alike)."""

INDEXER_NORM_EPS = 1e-6
"""The indexer key's LayerNorm eps (fixed in DeepSeek-V3.2 and transformers)."""


@dataclass(frozen=True)
class Parallelism:
    """How this rank's step relates to the other ranks' (the defaults are one device).

    Numbers and, in a step graph, the rank's coordinates as tensors: the module never touches
    torch.distributed; the graphc ops it calls do.
    """

    cp_rank: int | Tensor = 0
    """This rank's shard of every sequence's KV blocks (block j lives on rank j % cp). In a step
    graph, a 0-d int32 slice of the step's `coordinates` input: one graph serves every rank."""
    cp: int = 1
    """Context-parallel ranks."""
    ep_rank: int | Tensor = 0
    """This rank's position in its expert-parallel group: it holds experts
    [ep_rank * E / ep, (ep_rank + 1) * E / ep). A tensor in a step graph, as `cp_rank`."""
    ep: int = 1
    """Expert-parallel group size."""
    moe_exchange: str = "local"
    """How tokens reach their experts' ranks (`graphc.models.moe_forms.MOE_EXCHANGES`): `static`
    when every rank of the EP group holds the same tokens (compute this rank's experts on its own
    tokens, then all-reduce); `ag_rs` gathers the group's tokens first and reduce-scatters after;
    `a2a_even` / `a2a_v` route at the source and send each token only to its experts' ranks."""

    def kv_shard(self) -> Tensor:
        """`cp_rank` as the ops take it (a 0-d int32 tensor)."""
        return torch.as_tensor(self.cp_rank, dtype=torch.int32)

    def expert_shard(self) -> Tensor:
        """`ep_rank` as the ops take it (a 0-d int32 tensor)."""
        return torch.as_tensor(self.ep_rank, dtype=torch.int32)


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


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and the shared experts."""

    def __init__(self, dim: int, hidden: int, swiglu_limit: float | None = None, fp32_activation: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.swiglu_limit = swiglu_limit
        self.fp32_activation = fp32_activation
        """SwiGLU in fp32, rounded once (DeepSeek-V4.1's order); else in the model dtype."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fp32_activation:
            return self.down_proj(swiglu(gate.float(), up.float(), self.swiglu_limit).to(x.dtype))
        return self.down_proj(swiglu(gate, up, self.swiglu_limit))


class Router(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k (DeepSeek-V3's auxiliary-loss-free routing)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts))
        self.top_k = args.num_experts_per_tok
        self.n_group = args.n_group
        self.topk_group = args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Route tokens x [T, D].

        Returns:
            weights: [T, K] fp32 combine weights of the chosen experts.
            ids: [T, K] the chosen experts.
        """
        tokens = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        # The correction bias steers *which* experts are chosen, never how much they weigh.
        choice = scores + self.e_score_correction_bias  # [T, E]
        grouped = choice.view(tokens, self.n_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        top_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter(1, top_groups, 1.0).bool()  # [T, G]
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, -1)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, K]
        weights = scores.gather(1, ids)  # [T, K]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


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
            gate, up = moe.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offsets).split(width, dim=-1)  # [M, I]
            hidden = (self._weighed(gate, up, weights.reshape(-1)[order]) if self.weigh_before_down
                      else swiglu(gate, up, self.swiglu_limit))
            out = moe.grouped_mm(hidden, self.down_proj.transpose(1, 2), offsets)  # [M, D]; 0 off-shard
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


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: picks the keys each query's sparse attention reads.

    Its key (one per token, J wide, cached after the MLA part of the slot) is LayerNorm(W_k x)
    with its first P dims roped in the half-split layout; its G query heads come from the q
    latent. A key's score is sum over heads of w_g * relu(q_g . k / sqrt(J)), w = W_w x / sqrt(G)
    in fp32. (DeepSeek's kernel also rotates q and k by a Hadamard transform, which preserves the
    dot products, and quantises them to FP8; like transformers, graphc scores in full precision.)
    """

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.rope_dim = args.qk_rope_head_dim
        self.key_offset = args.kv_lora_rank + args.qk_rope_head_dim  # where its key sits in a cached slot
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        roped, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([rotate(roped, cos, sin, interleave=False), rest], dim=-1)

    def key(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, Q, D] -> the tokens' indexer keys [B, Q, J], to cache."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def select(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor, step: "StepInputs") -> Tensor:
        """Each query's top-k visible keys, over the whole context-parallel group.

        Args:
            x: [B, Q, D] the layer's normalised input.
            q_latent: [B, Q, q_lora_rank] the normalised q LoRA latent.

        Returns:
            [B, Q, k] absolute key positions, best first (`sparse.NO_KEY` padding).
        """
        rows, width = x.shape[:2]
        q = self._rope(self.wq_b(q_latent).view(rows, width, self.heads, self.head_dim),
                       cos[:, :, None], sin[:, :, None])  # [B, Q, G, J]
        head_weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5  # [B, Q, G]
        parallel, block_size = step.parallel, step.kv_pool.shape[2]
        logits = sparse.paged_indexer_logits(
            q, head_weights, step.kv_pool, self.layer, step.block_table, step.positions, self.key_offset,
            self.head_dim**-0.5, parallel.kv_shard(), parallel.cp,
        )  # [B, Q, K] this shard's keys
        # A static width: the bucket's block table bounds the context.
        k = min(self.topk, step.block_table.shape[1] * block_size)
        positions, scores = sparse.index_candidates(logits, k, block_size, parallel.kv_shard(), parallel.cp)
        return sparse.index_topk_combine(positions, scores, "cp")  # [B, Q, k] the group's top-k


class Attention(nn.Module):
    """Multi-head latent attention in DeepSeek's absorbed form over the paged latent cache.

    The cache holds, per token, the normalised KV latent [R] and the roped shared key [P] (then,
    under sparse attention, the indexer's key [J]). The key up-projection W_uk is folded into the
    query and the value up-projection W_uv applied after attention, so keys and values are never
    expanded per head.
    """

    def __init__(self, args: ModelArgs, layer: int, rotary: RotaryEmbedding, sparse_probabilities: str = "fp32"):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.num_heads = args.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        q_width = self.num_heads * args.qk_head_dim
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, args.kv_lora_rank + self.rope_dim, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, args.hidden_size, bias=args.attention_bias)
        if args.sparse_attention:
            self.indexer = Indexer(args, layer)
            self.bf16_probabilities = sparse_probabilities == "bf16"

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: "StepInputs") -> Tensor:
        """x [B, Q, D] -> [B, Q, D]; writes this layer's KV for the step's tokens first."""
        rows, width = x.shape[:2]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_lora = self.q_a_layernorm(self.q_a_proj(x))  # [B, Q, q_lora_rank]
            q = self.q_b_proj(q_lora)
        q = q.view(rows, width, self.num_heads, -1)  # [B, Q, H, nope + P]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = self.rotary.apply(q_rope, cos[:, :, None], sin[:, :, None])  # [B, Q, H, P]

        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, Q, R]
        k_rope = self.rotary.apply(k_rope, cos, sin)  # [B, Q, P]
        cached = [latent, k_rope] + ([self.indexer.key(x, cos, sin)] if hasattr(self, "indexer") else [])
        paged_attention.kv_write(step.kv_pool, self.layer, torch.cat(cached, dim=-1), step.slot_mapping)  # [B, Q, C]

        kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = kv_b.split([self.nope_dim, self.v_dim], dim=1)  # [H, nope, R], [H, V, R]
        # The absorbed projections run in fp32: in bf16 they would round the latent query and the
        # latent output, two roundings the unabsorbed form does not have.
        q_latent = torch.einsum("bqhn,hnr->bqhr", q_nope.float(), w_uk.float())  # [B, Q, H, R]
        parallel = step.parallel
        if hasattr(self, "indexer"):
            selected = self.indexer.select(x, q_lora, cos, sin, step)  # [B, Q, k]
            out_latent, lse = sparse.sparse_mla_attention(
                q_latent, q_rope, step.kv_pool, self.layer, step.block_table, step.positions, selected,
                self.softmax_scale, self.bf16_probabilities, parallel.kv_shard(), parallel.cp,
            )  # [B, Q, H, R] fp32, [B, Q, H]
        else:
            out_latent, lse = paged_attention.paged_mla_attention(
                q_latent, q_rope, step.kv_pool, self.layer, step.block_table, step.positions, self.softmax_scale,
                parallel.kv_shard(), parallel.cp,
            )  # [B, Q, H, R] fp32, [B, Q, H]
        out_latent = collectives.attention_combine(out_latent, lse, "cp")  # the CP group's shards, combined
        out = torch.einsum("bqhr,hvr->bqhv", out_latent, w_uv.float()).to(x.dtype)  # [B, Q, H, V]
        return self.o_proj(out.reshape(rows, width, self.num_heads * self.v_dim))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, rotary: RotaryEmbedding, local_experts: int | None = None,
                 sparse_probabilities: str = "fp32"):
        super().__init__()
        self.self_attn = Attention(args, layer, rotary, sparse_probabilities)
        if args.is_moe_layer(layer):
            shared = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
            self.mlp = MoE(Router(args), RoutedExperts(args, local_experts), shared)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: "StepInputs") -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, step) if isinstance(self.mlp, MoE) else self.mlp(h))


class StepInputs:
    """The host metadata of one step (a plain holder so layer signatures stay short).

    Attributes:
        positions: [B, Q] int64 absolute position of each token.
        block_table: [B, M] int32/int64 pool blocks of each row's sequence.
        slot_mapping: [B, Q] int64 flat pool slot per token, `PADDING_SLOT` for padding.
        kv_pool: [L, N, S, C] the paged cache, written in place.
        parallel: this rank's place among the others.
        moe_form: the routed experts' form (one of `MOE_FORMS`), or None for `moe_form_for`'s.
        input_ids: [B, Q] the tokens (DeepSeek-V4's hash-routed layers choose experts by them).
    """

    def __init__(self, positions: Tensor, block_table: Tensor, slot_mapping: Tensor, kv_pool: Tensor,
                 parallel: Parallelism, moe_form: str | None = None, input_ids: Tensor | None = None):
        self.positions = positions
        self.block_table = block_table
        self.slot_mapping = slot_mapping
        self.kv_pool = kv_pool
        self.parallel = parallel
        self.moe_form = moe_form
        self.input_ids = input_ids


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, args: ModelArgs, local_experts: int | None = None, sparse_probabilities: str = "fp32"):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rotary_emb = RotaryEmbedding(args.rope, args.qk_rope_head_dim)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.rotary_emb, local_experts, sparse_probabilities)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekV3(nn.Module):
    """DeepSeek-V3 causal LM over a paged KV pool; one call is one step."""

    def __init__(self, args: ModelArgs, local_experts: int | None = None, sparse_probabilities: str = "fp32"):
        """`local_experts`: routed experts this rank holds (all of them by default).
        `sparse_probabilities`: one of SPARSE_PROBABILITIES, for sparse attention (V3.2)."""
        super().__init__()
        if sparse_probabilities not in SPARSE_PROBABILITIES:
            raise ValueError(f"sparse_probabilities {sparse_probabilities!r}; expected one of {SPARSE_PROBABILITIES}")
        self.args = args
        self.sparse_probabilities = sparse_probabilities
        self.model = Backbone(args, local_experts, sparse_probabilities)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, Q] token ids -> the first layer's input [B, Q, D]."""
        return self.model.embed_tokens(input_ids)

    def layer_rope(self, layer: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, Q, P/2] of `positions` as layer `layer` takes them (every layer alike)."""
        return self.model.rotary_emb(positions, dtype)

    def new_kv_pool(self, num_blocks: int, block_size: int) -> Tensor:
        """A zeroed pool [L, N, S, C] in the model dtype."""
        args = self.args
        shape = (args.num_hidden_layers, num_blocks, block_size, args.kv_cache_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.model.embed_tokens.weight.device)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        block_table: Tensor,
        slot_mapping: Tensor,
        kv_pool: Tensor,
        logits_index: Tensor | None = None,
        parallel: Parallelism = Parallelism(),
        moe_form: str | None = None,
    ) -> Tensor:
        """One step.

        Args:
            input_ids: [B, Q] token ids.
            positions, block_table, slot_mapping, kv_pool: see `StepInputs`.
            logits_index: [B] which token of each row to compute logits for (its last real one);
                None computes logits for every token.
            parallel: this rank's place among the others (one device by default).
            moe_form: the routed experts' form (`MOE_FORMS`); by default `moe_form_for` picks
                the cheapest for the step's size (the compiler fixes it per bucket).

        Returns:
            [B, V] logits, or [B, Q, V] when `logits_index` is None.
        """
        if moe_form is not None and moe_form not in MOE_FORMS:
            raise ValueError(f"moe_form {moe_form!r}; expected one of {MOE_FORMS}")
        step = StepInputs(positions, block_table, slot_mapping, kv_pool, parallel, moe_form)
        x = self.embed(input_ids)  # [B, Q, D]
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # [B, Q, P/2]
        for layer in self.model.layers:
            x = layer(x, cos, sin, step)
        if logits_index is not None:
            x = x.gather(1, logits_index.view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)  # [B, D]
        return self.lm_head(self.model.norm(x))
