"""DeepSeek-V4.1's reference: an eager, single-process model of whole sequences, written from the
published equations in plain PyTorch (no paging, no parallelism, no graphc ops), so that graphc's
compiled V4.1 has an oracle: transformers has no V4.1. Readable first; its parameters carry the
released checkpoint's names, one module per stored tensor group.

The layer (see `args.py` for the configuration's roles):
- Engram (its layers only) adds gated n-gram memory into the residual streams first.
- mHC, single pass: each sublayer's input collapses the `hc_mult` streams with the `pre` weights
  the *previous* sublayer computed (layer 0's attention reads stream 0), and computes from its own
  input streams the `pre` the next sublayer will use, with its `post` / `comb` mixes; after the
  last layer the streams collapse with the last FFN's `pre` (no separate head mix).
- Attention: one shared K = V head (no per-head q norm), interleaved RoPE on the trailing
  `rope_head_dim` dims (undone on the output), a per-head sink logit in the softmax, a grouped
  low-rank output. Keys: the sliding window, and in compressed layers the entries the layer's
  index source selected. A KV-source layer's compressor pools each r consecutive tokens (r = 1:
  RMSNorm(W x); r >= 2: a per-channel softmax over the r tokens of fp32 W x weighted by fp32
  gates, then RMSNorm), ropes entry j at position j r, and entry j is visible from position
  (j + 1) r - 1 on. An index layer scores the visible entries, sum over heads of
  relu(q_h . k_j) w_h (keys RMSNorm(W_k latent) of the KV source's pre-RoPE latent, roped as the
  entries), and keeps the best `index_topk`; the candidate layer also keeps the best
  `candidate_topk_blocks` blocks of `candidate_block_size` entries (block score: its best entry;
  the block of a query's newest entry always), and later index layers choose among those only.
- MoE: sqrt(softplus(logits / gate_temp)) scores, the bias steering the top-k only, weights
  renormalised and scaled; clamped SwiGLU experts with the routing weight applied before the
  down projection; one shared expert.
- DSpark (with `draft_layers`): the stages under `mtp.` and `DeepseekV41Reference.draft`, a block
  of drafts after a whole sequence (`dspark.py` describes the drafter).
Norms are fp32 RMSNorms (eps `rms_norm_eps`, 1e-20 in the release) cast back once; the head
computes fp32 logits. The release's fp8 / fp4 activation rounding inside its kernels is not
modelled: this reference computes in the model dtype with fp32 islands, as transformers' V4 does.

Shape letters: B rows, T tokens, D hidden, n streams, H heads, d head_dim, E entries, G indexer
heads, J index_head_dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.models.layers import RotaryEmbedding, swiglu
from graphc.models.deepseek_v4.model import FP32RMSNorm as RMSNorm, rotate_trailing
from graphc.models.deepseek_v41.engram import Engram, ngram_context
from graphc.models.deepseek_v41.args import V41Args
from graphc.ops.hyper_connections import hc_sinkhorn_reference


def linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x.to(weight.dtype), weight)


@dataclass
class Published:
    """What a layer leaves for later layers in one forward: per compress ratio, the latest KV
    source's entries and index keys, the latest index layer's selection; the candidate blocks."""

    entries: dict[int, Tensor] = field(default_factory=dict)
    """[B, E, d] roped entries."""
    index_keys: dict[int, Tensor] = field(default_factory=dict)
    """[B, E, J] roped indexer keys."""
    selection: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    """(chosen [B, T, k] entry indices, kept [B, T, k])."""
    candidates: Tensor | None = None
    """[B, T, E] entries the candidate layer's blocks hold."""


class Compressor(nn.Module):
    def __init__(self, args: V41Args, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, D] -> the pre-RoPE latent of each complete group [B, T // r, d]."""
        if self.ratio == 1:
            return self.norm(linear(x, self.wkv.weight))
        rows, groups = x.shape[0], x.shape[1] // self.ratio
        x = x[:, :groups * self.ratio].float()
        width = self.wkv.weight.shape[0]
        kv = linear(x, self.wkv.weight.float()).view(rows, groups, self.ratio, width)
        gate = linear(x, self.wgate.weight.float()).view(rows, groups, self.ratio, width)
        pooled = (kv * gate.softmax(dim=2)).sum(dim=2)  # per channel, over the group's tokens
        return self.norm(pooled.to(self.wkv.weight.dtype))


class Indexer(nn.Module):
    def __init__(self, args: V41Args, owns_keys: bool, tp: int = 1):
        """`tp`: the paged model's tensor-parallel ranks, each holding index_n_heads / tp heads (the
        reference itself is one device: tp = 1)."""
        super().__init__()
        self.heads, self.width, self.topk = args.index_n_heads // tp, args.index_head_dim, args.index_topk
        self.weight_scale = (self.width * args.index_n_heads) ** -0.5  # over every head, wherever they are held
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * self.width, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(args.head_dim, self.width, bias=False)
            self.k_norm = RMSNorm(self.width, args.rms_norm_eps)

    def keys(self, latent: Tensor) -> Tensor:
        return self.k_norm(linear(latent, self.wk.weight))

    def scores(self, x: Tensor, q_latent: Tensor, keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """[B, T, E] fp32: sum_g relu(q_g . k_j) w_g, w = weights_proj(x) / sqrt(J G)."""
        rows, tokens = x.shape[:2]
        q = linear(q_latent, self.wq_b.weight).view(rows, tokens, self.heads, self.width)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None]).float()
        weights = linear(x, self.weights_proj.weight).float() * self.weight_scale  # [B, T, G]
        return (torch.einsum("btgj,bej->btge", q, keys.float()).relu() * weights[..., None]).sum(dim=2)


def candidate_blocks(scores: Tensor, visible: Tensor, blocks: int, block_size: int) -> Tensor:
    """[B, T, E] whether each entry lies in one of a query's best `blocks` blocks (a block scores
    its best visible entry; the block of the newest visible entry is always kept).

    Args:
        scores: [B, T, E] fp32, -inf where not visible.
        visible: [T] entries each query sees (its newest is entry visible - 1).
    """
    entries = scores.shape[-1]
    count = -(-entries // block_size)
    padded = F.pad(scores, (0, count * block_size - entries), value=float("-inf"))
    best = padded.view(*scores.shape[:2], count, block_size).amax(dim=-1)  # [B, T, count]
    newest = ((visible - 1).clamp(min=0) // block_size)[None, :, None]
    pinned = (torch.arange(count) == newest) & (visible > 0)[None, :, None]
    best = torch.where(pinned, float("inf"), best)
    top = best.topk(min(blocks, count), dim=-1)
    chosen = torch.zeros_like(best, dtype=torch.bool).scatter(-1, top.indices, top.values > float("-inf"))
    return chosen.repeat_interleave(block_size, dim=-1)[..., :entries]


class Attention(nn.Module):
    compressor_type = Compressor
    """What a KV source's compressor is (the paged model's adds its cache path)."""

    def __init__(self, args: V41Args, layer: int, tp: int = 1):
        """`tp`: as `Indexer`'s; a rank holds heads / tp heads and o_groups / tp output groups."""
        super().__init__()
        self.layer, self.ratio = layer, args.compress_ratios[layer]
        add_attention_parameters(self, args, tp)
        if layer in args.kv_source_layer_ids:
            self.compressor = self.compressor_type(args, self.ratio)
        if layer in args.index_source_layer_ids:
            self.indexer = Indexer(args, owns_keys=layer in args.kv_source_layer_ids, tp=tp)
        rope = args.compress_rope if self.ratio else args.main_rope
        self.rotary = RotaryEmbedding(rope, args.rope_head_dim)

    def forward(self, x: Tensor, published: Published) -> Tensor:
        rows, tokens = x.shape[:2]
        positions = torch.arange(tokens)[None].expand(rows, -1)
        cos, sin = self.rotary(positions, torch.float32)  # [B, T, P/2]
        q_latent = self.q_norm(linear(x, self.wq_a.weight))
        q = linear(q_latent, self.wq_b.weight).view(rows, tokens, self.heads, self.head_dim)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None])
        kv = rotate_trailing(self.kv_norm(linear(x, self.wkv.weight)), cos, sin)  # [B, T, d]
        query, key = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
        key_sets = [(kv, ((key <= query) & (key > query - self.args.sliding_window))[None].expand(rows, -1, -1))]
        if self.ratio:
            key_sets.append(self._selected_entries(x, q_latent, published))
        return self.attend(q, key_sets, cos, sin, x.dtype)

    def attend(self, q: Tensor, key_sets: list[tuple[Tensor, Tensor]], cos: Tensor, sin: Tensor,
               dtype: torch.dtype) -> Tensor:
        """Roped queries [B, T, H, d] over key sets (keys [B, S, d], which each query sees
        [B, T, S]) and the sinks -> the output projection [B, T, D]."""
        rows, tokens = q.shape[:2]
        scores = [torch.einsum("bthd,bsd->bhts", q.float(), keys.float()) * self.head_dim**-0.5
                  for keys, _ in key_sets]
        scores = [s.masked_fill(~seen[:, None], float("-inf")) for s, (_, seen) in zip(scores, key_sets)]
        sink = self.attn_sink.float().view(1, -1, 1, 1).expand(rows, -1, tokens, 1)
        probabilities = torch.cat([*scores, sink], dim=-1).softmax(dim=-1)
        out, start = 0, 0
        for keys, _ in key_sets:
            share, start = probabilities[..., start:start + keys.shape[1]], start + keys.shape[1]
            out = out + torch.einsum("bhts,bsd->bthd", share, keys.float())
        out = rotate_trailing(out.to(dtype), cos[:, :, None], -sin[:, :, None])  # [B, T, H, d]
        grouped = out.reshape(rows, tokens, self.groups, -1)
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        return linear(torch.einsum("btgi,goi->btgo", grouped, weight.to(dtype)).flatten(2), self.wo_b.weight)

    def _selected_entries(self, x: Tensor, q_latent: Tensor, published: Published) -> tuple[Tensor, Tensor]:
        """This layer's compressed keys [B, E, d] and which each query attends to [B, T, E]."""
        tokens, ratio = x.shape[1], self.ratio
        starts = torch.arange(tokens // ratio) * ratio  # entry j is roped at its group's first position
        cos, sin = self.rotary(starts[None], torch.float32)
        if hasattr(self, "compressor"):
            latent = self.compressor(x)
            published.entries[ratio] = rotate_trailing(latent, cos, sin)
            published.index_keys[ratio] = rotate_trailing(self.indexer.keys(latent), cos, sin)
        entries = published.entries[ratio]
        visible = (torch.arange(tokens) + 1) // ratio  # [T]
        if hasattr(self, "indexer"):
            q_cos, q_sin = self.rotary(torch.arange(tokens)[None], torch.float32)
            scores = self.indexer.scores(x, q_latent, published.index_keys[ratio], q_cos, q_sin)
            scores = scores.masked_fill(torch.arange(entries.shape[1]) >= visible[:, None], float("-inf"))
            if self.layer == self.args.candidate_source_layer_id:
                published.candidates = candidate_blocks(scores, visible, self.args.candidate_topk_blocks,
                                                        self.args.candidate_block_size)
            if self.args.uses_candidates(self.layer):
                scores = scores.masked_fill(~published.candidates, float("-inf"))
            top = scores.topk(min(self.indexer.topk, scores.shape[-1]), dim=-1)
            published.selection[ratio] = (top.indices, top.values > float("-inf"))
        chosen, kept = published.selection[ratio]
        attended = torch.zeros(*chosen.shape[:2], entries.shape[1], dtype=torch.bool).scatter(-1, chosen, kept)
        return entries, attended


def add_attention_parameters(attention: nn.Module, args: V41Args, tp: int) -> None:
    """Every V4.1 attention's projections, norms and sinks (a DSpark stage's too), one of `tp`
    ranks' (heads / tp heads, o_groups / tp output groups)."""
    attention.args, attention.tp = args, tp
    heads, head_dim, groups = args.num_attention_heads // tp, args.head_dim, args.o_groups // tp
    attention.heads, attention.head_dim, attention.groups = heads, head_dim, groups
    attention.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
    attention.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
    attention.wq_b = nn.Linear(args.q_lora_rank, heads * head_dim, bias=False)
    attention.wkv = nn.Linear(args.hidden_size, head_dim, bias=False)
    attention.kv_norm = RMSNorm(head_dim, args.rms_norm_eps)
    attention.wo_a = nn.Linear(heads * head_dim // groups, groups * args.o_lora_rank, bias=False)
    attention.wo_b = nn.Linear(groups * args.o_lora_rank, args.hidden_size, bias=False)
    attention.attn_sink = nn.Parameter(torch.empty(heads))


class Gate(nn.Module):
    def __init__(self, args: V41Args):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts))
        # (`bias_vl`, the image tokens' bias, belongs to the vision path: the loader skips it.)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> weights [T, K] fp32, expert ids [T, K]."""
        scores = F.softplus(linear(x.float(), self.weight.float()) / self.args.gate_temp).sqrt()
        ids = (scores + self.bias.float()).topk(self.args.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.args.routed_scaling_factor, ids


class Expert(nn.Module):
    def __init__(self, args: V41Args):
        super().__init__()
        self.limit = args.swiglu_limit
        self.w1 = nn.Linear(args.hidden_size, args.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(args.moe_intermediate_size, args.hidden_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.moe_intermediate_size, bias=False)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        hidden = swiglu(linear(x, self.w1.weight).float(), linear(x, self.w3.weight).float(), self.limit)
        if weight is not None:
            hidden = weight[:, None] * hidden
        return linear(hidden.to(x.dtype), self.w2.weight)


class MoE(nn.Module):
    def __init__(self, args: V41Args):
        super().__init__()
        self.gate = Gate(args)
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.n_routed_experts))
        self.shared_experts = Expert(args)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(tokens)
        routed = torch.zeros(tokens.shape, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if len(rows):
                routed.index_add_(0, rows, expert(tokens[rows], weights[rows, slot]).float())
        return (routed + self.shared_experts(tokens).float()).to(x.dtype).view_as(x)


class Block(nn.Module):
    def __init__(self, args: V41Args, layer: int):
        super().__init__()
        self.args = args
        if args.engram is not None and layer in args.engram.layer_ids:
            self.engram = Engram(args.engram, layer, args.hidden_size, args.hc_mult, args.rms_norm_eps)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MoE(args)
        add_stream_mix_parameters(self, args)

    def mixes(self, streams: Tensor, sublayer: str) -> tuple[Tensor, Tensor, Tensor]:
        return stream_mixes(streams, *(getattr(self, f"hc_{sublayer}_{part}") for part in ("fn", "base", "scale")),
                            self.args, hc_sinkhorn_reference)

    def forward(self, streams: Tensor, pre: Tensor, published: Published) -> tuple[Tensor, Tensor]:
        """streams [B, T, n, D], the previous sublayer's pre -> streams, the last sublayer's pre."""
        attn_pre, post, comb = self.mixes(streams, "attn")
        out = self.attn(self.attn_norm(collapse(streams, pre)), published)
        streams = expand(out, streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        out = self.ffn(self.ffn_norm(collapse(streams, attn_pre)))
        return expand(out, streams, post, comb), ffn_pre


def add_stream_mix_parameters(block: nn.Module, args: V41Args) -> None:
    """Each sublayer's mHC parameters (fp32): `hc_{attn,ffn}_fn` [(2 + n) n, n D], `_base`, `_scale` [3]."""
    n = args.hc_mult
    for sublayer in ("attn", "ffn"):
        setattr(block, f"hc_{sublayer}_fn", nn.Parameter(torch.empty((2 + n) * n, n * args.hidden_size)))
        setattr(block, f"hc_{sublayer}_base", nn.Parameter(torch.empty((2 + n) * n)))
        setattr(block, f"hc_{sublayer}_scale", nn.Parameter(torch.empty(3)))


def stream_mixes(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, args: V41Args,
                 sinkhorn) -> tuple[Tensor, Tensor, Tensor]:
    """From the streams [B, T, n, D]: pre [B, T, n], post [B, T, n], comb [B, T, n, n] (fp32): the
    RMS-scaled projection of the flattened streams (one statistic over all n D), through
    sigmoid / 2 sigmoid / softmax, comb made doubly stochastic by `sinkhorn`."""
    n, eps = args.hc_mult, args.hc_eps
    fn, base, scale = fn.float(), base.float(), scale.float()
    flat = streams.flatten(2).float()
    mixes = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + args.rms_norm_eps)
    pre, post, comb = mixes.split([n, n, n * n], dim=-1)
    pre = torch.sigmoid(pre * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(post * scale[1] + base[n:2 * n])
    comb = torch.softmax(comb.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n), dim=-1) + eps
    return pre, post, sinkhorn(comb, args.hc_sinkhorn_iters, eps)


def collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """sum_i pre_i stream_i [B, T, D], in fp32, cast once."""
    return (pre[..., None] * streams.float()).sum(dim=2).to(streams.dtype)


def expand(out: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Stream j after a sublayer: post_j out + sum_i comb[i, j] stream_i, in fp32, cast once."""
    mixed = post[..., None] * out.float()[:, :, None] + torch.einsum("btij,btid->btjd", comb, streams.float())
    return mixed.to(streams.dtype)


class DeepseekV41Reference(nn.Module):
    """Whole sequences [B, T] from position 0 -> fp32 logits [B, T, V]; with `args.draft_layers`,
    also DSpark's stages (`mtp`, `draft`)."""

    def __init__(self, args: V41Args):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.draft_layers:
            self.mtp = nn.ModuleList(DSparkStage(args, s) for s in range(args.dspark.stages))

    def forward(self, input_ids: Tensor) -> Tensor:
        streams, pre, _ = self.hidden(input_ids)
        return F.linear(self.norm(collapse(streams, pre)).float(), self.head.weight.float())

    def hidden(self, input_ids: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The streams after the last layer [B, T, n, D], the last FFN's pre [B, T, n], and the
        streams entering each layer (after its Engram) [B, T, n, D]."""
        n = self.args.hc_mult
        streams = self.embed(input_ids)[:, :, None].expand(-1, -1, n, -1)
        pre = F.one_hot(torch.zeros_like(input_ids), n).float()  # layer 0's attention reads stream 0
        context = None if self.args.engram is None else ngram_context(input_ids, self.args.engram.max_ngram,
                                                                      self.args.engram.pad_id)
        published, entering = Published(), []
        for block in self.layers:
            if hasattr(block, "engram"):
                streams = block.engram(streams, context)
            entering.append(streams)
            streams, pre = block(streams, pre, published)
        return streams, pre, entering

    def draft(self, input_ids: Tensor, anchor: int, k: int) -> list[int]:
        """DSpark's first k drafts after a sequence [1, T] and its next token `anchor` (see
        `deepseek_v41/dspark.py` for the drafter): the block [anchor, noise...] at T .., its
        queries over each stage's context keys of the last `sliding_window` positions and the
        block's own keys, then the Markov head's bias token by token, greedily."""
        args, dspark = self.args, self.args.dspark
        _, _, entering = self.hidden(input_ids)
        means = torch.cat([entering[layer].float().mean(dim=2) for layer in dspark.target_layer_ids], dim=-1)
        main_x = self.mtp[0].main_norm(linear(means.to(self.embed.weight.dtype), self.mtp[0].main_proj.weight))
        ids = torch.tensor([[anchor] + [dspark.noise_token_id] * (dspark.block_size - 1)])
        streams = self.embed(ids)[:, :, None].expand(-1, -1, args.hc_mult, -1)
        pre = F.one_hot(torch.zeros_like(ids), args.hc_mult).float()
        for stage in self.mtp:
            streams, pre = stage(streams, pre, main_x)
        last = self.mtp[-1]
        logits = F.linear(last.norm(collapse(streams, pre)).float(), self.head.weight.float())[0]  # [K, V]
        drafts = [anchor]
        for i in range(k):
            bias = linear(last.markov_head.embed.weight[drafts[-1]], last.markov_head.head.weight).float()
            drafts.append(int((logits[i] + bias).argmax()))
        return drafts[1:]


class DSparkAttention(Attention):
    """A DSpark stage's attention: the block's queries over the context keys of the last
    `sliding_window` positions (from main_x) and the block's own keys, unmasked."""

    def __init__(self, args: V41Args):
        nn.Module.__init__(self)
        add_attention_parameters(self, args, 1)
        self.rotary = RotaryEmbedding(args.main_rope, args.rope_head_dim)

    def forward(self, x: Tensor, main_x: Tensor) -> Tensor:
        (rows, block), context = x.shape[:2], main_x.shape[1]
        context_cos, context_sin = self.rotary(torch.arange(context)[None], torch.float32)
        keys = rotate_trailing(self.kv_norm(linear(main_x, self.wkv.weight)), context_cos, context_sin)
        keys = keys[:, max(0, context - self.args.sliding_window):]
        cos, sin = self.rotary(context + torch.arange(block)[None], torch.float32)
        q = linear(self.q_norm(linear(x, self.wq_a.weight)), self.wq_b.weight).view(rows, block, self.heads,
                                                                                      self.head_dim)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None])
        own = rotate_trailing(self.kv_norm(linear(x, self.wkv.weight)), cos, sin)
        key_sets = [(keys, torch.ones(rows, block, keys.shape[1], dtype=torch.bool)),
                    (own, torch.ones(rows, block, block, dtype=torch.bool))]
        return self.attend(q, key_sets, cos, sin, x.dtype)


class DSparkStage(nn.Module):
    """DSpark stage `stage` (the checkpoint's `mtp.{stage}`): a block over the draft block whose
    attention is `DSparkAttention`, its MoE over the drafter's experts."""

    def __init__(self, args: V41Args, stage: int):
        super().__init__()
        dspark = args.dspark
        self.args = args
        if stage == 0:
            self.main_proj = nn.Linear(len(dspark.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
            self.main_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = DSparkAttention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MoE(dataclasses.replace(args, n_routed_experts=dspark.n_routed_experts,
                                           num_experts_per_tok=dspark.num_experts_per_tok))
        add_stream_mix_parameters(self, args)
        if stage == dspark.stages - 1:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(args.vocab_size, dspark.markov_rank)
            self.markov_head.head = nn.Linear(dspark.markov_rank, args.vocab_size, bias=False)

    mixes = Block.mixes

    def forward(self, streams: Tensor, pre: Tensor, main_x: Tensor) -> tuple[Tensor, Tensor]:
        attn_pre, post, comb = self.mixes(streams, "attn")
        streams = expand(self.attn(self.attn_norm(collapse(streams, pre)), main_x), streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        return expand(self.ffn(self.ffn_norm(collapse(streams, attn_pre))), streams, post, comb), ffn_pre
