"""DeepSeek-V4.1 over a paged cache, in graphc's step layout: what `graphc compile` captures. Its
oracle is the eager `reference.py` (the equations are documented there); this module
computes the same per step, over the paged pool, under context and expert parallelism.

The cache: a pool [2L (+ 1), N, S, C] addressed through each row's block table as for V4
(`deepseek_v4/model.CacheView`). Model layer i owns two pool layers:
- 2i, the token cache: every token's K = V [head_dim] (the sliding window reads it), then, in a
  KV source that pools (rate r >= 2), its compressor's raw kv and gate projections [2 head_dim]:
  the partial windows, pooled by the step whose token closes the window.
- 2i + 1, a KV source's entry cache: at the slot of the token closing entry j (position
  (j + 1) r - 1), entry j [head_dim] then its index key [index_head_dim]. Layers that reuse the
  source read it there.
With Engram, pool layer 2L holds every token's id as 3 base-256 digits (exact in any dtype):
a token's n-gram context is the N - 1 tokens before it, wherever a chunk or a decode step starts,
and under context parallelism the positions another shard holds arrive by one all-reduce (the
left halo). Within a step the index layers' selections and the candidate blocks pass from layer
to layer as the reference publishes them; under context parallelism each shard scores the entries
it holds, the candidate blocks' scores meet in an all-reduce(max), and the top-k in
`index_topk_combine` (as V4's CSA).

Routed experts, shared expert and router are V3's / V4's modules (`layout.py` maps the names),
in V4.1's arithmetic order (SwiGLU in fp32, the route weight before the down projection; the
routed sum is rounded once before the shared expert's output adds, where V4.1 adds both in
fp32). Engram tables shard over the expert-parallel group with the experts (`engram`).
Tensor parallelism splits what V4's does (`deepseek_v4/model.py`): a rank holds heads / tp query
heads and sinks, o_groups / tp output groups (all-reduced over "tp"), the index layers' indexer
heads / tp (their scores all-reduced before the candidate blocks and the top-k), 1 / tp of the
shared expert, the embedding's columns and the LM head's rows; Engram and the compressors whole.

Shape letters as in `deepseek_v4/model.py`; r a layer's compress ratio, k = index_topk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.models.deepseek_v4.model import (CacheView, DeepseekV4, FP32RMSNorm, Router, cast, fp32, partial_attention,
                                             partial_softmax, rotate_trailing, window_keys, write)
from graphc.models.deepseek_v41 import reference
from graphc.models.deepseek_v41.args import TOKEN_ID_DIGITS, V41Args
from graphc.models.deepseek_v41.engram import Engram
from graphc.models.deepseek_v41.reference import Published, collapse, expand, stream_mixes
from graphc.models.layers import MLP, MoE, RotaryEmbedding, RoutedExperts, gather_over_tp
from graphc.models.moe_forms import MOE_FORMS
from graphc.models.step_model import Parallelism, StepInputs
from graphc.ops import collectives, hyper_connections, sparse


def tensor_parallel_widths(args: V41Args) -> dict[str, int]:
    """What tensor parallelism splits, by config.json field: tp must divide each."""
    widths = {"num_attention_heads": args.num_attention_heads, "o_groups": args.o_groups,
              "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
              "moe_intermediate_size": args.moe_intermediate_size}
    if args.index_source_layer_ids:
        widths["index_n_heads"] = args.index_n_heads
    return widths


class Compressor(reference.Compressor):
    """The reference's compressor, pooling over the paged cache."""

    def token_state(self, x: Tensor) -> Tensor:
        """[B, Q, 2 d]: each token's fp32 kv and gate projections (pooling sources only)."""
        return torch.cat([F.linear(fp32(x), fp32(self.wkv.weight)), F.linear(fp32(x), fp32(self.wgate.weight))], -1)

    def latent(self, x: Tensor, cache: CacheView, layer: int, positions: Tensor) -> Tensor:
        """[B, Q, d] the pre-RoPE latent of the entry each token closes (garbage where it closes
        none): rate 1, the token's own RMSNorm(W x); else the softmax pool of the window's cached
        projections, each shard pooling what it holds and the shares combined over the CP group."""
        if self.ratio == 1:
            return self.norm(F.linear(x, self.wkv.weight))
        width = self.wkv.weight.shape[0]
        window = positions[..., None] - self.ratio + 1 + torch.arange(self.ratio, device=positions.device)
        state, here = cache.read(layer, window, slice(width, 3 * width))  # [B, Q, r, 2 d]
        kv, gate = fp32(state).chunk(2, dim=-1)
        weights, lse = partial_softmax(gate.masked_fill(~here[..., None], float("-inf")), dim=-2)
        pooled = collectives.attention_combine((kv * weights).sum(dim=-2)[..., None], lse, "cp")[..., 0]
        return self.norm(cast(pooled, x.dtype))


class Attention(reference.Attention):
    """Shared-KV multi-query attention over the sliding window and, in compressed layers, the
    entries the layer's index source selected, with a per-head sink (the reference's parameters;
    its RoPE module ropes the entries)."""

    compressor_type = Compressor

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: StepInputs, published: Published) -> Tensor:
        """x [B, Q, D] -> [B, Q, D]; writes the step's token (and entry) states first."""
        rows, width = x.shape[:2]
        q_latent = self.q_norm(F.linear(x, self.wq_a.weight))
        q = F.linear(q_latent, self.wq_b.weight).view(rows, width, self.heads, self.head_dim)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None])  # [B, Q, H, d]
        kv = rotate_trailing(self.kv_norm(F.linear(x, self.wkv.weight)), cos, sin)  # [B, Q, d]
        cache = CacheView(step)
        pools = hasattr(self, "compressor") and self.ratio > 1
        write(step, 2 * self.layer, torch.cat([kv, self.compressor.token_state(x)], dim=-1) if pools else kv)
        key_sets = [window_keys(cache, 2 * self.layer, step.positions, self.args.sliding_window, self.head_dim)]
        if self.ratio:
            if hasattr(self, "compressor"):
                write(step, 2 * self.layer + 1, self._entries(x, cache, step.positions))
            entry_layer = 2 * self.args.kv_source(self.layer) + 1
            if hasattr(self, "indexer"):
                published.selection[self.ratio] = self._select(x, q_latent, cos, sin, cache, entry_layer, published)
            chosen = published.selection[self.ratio]  # [B, Q, k] closing positions
            entries, here = cache.read(entry_layer, chosen, slice(0, self.head_dim))  # [B, Q, k, d]
            key_sets.append((entries, here & (chosen != sparse.NO_KEY)))
        return self.output(*partial_attention(q, key_sets, self.attn_sink, cache.shard), cos, sin, x.dtype)

    def output(self, out: Tensor, lse: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> Tensor:
        """This shard's share of the heads' outputs [B, Q, H, d] and its lse [B, Q, H] (fp32) ->
        the layer's output [B, Q, D]: the CP group's shares combined, the values' rotation undone,
        the grouped low-rank projection (row-parallel over the tp group)."""
        rows, width = out.shape[:2]
        out = collectives.attention_combine(out, lse, "cp")
        out = rotate_trailing(cast(out, dtype), cos[:, :, None], -sin[:, :, None])  # undo the values' rotation
        grouped = out.reshape(rows, width, self.groups, -1)  # [B, Q, g, H d / g]
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [g, o_lora, H d / g]
        out = F.linear(torch.einsum("bqgi,goi->bqgo", grouped, weight).flatten(2), self.wo_b.weight)
        return collectives.all_reduce(out, "tp") if self.tp > 1 else out  # row-parallel over the tp group

    def _entries(self, x: Tensor, cache: CacheView, positions: Tensor) -> Tensor:
        """[B, Q, d + J] the entry each token closes and its index key, roped at the entry's first
        position."""
        latent = self.compressor.latent(x, cache, 2 * self.layer, positions)
        cos, sin = self.rotary(positions + 1 - self.ratio, torch.float32)
        keys = self.indexer.keys(latent)
        return torch.cat([rotate_trailing(latent, cos, sin), rotate_trailing(keys, cos, sin)], dim=-1)

    def _select(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor, cache: CacheView, entry_layer: int,
                published: Published) -> Tensor:
        """[B, Q, k] the closing positions of the entries each query's indexer keeps, over the CP
        group (`sparse.NO_KEY` where fewer are visible); the candidate layer publishes its blocks."""
        indexer, rows, width = self.indexer, x.shape[0], x.shape[1]
        entry_positions = (torch.arange(cache.capacity // self.ratio, device=x.device) + 1) * self.ratio - 1  # [E]
        keys, here = cache.read(entry_layer, entry_positions[None].expand(rows, -1),
                                slice(self.head_dim, self.head_dim + indexer.width))  # [B, E, J]
        scores = indexer.scores(x, q_latent, keys, cos, sin)  # [B, Q, E] over this rank's heads
        if self.tp > 1:
            scores = collectives.all_reduce(scores, "tp")  # over every head
        visible = here[:, None, :] & (entry_positions <= cache.positions[..., None])  # closed, on this shard
        scores = scores.masked_fill(~visible, float("-inf"))  # [B, Q, E]
        if self.layer == self.args.candidate_source_layer_id:
            published.candidates = self._candidate_blocks(scores, cache.positions)
        if self.args.uses_candidates(self.layer):
            scores = scores.masked_fill(~published.candidates, float("-inf"))
        candidates = entry_positions.expand(rows, width, -1)  # ascending, as the combine needs
        positions, best = sparse.top_by_score(candidates, scores, min(indexer.topk, scores.shape[-1]))
        return sparse.index_topk_combine(positions, best, "cp")

    def _candidate_blocks(self, scores: Tensor, positions: Tensor) -> Tensor:
        """[B, Q, E] whether each entry lies in one of a query's best blocks (a block scores its
        best visible entry over the CP group; the block of the newest visible entry always)."""
        size, entries = self.args.candidate_block_size, scores.shape[-1]
        count = -(-entries // size)
        padded = F.pad(scores, (0, count * size - entries), value=float("-inf"))
        best = collectives.all_reduce_max(padded.view(*scores.shape[:2], count, size).amax(dim=-1), "cp")
        visible = (positions + 1) // self.ratio  # [B, Q] entries each query sees
        newest = ((visible - 1).clamp(min=0) // size)[..., None]
        pinned = (torch.arange(count, device=scores.device) == newest) & (visible > 0)[..., None]
        best = torch.where(pinned, float("inf"), best)
        top = best.topk(min(self.args.candidate_topk_blocks, count), dim=-1)
        chosen = torch.zeros_like(best, dtype=torch.bool).scatter(-1, top.indices, top.values > float("-inf"))
        return chosen.repeat_interleave(size, dim=-1)[..., :entries]


class V41Router(Router):
    """V4's router with V4.1's temperature on the logits."""

    def __init__(self, args: V41Args):
        super().__init__(args)
        self.temperature = args.gate_temp

    def scores(self, x: Tensor) -> Tensor:
        return F.softplus(F.linear(fp32(x), fp32(self.weight)) / self.temperature).sqrt()  # [T, E]


class V41MoE(MoE):
    def __init__(self, args: V41Args, local_experts: int | None = None, tp: int = 1):
        nn.Module.__init__(self)
        self.gate = V41Router(args)
        self.experts = RoutedExperts(args, local_experts, swiglu_limit=args.swiglu_limit, weigh_before_down=True)
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size, swiglu_limit=args.swiglu_limit,
                                  fp32_activation=True, tp=tp)

    def route(self, tokens: Tensor, step: StepInputs) -> tuple[Tensor, Tensor]:
        return self.gate(tokens, None)


class DecoderLayer(nn.Module):
    def __init__(self, args: V41Args, layer: int, local_experts: int | None = None, tp: int = 1):
        super().__init__()
        self.args = args
        if args.engram is not None and layer in args.engram.layer_ids:
            shards = args.n_routed_experts // (local_experts or args.n_routed_experts)
            self.engram = Engram(args.engram, layer, args.hidden_size, args.hc_mult, args.rms_norm_eps, shards)
        self.attn_norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer, tp)
        self.ffn_norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = V41MoE(args, local_experts, tp)
        reference.add_stream_mix_parameters(self, args)
        self.rotary_kind = "compress" if args.compress_ratios[layer] else "main"

    def mixes(self, streams: Tensor, sublayer: str) -> tuple[Tensor, Tensor, Tensor]:
        return stream_mixes(streams, *(getattr(self, f"hc_{sublayer}_{part}") for part in ("fn", "base", "scale")),
                            self.args, hyper_connections.hc_sinkhorn)

    def forward(self, streams: Tensor, pre: Tensor, cos: Tensor, sin: Tensor, step: StepInputs,
                published: Published) -> tuple[Tensor, Tensor]:
        """streams [B, Q, n, D], the previous sublayer's pre -> streams, this layer's FFN's pre."""
        attn_pre, post, comb = self.mixes(streams, "attn")
        out = self.attn(self.attn_norm(collapse(streams, pre)), cos, sin, step, published)
        streams = expand(out, streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        out = self.mlp(self.ffn_norm(collapse(streams, attn_pre)), step)
        return expand(out, streams, post, comb), ffn_pre


class Backbone(nn.Module):
    def __init__(self, args: V41Args, local_experts: int | None = None, tp: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size // tp)  # this rank's columns
        self.rotary = nn.ModuleDict({"main": RotaryEmbedding(args.main_rope, args.rope_head_dim),
                                     "compress": RotaryEmbedding(args.compress_rope, args.rope_head_dim)})
        self.layers = nn.ModuleList(DecoderLayer(args, i, local_experts, tp) for i in range(args.num_hidden_layers))
        self.norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekV41(DeepseekV4):
    """DeepSeek-V4.1 causal LM over a paged pool; one call is one step (the signature of
    `DeepseekV3.forward`); V4's embedding into streams and pool ([2L (+ 1), N, S, C])."""

    def __init__(self, args: V41Args, local_experts: int | None = None, tp: int = 1):
        nn.Module.__init__(self)
        self.args, self.tp = args, tp
        self.model = Backbone(args, local_experts, tp)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size // tp, bias=False)  # this rank's vocabulary

    def layer_rope(self, layer: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, Q, P/2] of `positions` as layer `layer` takes them (fp32: V4.1 ropes in fp32)."""
        return self.model.rotary[self.model.layers[layer].rotary_kind](positions, torch.float32)

    def forward(self, input_ids: Tensor, positions: Tensor, block_table: Tensor, slot_mapping: Tensor,
                kv_pool: Tensor, logits_index: Tensor | None = None, parallel: Parallelism = Parallelism(),
                moe_form: str | None = None) -> Tensor:
        """One step; arguments and result as `DeepseekV3.forward`."""
        if moe_form is not None and moe_form not in MOE_FORMS:
            raise ValueError(f"moe_form {moe_form!r}; expected one of {MOE_FORMS}")
        step = StepInputs(positions, block_table, slot_mapping, kv_pool, parallel, moe_form, input_ids)
        streams, pre, _ = self.run_layers(step)
        if logits_index is not None:  # each row's one token: [B, 1, n, D] and [B, 1, n]
            index = logits_index.view(-1, 1)
            streams = streams.gather(1, index[..., None, None].expand(-1, 1, *streams.shape[2:]))
            pre = pre.gather(1, index[..., None].expand(-1, 1, pre.shape[-1]))
        logits = self._head(streams, pre)
        return logits[:, 0] if logits_index is not None else logits

    def run_layers(self, step: StepInputs) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The step's tokens (`step.input_ids`) -> the streams after the last layer [B, Q, n, D],
        the last FFN's pre-mix [B, Q, n] and, for DSpark (`dspark.py`), the fp32 stream means
        entering each of its target layers [B, Q, D]."""
        input_ids = step.input_ids
        streams = self.embed(input_ids)  # [B, Q, n, D]
        # Layer 0 reads stream 0 (a constant: F.one_hot would put run-time range checks in the graph).
        first_stream = torch.arange(self.args.hc_mult, device=input_ids.device) == 0
        pre = first_stream.float().expand(*input_ids.shape, -1)
        context = self._ngram_context(step) if self.args.engram is not None else None
        ropes = {kind: rotary(step.positions, torch.float32) for kind, rotary in self.model.rotary.items()}
        targets = self.args.dspark.target_layer_ids if self.args.draft_layers else ()
        published, captured = Published(), {}
        for i, layer in enumerate(self.model.layers):
            if hasattr(layer, "engram"):
                streams = layer.engram(streams, context, None, step.parallel.expert_shard(), step.parallel.ep,
                                       step.parallel.moe_exchange)
            if i in targets:
                captured[i] = fp32(streams).mean(dim=2)
            streams, pre = layer(streams, pre, *ropes[layer.rotary_kind], step, published)
        return streams, pre, [captured[i] for i in targets]  # in the config's order

    def _head(self, streams: Tensor, pre: Tensor) -> Tensor:
        return gather_over_tp(F.linear(fp32(self.model.norm(collapse(streams, pre))), fp32(self.lm_head.weight)),
                              self.tp)

    # Speculative decoding (`graphc.models.speculation`) sees a position's hidden state as one fp32
    # vector: its streams flattened [n D], the last FFN's pre-mix [n] (what the head collapses
    # them with) and, where DSpark drafts, the stream means entering its target layers [t D].

    def final_hidden(self, input_ids: Tensor, step: StepInputs) -> Tensor:
        """[B, Q] tokens -> their hidden states [B, Q, n D + n (+ t D)] (fp32)."""
        streams, pre, captured = self.run_layers(step.with_input_ids(input_ids))
        return torch.cat([fp32(streams).flatten(-2), pre, *captured], dim=-1)

    def logits(self, hidden: Tensor) -> Tensor:
        """Hidden states [..., n D + n (+ t D)] -> the main model's logits [..., V]."""
        n, width = self.args.hc_mult, self.args.hc_mult * self.args.hidden_size
        streams = hidden[..., :width].unflatten(-1, (n, -1)).to(self.dtype)
        return self._head(streams, hidden[..., width:width + n])

    def captured(self, hidden: Tensor) -> Tensor:
        """Hidden states -> the DSpark target layers' entering stream means, concatenated [..., t D]."""
        start = self.args.hc_mult * (self.args.hidden_size + 1)
        return hidden[..., start:].to(self.dtype)

    def _ngram_context(self, step: StepInputs) -> Tensor:
        """[B, Q, N] each token's n-gram context (the token, then the N - 1 before it; the pad id
        before the sequence start), from the token ids every step caches (pool layer 2L)."""
        engram, ids_layer = self.args.engram, 2 * self.args.num_hidden_layers
        ids = step.input_ids
        digits = torch.stack([ids // 65536, ids // 256 % 256, ids % 256], dim=-1)  # exact in any float dtype
        write(step, ids_layer, digits.to(step.kv_pool.dtype))
        context = step.positions[..., None] - torch.arange(engram.max_ngram, device=ids.device)  # [B, Q, N]
        cached, here = CacheView(step).read(ids_layer, context, slice(0, TOKEN_ID_DIGITS))  # [B, Q, N, 3]
        cached = collectives.all_reduce(torch.where(here[..., None], cached, 0), "cp")  # the halo other shards hold
        place = torch.tensor([65536, 256, 1], device=ids.device)
        tokens = (fp32(cached).round().long() * place).sum(-1)
        return torch.where(context >= 0, tokens, engram.pad_id)
