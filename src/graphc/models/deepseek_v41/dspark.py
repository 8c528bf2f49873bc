"""DeepSeek-V4.1's DSpark drafter over the paged pool: the checkpoint's MTP modules (`mtp.0` ..
`mtp.{S-1}`) as speculative decoding's draft, a block of tokens a pass (`models/speculation.py`).

DSpark ("semi-autoregressive" drafting, deepseek-ai/DeepSpec; the V4.1 release's inference code
and its ports):
- What it reads of the main model: at each position, the mean over the mHC streams of the
  residual *entering* each of `dspark_target_layer_ids` (V4.1-Flash: 37, 38, 39 of 40),
  concatenated [t D], projected and normed once: main_x = main_norm(main_proj(.)) (stage 0's).
- Each stage is a V4.1 block (single-pass mHC, a sliding-window attention with one K = V head and
  per-head sinks, an MoE of its own `dspark_n_routed_experts` experts routed top
  `dspark_num_experts_per_tok`, one shared expert) whose keys are not its own history: its context
  key at a position is kv_norm(wkv(main_x)) of that position, roped there (pool layer
  `V41Args.draft_cache_layer(s)`, written for every position a step runs, as the main model's KV).
- A pass after the last committed position p drafts `dspark_block_size` = K tokens at once: the
  block [t, noise x (K - 1)] (t the token just sampled, at p + 1; the noise id at p + 2 ..), its
  embedding in every stream. Every block query sees the same keys: the stage's context keys of the
  last `sliding_window` positions up to p and the block's own K keys (no causal mask in the
  block), with the stage's sinks.
- The head: the streams collapse with the last stage's FFN pre-mix (V4.1 has no separate head
  mix), the last stage's `norm`, the main LM head: logits [K, V]. Block position i drafts the
  token at p + 2 + i from its logits plus the Markov head's bias of the token before it
  (markov_head.head(markov_head.embed(prev)), rank `dspark_markov_rank`; prev = t at i = 0):
  token by token, greedily here. Drafting by argmax is lossless all the same: the verdict
  (`graphc::verify_drafts`) keeps the main model's distribution for any deterministic draft.

Not served: the confidence head (`mtp.{S-1}.confidence_head`: an acceptance estimate per
position, which the release's own generation never reads); the loader skips it. The sources
differ on whether the target layers' residuals are taken entering or leaving them; graphc follows
the V4.1 inference code's reading (entering; after a layer's Engram), in one place
(`DeepseekV41.run_layers`).

Shape letters: B rows, W the step's tokens a row, K block, n streams, D hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.errors import GraphcError
from graphc.models.deepseek_v4.model import CacheView, FP32RMSNorm, fp32, partial_attention, rotate_trailing, write
from graphc.models.deepseek_v41 import reference
from graphc.models.deepseek_v41.args import V41Args
from graphc.models.deepseek_v41.model import Attention, DecoderLayer, DeepseekV41, V41MoE
from graphc.models.deepseek_v41.reference import collapse, expand
from graphc.models.layers import gather_over_tp
from graphc.models.step_model import StepInputs
from graphc.topology import Topology


def draft(model: "DeepseekV41Drafting", k: int, hidden: Tensor, input_ids: Tensor, step: StepInputs,
          kept_until: Tensor, picked: Tensor) -> Tensor:
    """`Drafter.draft`: the first k drafts of the block after each row's last accepted position."""
    return model.draft_block(hidden, picked, kept_until, step, k)


def check(args: V41Args, k: int, topology: Topology) -> None:
    """`Drafter.check`: what the checkpoint's stages cannot take, naming the model.yaml field."""
    if args.dspark is None:
        raise GraphcError("model.speculative: method 'dspark' needs DSpark stages, and the checkpoint's config.json "
                          "has no dspark_block_size")
    if args.dspark.n_routed_experts % topology.ep:
        raise GraphcError(f"topology.ep: {topology.ep} must divide the DSpark stages' experts too "
                          f"(config.json dspark_n_routed_experts {args.dspark.n_routed_experts})")
    if k > args.dspark.block_size:
        raise GraphcError(f"model.speculative.tokens: {k} exceeds the DSpark block "
                          f"(config.json dspark_block_size {args.dspark.block_size}), the tokens one pass drafts")


def passes(args: V41Args, tokens: int, rows: int, k: int) -> list[tuple[int, int]]:
    """`Drafter.passes`: the stages once over a block a row, each block position through the head
    (the Markov head issues no collective)."""
    block = rows * args.dspark.block_size
    return [(block, block)]


def stage_args(args: V41Args) -> V41Args:
    """The DSpark stages as the args of a model of their own: sliding-window layers, routing over
    the drafter's experts (what `graphc plan` predicts their collectives from)."""
    dspark = args.dspark
    return dataclasses.replace(
        args, num_hidden_layers=dspark.stages, compress_ratios=(0,) * dspark.stages, kv_source_layer_ids=(),
        index_source_layer_ids=(), candidate_source_layer_id=-1, engram=None, dspark=None, draft_layers=0,
        n_routed_experts=dspark.n_routed_experts, num_experts_per_tok=dspark.num_experts_per_tok)


class StageAttention(Attention):
    """A stage's attention: the block's queries over its context keys and the block's own (V4.1's
    attention parameters and output projection, no compressor or indexer)."""

    def __init__(self, args: V41Args, tp: int):
        nn.Module.__init__(self)
        reference.add_attention_parameters(self, args, tp)

    def context_keys(self, main_x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """main_x [B, W, D] -> the stage's context keys [B, W, d] at those positions."""
        return rotate_trailing(self.kv_norm(F.linear(main_x, self.wkv.weight)), cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], shard: Tensor) -> Tensor:
        """x [B, K, D] the block, `context` its keys [B, C, d] and which this shard holds [B, C] -> [B, K, D]."""
        rows, width = x.shape[:2]
        q = F.linear(self.q_norm(F.linear(x, self.wq_a.weight)), self.wq_b.weight)
        q = rotate_trailing(q.view(rows, width, self.heads, self.head_dim), cos[:, :, None], sin[:, :, None])
        own = self.context_keys(x, cos, sin)  # [B, K, d]: the block's keys, made as the context's
        keys, here = context
        # Every rank of the CP group computes the whole block: its keys count on shard 0 alone.
        own_visible = (torch.as_tensor(shard) == 0).expand(rows, width, width)
        key_sets = [(keys, here[:, None, :].expand(-1, width, -1)), (own, own_visible)]
        return self.output(*partial_attention(q, key_sets, self.attn_sink, shard), cos, sin, x.dtype)


class MarkovHead(nn.Module):
    """The bias a drafted token adds to the next block position's logits: head(embed(token))."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)

    def forward(self, previous: Tensor) -> Tensor:
        """[B] token ids -> fp32 [B, V]."""
        return fp32(self.head(self.embed(previous)))


class Stage(DecoderLayer):
    """DSpark stage `stage`: a V4.1 block over the draft block; stage 0 also projects the main
    model's residuals, the last holds the head's norm and the Markov head."""

    def __init__(self, args: V41Args, stage: int, local_experts: int | None = None, tp: int = 1):
        nn.Module.__init__(self)
        self.args, dspark = args, args.dspark
        if stage == 0:
            self.main_proj = nn.Linear(len(dspark.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
            self.main_norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn_norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = StageAttention(args, tp)
        self.ffn_norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = V41MoE(stage_args(args), local_experts, tp)
        reference.add_stream_mix_parameters(self, args)
        if stage == dspark.stages - 1:
            self.norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, dspark.markov_rank)

    def forward(self, streams: Tensor, pre: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor],
                step: StepInputs) -> tuple[Tensor, Tensor]:
        """The block's streams [B, K, n, D] and the previous sublayer's pre -> streams, this stage's FFN's pre."""
        attn_pre, post, comb = self.mixes(streams, "attn")
        out = self.attn(self.attn_norm(collapse(streams, pre)), cos, sin, context, step.parallel.kv_shard())
        streams = expand(out, streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        out = self.mlp(self.ffn_norm(collapse(streams, attn_pre)), step)
        return expand(out, streams, post, comb), ffn_pre


class DeepseekV41Drafting(DeepseekV41):
    """DeepSeek-V4.1 serving its DSpark stages (`model.mtp.s`) as speculative decoding's draft."""

    def __init__(self, args: V41Args, local_experts: int | None = None, tp: int = 1):
        super().__init__(args, local_experts, tp)
        stage_experts = None if local_experts is None else \
            local_experts * args.dspark.n_routed_experts // args.n_routed_experts  # the same share of fewer experts
        self.model.mtp = nn.ModuleList(Stage(args, s, stage_experts, tp) for s in range(args.dspark.stages))

    def draft_block(self, hidden: Tensor, anchor: Tensor, last: Tensor, step: StepInputs, k: int) -> Tensor:
        """The step's hidden states [B, W, ...] (`final_hidden`), each row's anchor [B, 1] (the
        token after its last committed position) and that position's index in the row [B, 1] ->
        the first k drafts of the block after the anchor [B, k]; writes the stages' context keys
        at every position of the step (positions past `last` are written again when a row reaches
        them, as the main model's KV)."""
        args, stages = self.args, self.model.mtp
        dspark, rotary = args.dspark, self.model.rotary["main"]  # sliding layers: the main RoPE
        main_x = stages[0].main_norm(stages[0].main_proj(self.captured(hidden)))  # [B, W, D]
        cos, sin = rotary(step.positions, torch.float32)
        for s, stage in enumerate(stages):
            write(step, args.draft_cache_layer(s), stage.attn.context_keys(main_x, cos, sin))

        last_position = step.positions.gather(1, last)  # [B, 1]
        offsets = torch.arange(dspark.block_size, device=anchor.device)
        noise = torch.full_like(offsets[1:], dspark.noise_token_id)
        ids = torch.cat([anchor, noise.expand(anchor.shape[0], -1)], dim=1)  # [B, K]
        cos, sin = rotary(last_position + 1 + offsets, torch.float32)
        window = last_position - args.sliding_window + 1 + torch.arange(args.sliding_window, device=anchor.device)
        cache = CacheView(step)
        streams = self.embed(ids)  # [B, K, n, D]
        pre = (torch.arange(args.hc_mult, device=ids.device) == 0).float().expand(*ids.shape, -1)  # stream 0
        for s, stage in enumerate(stages):
            context = cache.read(args.draft_cache_layer(s), window, slice(0, args.head_dim))
            streams, pre = stage(streams, pre, cos, sin, context, step)
        head = stages[-1]
        logits = gather_over_tp(F.linear(fp32(head.norm(collapse(streams, pre))), fp32(self.lm_head.weight)),
                                self.tp)  # [B, K, V]
        drafts, previous = [], anchor[:, 0]
        for i in range(k):  # token by token: each position's logits take the Markov bias of the token before
            previous = (logits[:, i] + head.markov_head(previous)).argmax(dim=-1)
            drafts.append(previous)
        return torch.stack(drafts, dim=1)
