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

Tensor parallelism (`tp` ranks per replica and cp coordinate) is a construction choice, as the
expert shard is: a rank's module holds H / tp attention heads (their q and kv up-projection rows
and o_proj columns; the latent KV, shared by every head, whole), G / tp indexer heads, 1 / tp of
each dense and shared FFN width, D / tp of the embedding's columns and V / tp of the LM head's
rows. Where a split axis is reduced the module calls the group op over "tp" (`layers.row_parallel`
after o_proj and each FFN, an all-reduce of the indexer's head-summed scores before its top-k,
`layers.gather_over_tp` for the embedding and the logits); at tp = 1 the module is the one-device
module and calls none.

Shape letters: B rows, Q tokens per row, T = B*Q tokens, D hidden, H heads, R kv_lora_rank,
P qk_rope_head_dim, C = R + P (+ J under sparse attention), E routed experts, K experts per
token, I expert width, V vocab, L layers, N pool blocks, S block size, M blocks per row, G indexer
heads, J indexer head width, k keys selected per query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.models.deepseek_v3.args import V3Args
from graphc.models.layers import (MLP, MoE, RMSNorm, RotaryEmbedding, RoutedExperts, gather_over_tp, rotate,
                                  row_parallel)
from graphc.models.moe_forms import MOE_FORMS
from graphc.models.step_model import Parallelism, StepInputs
from graphc.ops import collectives, paged_attention, sparse
from graphc.step import kv_pool_shape

SPARSE_PROBABILITIES = ("bf16", "fp32")
"""Precision of P in sparse attention's P @ V: FlashMLA's bf16 rounding, or the reference's fp32."""

LATENT_NORM_EPS = 1e-6
"""The q and kv LoRA norms use a fixed eps, not `rms_norm_eps` (DeepSeek and transformers alike)."""

INDEXER_NORM_EPS = 1e-6
"""The indexer key's LayerNorm eps (fixed in DeepSeek-V3.2 and transformers)."""


def tensor_parallel_widths(args: V3Args) -> dict[str, int]:
    """What tensor parallelism splits, by config.json field: tp must divide each."""
    widths = {"num_attention_heads": args.num_attention_heads, "hidden_size": args.hidden_size,
              "vocab_size": args.vocab_size}
    if args.first_k_dense_replace:
        widths["intermediate_size"] = args.intermediate_size
    if args.first_k_dense_replace < args.num_hidden_layers:
        widths["moe_intermediate_size * n_shared_experts"] = args.moe_intermediate_size * args.n_shared_experts
    if args.sparse_attention:
        widths["index_n_heads"] = args.index_n_heads
    return widths


class Router(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k (DeepSeek-V3's auxiliary-loss-free routing)."""

    def __init__(self, args: V3Args):
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


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: picks the keys each query's sparse attention reads.

    Its key (one per token, J wide, cached after the MLA part of the slot) is LayerNorm(W_k x)
    with its first P dims roped in the half-split layout; its G query heads come from the q
    latent. A key's score is sum over heads of w_g * relu(q_g . k / sqrt(J)), w = W_w x / sqrt(G)
    in fp32. (DeepSeek's kernel also rotates q and k by a Hadamard transform, which preserves the
    dot products, and quantises them to FP8; like transformers, graphc scores in full precision.)
    """

    def __init__(self, args: V3Args, layer: int, tp: int = 1):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.heads, self.head_dim, self.topk = args.index_n_heads // tp, args.index_head_dim, args.index_topk
        self.head_weight_scale = args.index_n_heads**-0.5  # over every head, wherever they are held
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
        head_weights = (self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
                        * self.head_weight_scale)  # [B, Q, G]
        parallel, block_size = step.parallel, step.kv_pool.shape[2]
        logits = sparse.paged_indexer_logits(
            q, head_weights, step.kv_pool, self.layer, step.block_table, step.positions, self.key_offset,
            self.head_dim**-0.5, parallel.kv_shard(), parallel.cp,
        )  # [B, Q, K] this shard's keys, summed over this rank's heads
        if self.tp > 1:
            logits = collectives.all_reduce(logits, "tp")  # over every head
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

    def __init__(self, args: V3Args, layer: int, rotary: RotaryEmbedding, sparse_probabilities: str = "fp32",
                 tp: int = 1):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.rotary = rotary
        self.num_heads = args.num_attention_heads // tp  # this rank's
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
            self.indexer = Indexer(args, layer, tp)
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
        return row_parallel(self.o_proj, out.reshape(rows, width, self.num_heads * self.v_dim), self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, args: V3Args, layer: int, rotary: RotaryEmbedding, local_experts: int | None = None,
                 sparse_probabilities: str = "fp32", tp: int = 1):
        super().__init__()
        self.self_attn = Attention(args, layer, rotary, sparse_probabilities, tp)
        if args.is_moe_layer(layer):
            shared = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, tp=tp)
            self.mlp = MoE(Router(args), RoutedExperts(args, local_experts), shared)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, tp=tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: "StepInputs") -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, step) if isinstance(self.mlp, MoE) else self.mlp(h))


class MultiTokenPredictionLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction (MTP) module (its report, section 2.2), stored as
    decoder layer `num_hidden_layers`: at position i it takes the main model's final hidden state
    h_i and the embedding of token i + 1, each RMS-normed, projects them back to the hidden size
    (`eh_proj`), runs its decoder layer at position i (its own KV in pool layer
    `num_hidden_layers`) and predicts token i + 2 through its own norm and the main model's head
    (which it shares, as the embedding; the release stores copies that loaders skip). As vLLM and
    SGLang feed it, h_i is taken after the main model's final norm."""

    def __init__(self, args: V3Args, layer: int, rotary: RotaryEmbedding, local_experts: int | None = None,
                 sparse_probabilities: str = "fp32", tp: int = 1):
        super().__init__(args, layer, rotary, local_experts, sparse_probabilities, tp)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def predict(self, hidden: Tensor, next_embedded: Tensor, cos: Tensor, sin: Tensor, step: "StepInputs") -> Tensor:
        """hidden, next_embedded [B, Q, D] -> the module's output [B, Q, D] (before its head's norm);
        writes its KV for the step's slots."""
        x = self.eh_proj(torch.cat([self.enorm(next_embedded), self.hnorm(hidden)], dim=-1))
        return self(x, cos, sin, step)


class Backbone(nn.Module):
    """Embedding, decoder layers (the served MTP layer after them) and final norm (HF's `model.` prefix)."""

    def __init__(self, args: V3Args, local_experts: int | None = None, sparse_probabilities: str = "fp32",
                 tp: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size // tp)  # this rank's columns
        self.rotary_emb = RotaryEmbedding(args.rope, args.qk_rope_head_dim)
        self.layers = nn.ModuleList(
            [DecoderLayer(args, i, self.rotary_emb, local_experts, sparse_probabilities, tp)
             for i in range(args.num_hidden_layers)]
            + [MultiTokenPredictionLayer(args, args.num_hidden_layers + i, self.rotary_emb, local_experts,
                                         sparse_probabilities, tp) for i in range(args.draft_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekV3(nn.Module):
    """DeepSeek-V3 causal LM over a paged KV pool; one call is one step."""

    def __init__(self, args: V3Args, local_experts: int | None = None, sparse_probabilities: str = "fp32",
                 tp: int = 1):
        """`local_experts`: routed experts this rank holds (all of them by default).
        `sparse_probabilities`: one of SPARSE_PROBABILITIES, for sparse attention (V3.2).
        `tp`: tensor-parallel ranks the module is one of (dividing each of `tensor_parallel_widths`,
        which the family record checks)."""
        super().__init__()
        if sparse_probabilities not in SPARSE_PROBABILITIES:
            raise ValueError(f"sparse_probabilities {sparse_probabilities!r}; expected one of {SPARSE_PROBABILITIES}")
        self.args, self.tp = args, tp
        self.sparse_probabilities = sparse_probabilities
        self.model = Backbone(args, local_experts, sparse_probabilities, tp)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size // tp, bias=False)  # this rank's vocabulary

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, Q] token ids -> the first layer's input [B, Q, D]."""
        return gather_over_tp(self.model.embed_tokens(input_ids), self.tp)

    def layer_rope(self, layer: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, Q, P/2] of `positions` as layer `layer` takes them (every layer alike)."""
        return self.model.rotary_emb(positions, dtype)

    def new_kv_pool(self, num_blocks: int, block_size: int) -> Tensor:
        """A zeroed pool [L, N, S, C] in the model dtype."""
        shape = kv_pool_shape(self.args.cache_layers, num_blocks, block_size, self.args.kv_cache_dim)
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
        x = self.decoder_layers(input_ids, step)  # [B, Q, D]
        if logits_index is not None:
            x = x.gather(1, logits_index.view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)  # [B, D]
        return self.logits(self.model.norm(x))

    def decoder_layers(self, input_ids: Tensor, step: StepInputs) -> Tensor:
        """[B, Q] tokens -> the last main layer's output [B, Q, D] (before the final norm)."""
        x = self.embed(input_ids)  # [B, Q, D]
        cos, sin = self.model.rotary_emb(step.positions, x.dtype)  # [B, Q, P/2]
        for layer in self.model.layers[: self.args.num_hidden_layers]:
            x = layer(x, cos, sin, step)
        return x

    def final_hidden(self, input_ids: Tensor, step: StepInputs) -> Tensor:
        """[B, Q] tokens -> the main model's final hidden states [B, Q, D], after its final norm
        (the head's input, and the MTP layer's)."""
        return self.model.norm(self.decoder_layers(input_ids, step))

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states [..., D] -> logits [..., V]."""
        return gather_over_tp(self.lm_head(hidden), self.tp)

    def draft_hidden(self, hidden: Tensor, next_ids: Tensor, step: StepInputs) -> Tensor:
        """The MTP layer at the step's positions: `hidden` [B, Q, D] (position i's final hidden
        state, or the MTP layer's own output when drafting further ahead) and `next_ids` [B, Q]
        (token i + 1) -> its output [B, Q, D]; writes its KV."""
        mtp = self.model.layers[self.args.num_hidden_layers]
        cos, sin = self.model.rotary_emb(step.positions, hidden.dtype)
        return mtp.predict(hidden, self.embed(next_ids), cos, sin, step)

    def draft_logits(self, drafted: Tensor) -> Tensor:
        """The MTP layer's output [..., D] -> its logits for the token after next [..., V]."""
        return self.logits(self.model.layers[self.args.num_hidden_layers].shared_head.norm(drafted))
