"""DeepSeek-V4 on one device, over a paged cache, in graphc's step layout (see `deepseek_v3`).

What V4 changes from V3: attention is multi-query over one shared K = V head (low-rank q with a
weightless per-head norm, interleaved RoPE on each head's trailing `rope_head_dim` dims and the
inverse rotation on the output, a learnable per-head sink logit in the softmax, a grouped low-rank
output projection). Every layer attends to a sliding window of `sliding_window` tokens; compressed
layers also attend to *compressed entries*, each a gated softmax pool of a window of tokens: HCA
pools every `hca_rate` tokens and attends to every closed entry, CSA pools overlapping windows of
2 * `csa_rate` tokens every `csa_rate` and attends to the `index_topk` entries its lightning
indexer scores best. The residual is `hc_mult` parallel streams mixed before and after every
sublayer (mHC). Every layer is MoE with sqrt(softplus) router scores; the first layers choose
their experts by a frozen token -> experts table.

The cache. The pool is [2L, N, S, C] and a slot is a token's, addressed through the row's block
table as for V3 (slot = block_table[b, pos // S] * S + pos % S). Model layer i owns two pool
layers:
- 2i, the *token cache*: what each token leaves for later tokens: its K = V [head_dim] (the
  sliding window reads it), then its compressor projections, kv and gate (HCA [head_dim] each;
  CSA [2 * head_dim] each, the two overlapping series, then the indexer's [2 * index_head_dim]
  each). These are the compressors' partial windows: a window that a chunk or decode step leaves
  open is pooled when the token that closes it arrives, by reading its tokens back from here.
- 2i + 1, the *entry cache*: at the slot of the token that closes window w (position
  (w + 1) * rate - 1), entry w [head_dim] (CSA: then the indexer's key [index_head_dim]). The
  other slots of the entry cache are never read.
So every bucket addresses every state through the block table, a chunked prefill or decode step
pools exactly the windows its tokens close, and no slot past a row's context is read (reads are
clamped to the row's last position and masked). C is the widest state of any layer; a sliding
layer uses [head_dim] of its token cache and none of its entry cache. (Storing the raw window
rather than a running pool costs memory, 2-5x head_dim per token in compressed layers; the
device kernels this layout is validated for can fold the pool into the write.)

Tensor parallelism (`tp`) is a construction choice, as in `deepseek_v3`: a rank holds H / tp query
heads (their q_b rows and sinks) and o_groups / tp whole groups of the grouped output projection
(o_a rows, o_b columns: row-parallel, all-reduced over "tp"), G / tp of CSA's indexer heads (their
head-weighted scores all-reduced before the top-k), 1 / tp of the shared experts' width, D / tp of
the embedding's columns and V / tp of the LM head's rows. The shared K = V head, the compressors,
the mHC streams and the router stay whole (and so does the cache: every rank of a tp group holds
the same blocks).

Parameter names are transformers' `DeepseekV4ForCausalLM` names (its routed experts are stacked
as graphc's are); `layout.py` maps the released DeepSeek names onto them.

Shape letters: B rows, Q tokens per row, D hidden, n = hc_mult streams, H heads, d head_dim,
P rope dims, W sliding window, m compress rate, E entries a row's block table can address,
G indexer heads, J index_head_dim, k entries CSA selects, S block size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.models.deepseek_v4.args import CSA, HASH_MOE, SLIDING, V4Args
from graphc.models.layers import MLP, MoE, RotaryEmbedding, RoutedExperts, gather_over_tp, row_parallel
from graphc.models.moe_forms import MOE_FORMS
from graphc.models.step_model import Parallelism, StepInputs
from graphc.ops import collectives, hyper_connections, paged_attention, sparse
from graphc.step import kv_pool_shape


def tensor_parallel_widths(args: V4Args) -> dict[str, int]:
    """What tensor parallelism splits, by config.json field: tp must divide each."""
    widths = {"num_attention_heads": args.num_attention_heads, "o_groups": args.o_groups,
              "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
              "moe_intermediate_size": args.moe_intermediate_size}
    if CSA in args.layer_types:
        widths["index_n_heads"] = args.index_n_heads
    return widths


class FP32RMSNorm(nn.Module):
    """RMSNorm whose weight stays fp32 and multiplies in fp32, casting once (V4's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = fp32(x) * torch.rsqrt(fp32(x).pow(2).mean(-1, keepdim=True) + self.eps)
        return cast(fp32(self.weight) * normed, x.dtype)


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in `dtype`, with no op at all when it already is (a traced `.float()` of an fp32 tensor
    is a conversion node and a metadata assertion: V4's fp32 islands had hundreds)."""
    return x if x.dtype == dtype else x.to(dtype)


def fp32(x: Tensor) -> Tensor:
    return cast(x, torch.float32)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    return x * cast(torch.rsqrt(fp32(x).square().mean(-1, keepdim=True) + eps), x.dtype)


def rotate_trailing(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved RoPE of x's trailing 2 * cos.shape[-1] dims, in place in the layout (K = V,
    so the value dims keep their order), in fp32; cos/sin broadcast against x[..., P/2]."""
    rope = 2 * cos.shape[-1]
    nope, roped = x[..., :-rope], fp32(x[..., -rope:])
    evens, odds = roped[..., 0::2], roped[..., 1::2]
    cos, sin = fp32(cos), fp32(sin)
    rotated = torch.stack([evens * cos - odds * sin, odds * cos + evens * sin], dim=-1).flatten(-2)
    return torch.cat([nope, cast(rotated, x.dtype)], dim=-1)


class CacheView:
    """A step's reads of its rows' positions in this rank's shard of the pool.

    Under context parallelism a row's logical block j lives on shard j % cp and the rank's block
    table lists only its own blocks (local column j // cp), as for V3. A read returns the vectors
    at the positions this shard holds, and which those are: positions before the first token,
    past the row's last or on another shard read slot 0 of a context block (never a table entry
    past the row's context) and are marked absent.
    """

    def __init__(self, step: StepInputs):
        self.pool = step.kv_pool
        self.block_size = step.kv_pool.shape[2]
        self.shard, self.shards = step.parallel.kv_shard(), step.parallel.cp
        self.table = paged_attention.context_block_table(step.block_table, step.positions, self.block_size,
                                                         self.shard, self.shards)  # [B, M']
        self.positions = step.positions
        self.context_end = step.positions.amax(dim=1)  # [B]
        self.capacity = step.block_table.shape[1] * self.block_size  # positions a row can address

    def read(self, layer: int, positions: Tensor, dims: slice) -> tuple[Tensor, Tensor]:
        """`dims` of the cached vectors at `positions` [B, ...] of each row.

        Returns:
            values: [B, ..., c] in the pool dtype (garbage where absent).
            here: [B, ...] whether this shard holds the position (and it is in the row's context).
        """
        rows, end = positions.shape[0], self.context_end.view(-1, *[1] * (positions.dim() - 1))
        block = positions.clamp(min=0) // self.block_size
        here = (positions >= 0) & (positions <= end) & (block % self.shards == self.shard)
        column = torch.where(here, block // self.shards, 0).reshape(rows, -1)
        offset = torch.where(here, positions % self.block_size, 0).reshape(rows, -1)
        cached = self.pool[layer, :, :, dims]  # [N, S, c] (a view: only `dims` are gathered)
        return cached[self.table.gather(1, column), offset].view(*positions.shape, -1), here


def partial_softmax(logits: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Softmax weights over this rank's share of `dim` and their log-sum-exp, so that shares of
    disjoint sets combine exactly (`collectives.attention_combine`): a share with nothing (all
    -inf) gets weights 0 and lse -inf."""
    lse = torch.logsumexp(logits, dim=dim, keepdim=True)
    weights = torch.exp(logits - torch.where(lse.isinf(), 0.0, lse))
    return weights, lse.squeeze(dim)


def write(step: StepInputs, layer: int, state: Tensor) -> None:
    """The step's tokens' `state` [B, Q, c] into pool layer `layer` at their slots (zero-padded to C)."""
    width = step.kv_pool.shape[-1]
    paged_attention.kv_write(step.kv_pool, layer, F.pad(state, (0, width - state.shape[-1])), step.slot_mapping)


def window_keys(cache: CacheView, layer: int, positions: Tensor, window: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Each row's keys [B, K, d] from `window` - 1 before its first token to its last, and which
    each query sees [B, Q, K] (the last `window` positions up to its own, on this shard)."""
    width = positions.shape[1]
    span = torch.arange(window + width - 1, device=positions.device)
    key_positions = positions[:, :1] - window + 1 + span  # [B, K]
    keys, here = cache.read(layer, key_positions, slice(0, head_dim))  # [B, K, d]
    query, key = positions[..., None], key_positions[:, None, :]  # [B, Q, 1], [B, 1, K]
    return keys, here[:, None, :] & (key <= query) & (key > query - window)


def partial_attention(q: Tensor, key_sets: list[tuple[Tensor, Tensor]], sinks: Tensor,
                      shard: Tensor) -> tuple[Tensor, Tensor]:
    """This shard's share of the softmax of q . k / sqrt(d) over every visible key and each head's
    sink (counted on shard 0 alone: it takes its share of the probability and adds nothing), in
    fp32 (K = V: keys are the values).

    Args:
        q: [B, Q, H, d].
        key_sets: (keys, visible) pairs: keys [B, K, d] shared by a row's queries or
            [B, Q, K, d] per query, visible [B, Q, K].
        sinks: [H] the heads' sink logits.
        shard: this rank's place in the CP group.

    Returns:
        out: [B, Q, H, d] fp32 and lse: [B, Q, H] fp32, to combine over the CP group.
    """
    q = fp32(q) * q.shape[-1]**-0.5
    scores = []
    for keys, visible in key_sets:
        pattern = "bqhd,bkd->bqhk" if keys.dim() == 3 else "bqhd,bqkd->bqhk"
        score = torch.einsum(pattern, q, fp32(keys))
        scores.append(score.masked_fill(~visible[:, :, None, :], float("-inf")))
    sink = fp32(sinks).masked_fill(torch.as_tensor(shard) != 0, float("-inf"))
    weights, lse = partial_softmax(torch.cat([*scores, sink.view(1, 1, -1, 1).expand(*q.shape[:3], 1)], dim=-1),
                                   dim=-1)  # [B, Q, H, K' + 1]
    out, start = 0, 0
    for keys, _ in key_sets:
        share, start = weights[..., start:start + keys.shape[-2]], start + keys.shape[-2]
        pattern = "bqhk,bkd->bqhd" if keys.dim() == 3 else "bqhk,bqkd->bqhd"
        out = out + torch.einsum(pattern, share, fp32(keys))
    return out, lse


class Compressor(nn.Module):
    """Pools windows of tokens into entries: entry w = norm(sum_j softmax_j(gate_j + bias_j) kv_j)
    per channel, roped at its window's first position. With `overlap` (CSA), each token projects
    two series and entry w pools the first series of window w - 1 with the second of window w
    (2 * rate tokens). A window's tokens may sit on several context-parallel shards: each pools
    its own (`partial_pool`), and the shares combine like attention's."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        series = 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, series * width, bias=False)
        self.gate_proj = nn.Linear(hidden, series * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, series * width))
        self.kv_norm = FP32RMSNorm(width, eps)

    @property
    def state_dim(self) -> int:
        """What a token leaves in the token cache: its kv, then its gate."""
        return 2 * self.kv_proj.out_features

    def token_state(self, x: Tensor) -> Tensor:
        """x [B, Q, D] -> [B, Q, state_dim]."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def partial_pool(self, cache: CacheView, layer: int, dims_start: int, positions: Tensor) -> tuple[Tensor, Tensor]:
        """This shard's share of the pool of the window each token closes (garbage for tokens
        that close none: the attention never reads their entry slots).

        Args:
            layer, dims_start: where this compressor's token states sit in the token cache.
            positions: [B, Q] the step's positions.

        Returns:
            pooled: [B, Q, width] fp32, the softmax-weighted kv over this shard's window tokens.
            lse: [B, Q, width] fp32 log-sum-exp of their gates (-inf: none here).
        """
        span = (2 if self.overlap else 1) * self.rate
        window = positions[..., None] - span + 1 + torch.arange(span, device=positions.device)  # [B, Q, span]
        state, here = cache.read(layer, window, slice(dims_start, dims_start + self.state_dim))
        kv, gate = fp32(state).chunk(2, dim=-1)  # [B, Q, span, series * w] each
        bias = fp32(self.position_bias)  # [m, series * w]
        if self.overlap:  # the older window's first series, then this window's second
            w, m = self.width, self.rate
            kv = torch.cat([kv[..., :m, :w], kv[..., m:, w:]], dim=-2)  # [B, Q, 2m, w]
            gate = torch.cat([gate[..., :m, :w] + bias[:, :w], gate[..., m:, w:] + bias[:, w:]], dim=-2)
        else:
            gate = gate + bias
        weights, lse = partial_softmax(gate.masked_fill(~here[..., None], float("-inf")), dim=-2)
        return (kv * weights).sum(dim=-2), lse

    def finish(self, pooled: Tensor, positions: Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> Tensor:
        """The whole window's pool [B, Q, width] -> the entry: normed, roped at the window's start."""
        entry = self.kv_norm(cast(pooled, dtype))
        return rotate_trailing(entry, *rotary(positions + 1 - self.rate, dtype))


class Indexer(Compressor):
    """CSA's lightning indexer: a compressor of its own at `index_head_dim` gives each entry a
    key; query t scores entry s as sum_g w_{t,g} relu(q_{t,g} . k_s) / sqrt(J) and keeps the top
    `index_topk` closed entries."""

    def __init__(self, args: V4Args, tp: int = 1):
        super().__init__(args.hidden_size, args.index_head_dim, args.csa_rate, True, args.rms_norm_eps)
        self.heads, self.topk = args.index_n_heads // tp, args.index_topk  # this rank's heads
        self.head_weight_scale = args.index_n_heads**-0.5  # over every head, wherever they are held
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.heads * self.width, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)


class Attention(nn.Module):
    """Shared-KV multi-query attention over the sliding window and, in compressed layers, the
    compressed entries, with a per-head sink (see the module docstring for the cache)."""

    def __init__(self, args: V4Args, layer: int, rotary: RotaryEmbedding, tp: int = 1):
        super().__init__()
        self.layer, self.kind, self.tp = layer, args.attention_type(layer), tp
        self.rotary = rotary
        self.heads, self.head_dim = args.num_attention_heads // tp, args.head_dim  # this rank's heads
        self.window = args.sliding_window
        self.eps = args.rms_norm_eps
        self.o_groups = args.o_groups // tp  # and their output groups
        self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_a_norm = FP32RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = FP32RMSNorm(self.head_dim, args.rms_norm_eps)
        group_width = self.heads * self.head_dim // self.o_groups
        self.o_a_proj = nn.Linear(group_width, self.o_groups * args.o_lora_rank, bias=False)  # block-diagonal
        self.o_b_proj = nn.Linear(self.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.heads))
        self.rate = args.compress_rate(layer)
        if self.kind != SLIDING:
            self.compressor = Compressor(args.hidden_size, self.head_dim, self.rate, self.kind == CSA,
                                         args.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(args, tp)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: StepInputs) -> Tensor:
        """x [B, Q, D] -> [B, Q, D]; writes the step's token (and entry) states first."""
        rows, width = x.shape[:2]
        q_latent = self.q_a_norm(self.q_a_proj(x))  # [B, Q, q_lora_rank]
        q = unweighted_rms_norm(self.q_b_proj(q_latent).view(rows, width, self.heads, self.head_dim), self.eps)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None])  # [B, Q, H, d]
        kv = rotate_trailing(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B, Q, d]
        cache = CacheView(step)
        token_layer, entry_layer = 2 * self.layer, 2 * self.layer + 1
        states = [kv]
        if self.kind != SLIDING:
            states.append(self.compressor.token_state(x))
            if self.kind == CSA:
                states.append(self.compressor.indexer.token_state(x))
        write(step, token_layer, torch.cat(states, dim=-1))

        # Key sets, each [B, K, d] shared by a row's queries or [B, Q, K, d] per query, with
        # which keys each query sees [B, Q, K] (those on this shard).
        key_sets = [window_keys(cache, token_layer, step.positions, self.window, self.head_dim)]
        if self.kind != SLIDING:
            write(step, entry_layer, self._entries(cache, token_layer, step.positions, x.dtype))
            entry_positions = (torch.arange(cache.capacity // self.rate, device=x.device) + 1) * self.rate - 1  # [E]
            if self.kind == CSA:
                chosen = self._select(x, q_latent, cos, sin, cache, entry_layer, entry_positions)  # [B, Q, k]
                entries, here = cache.read(entry_layer, chosen, slice(0, self.head_dim))  # [B, Q, k, d]
                key_sets.append((entries, here & (chosen != sparse.NO_KEY)))
            else:
                entries, here = cache.read(entry_layer, entry_positions[None].expand(rows, -1),
                                           slice(0, self.head_dim))  # [B, E, d]
                key_sets.append((entries, here[:, None, :] & (entry_positions <= step.positions[..., None])))
        out, lse = partial_attention(q, key_sets, self.sinks, cache.shard)  # [B, Q, H, d], [B, Q, H]
        out = collectives.attention_combine(out, lse, "cp")  # the CP group's shards, combined
        out = rotate_trailing(cast(out, x.dtype), cos[:, :, None], -sin[:, :, None])  # undo the values' rotation
        groups = out.reshape(rows, width, self.o_groups, -1)  # [B, Q, g, H*d/g]
        weight = self.o_a_proj.weight.view(self.o_groups, -1, groups.shape[-1])  # [g, o_lora, H*d/g]
        return row_parallel(self.o_b_proj, torch.einsum("bqgi,goi->bqgo", groups, weight).flatten(2), self.tp)

    def _entries(self, cache: CacheView, layer: int, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """[B, Q, d (+ J)] the entries (and CSA's indexer keys) of the windows the step's tokens
        close, each window pooled over the CP group: one combine for both compressors."""
        compressors = [self.compressor] + ([self.compressor.indexer] if self.kind == CSA else [])
        shares, start = [], self.head_dim
        for compressor in compressors:
            shares.append(compressor.partial_pool(cache, layer, start, positions))
            start += compressor.state_dim
        pooled = collectives.attention_combine(torch.cat([p for p, _ in shares], dim=-1)[..., None],
                                               torch.cat([lse for _, lse in shares], dim=-1), "cp")[..., 0]
        widths = [compressor.width for compressor in compressors]
        return torch.cat([compressor.finish(part, positions, self.rotary, dtype)
                          for compressor, part in zip(compressors, pooled.split(widths, dim=-1))], dim=-1)

    def _select(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor, cache: CacheView, entry_layer: int,
                entry_positions: Tensor) -> Tensor:
        """[B, Q, k] the closing positions of the entries each query's indexer keeps, over the CP
        group (`sparse.NO_KEY` where fewer are closed)."""
        indexer = self.compressor.indexer
        rows, width = x.shape[:2]
        q = indexer.q_b_proj(q_latent).view(rows, width, indexer.heads, indexer.width)
        q = fp32(rotate_trailing(q, cos[:, :, None], sin[:, :, None]))  # [B, Q, G, J]
        keys, here = cache.read(entry_layer, entry_positions[None].expand(rows, -1),
                                slice(self.head_dim, self.head_dim + indexer.width))  # [B, E, J]
        scores = torch.einsum("bqgj,bej->bqge", q, fp32(keys)).relu() * indexer.width**-0.5
        head_weights = fp32(indexer.scorer.weights_proj(x)) * indexer.head_weight_scale  # [B, Q, G]
        visible = here[:, None, :] & (entry_positions <= cache.positions[..., None])  # closed, on this shard
        scores = (scores * head_weights[..., None]).sum(dim=2)  # [B, Q, E] over this rank's heads
        if self.tp > 1:
            scores = collectives.all_reduce(scores, "tp")  # over every head
        scores = scores.masked_fill(~visible, float("-inf"))
        candidates = entry_positions.expand(rows, width, -1)  # ascending, as the combine needs
        positions, best = sparse.top_by_score(candidates, scores, min(indexer.topk, scores.shape[-1]))
        return sparse.index_topk_combine(positions, best, "cp")

class HyperConnection(nn.Module):
    """mHC: from the RMS-normalised streams, `pre` weights collapse the n streams into the
    sublayer's input, `post` spreads its output back over them, and `comb` (made doubly stochastic
    by Sinkhorn iterations) mixes the residual streams."""

    def __init__(self, args: V4Args):
        super().__init__()
        self.streams, self.iterations, self.eps, self.norm_eps = (args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps,
                                                                  args.rms_norm_eps)
        mixes = (2 + self.streams) * self.streams
        self.fn = nn.Parameter(torch.empty(mixes, self.streams * args.hidden_size))
        self.base = nn.Parameter(torch.empty(mixes))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [B, Q, n, D] -> post [B, Q, n], comb [B, Q, n, n] (fp32), collapsed [B, Q, D]."""
        n = self.streams
        flat = unweighted_rms_norm(fp32(streams.flatten(2)), self.norm_eps)
        mixes = F.linear(flat, fp32(self.fn))  # [B, Q, (2 + n) n]
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = fp32(self.base).split([n, n, n * n])
        pre_scale, post_scale, comb_scale = fp32(self.scale).unbind(0)
        pre = torch.sigmoid(pre * pre_scale + pre_base) + self.eps
        post = 2 * torch.sigmoid(post * post_scale + post_base)
        comb = torch.softmax(comb.unflatten(-1, (n, n)) * comb_scale + comb_base.view(n, n), dim=-1) + self.eps
        comb = hyper_connections.hc_sinkhorn(comb, self.iterations, self.eps)
        collapsed = cast((pre[..., None] * streams).sum(dim=2), streams.dtype)
        return post, comb, collapsed


def mix_streams(streams: Tensor, output: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The streams after a sublayer: post-weighted output plus comb-mixed residual (comb read
    transposed: stream k receives sum_j comb[j, k] * stream j)."""
    dtype = streams.dtype
    return cast(post, dtype)[..., None] * output[..., None, :] + cast(comb, dtype).transpose(-1, -2) @ streams


class Router(nn.Module):
    """sqrt(softplus) scores; the correction bias steers the top-k choice, the unbiased scores weigh
    the chosen experts (renormalised, scaled)."""

    def __init__(self, args: V4Args):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts))
        self.top_k, self.scaling = args.num_experts_per_tok, args.routed_scaling_factor

    def scores(self, x: Tensor) -> Tensor:
        return F.softplus(F.linear(fp32(x), fp32(self.weight))).sqrt()  # [T, E]

    def forward(self, x: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D], token_ids [T] -> weights [T, K] fp32, ids [T, K]."""
        scores = self.scores(x)
        ids = (scores + fp32(self.e_score_correction_bias)).topk(self.top_k, dim=-1, sorted=False).indices
        return self.weigh(scores, ids), ids

    def weigh(self, scores: Tensor, ids: Tensor) -> Tensor:
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class HashRouter(Router):
    """The first layers' routing: the experts are `tid2eid[token]`, a frozen table; the learned
    scores only weigh them."""

    def __init__(self, args: V4Args):
        super().__init__(args)
        del self.e_score_correction_bias
        self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.num_experts_per_tok, dtype=torch.int64))

    def forward(self, x: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        ids = self.tid2eid[token_ids]
        return self.weigh(self.scores(x), ids), ids


class V4MoE(MoE):
    """V3's MoE exchange with V4's routers and clamped SwiGLU experts."""

    def __init__(self, args: V4Args, layer: int, local_experts: int | None = None, tp: int = 1):
        nn.Module.__init__(self)
        self.gate = HashRouter(args) if args.mlp_layer_type(layer) == HASH_MOE else Router(args)
        self.experts = RoutedExperts(args, local_experts, swiglu_limit=args.swiglu_limit)
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size, swiglu_limit=args.swiglu_limit, tp=tp)

    def route(self, tokens: Tensor, step: StepInputs) -> tuple[Tensor, Tensor]:
        if isinstance(self.gate, HashRouter) and step.parallel.moe_exchange == "ag_rs":
            raise ValueError("hash-routed MoE layers route at the source: the ag_rs exchange routes the gathered "
                             "tokens, whose ids it does not carry; use a2a_even or a2a_v")
        return self.gate(tokens, step.input_ids.reshape(-1))


class DecoderLayer(nn.Module):
    def __init__(self, args: V4Args, layer: int, rotary: RotaryEmbedding, local_experts: int | None = None,
                 tp: int = 1):
        super().__init__()
        self.self_attn = Attention(args, layer, rotary, tp)
        self.mlp = V4MoE(args, layer, local_experts, tp)
        self.input_layernorm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)

    def forward(self, streams: Tensor, cos: Tensor, sin: Tensor, step: StepInputs) -> Tensor:
        """streams [B, Q, n, D] -> [B, Q, n, D]."""
        post, comb, collapsed = self.attn_hc(streams)
        streams = mix_streams(streams, self.self_attn(self.input_layernorm(collapsed), cos, sin, step), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        return mix_streams(streams, self.mlp(self.post_attention_layernorm(collapsed), step), post, comb)


class HyperHead(nn.Module):
    """Collapses the streams once more, with sigmoid weights, before the final norm."""

    def __init__(self, args: V4Args):
        super().__init__()
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(args.hc_mult, args.hc_mult * args.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(args.hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: Tensor) -> Tensor:
        flat = unweighted_rms_norm(fp32(streams.flatten(-2)), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, fp32(self.hc_fn)) * fp32(self.hc_scale) + fp32(self.hc_base)) + self.eps
        return cast((pre[..., None] * streams).sum(dim=-2), streams.dtype)


class MultiTokenPrediction(DecoderLayer):
    """DeepSeek-V4's MTP module (`mtp.i` in the release), served as decoder layer
    `num_hidden_layers` (its caches are pool layers 2L and 2L + 1): at position i it takes the
    main model's streams after its last layer (before the stream head) and the embedding of token
    i + 1, each RMS-normed; the embedding, projected (`e_proj`), is added to every projected
    stream (`h_proj`); its decoder layer runs at position i and its own stream head and norm
    collapse the result for the main model's LM head (which it shares, as the embedding), which
    predicts token i + 2. DeepSeek's reference `MTPBlock` computes the same."""

    def __init__(self, args: V4Args, layer: int, rotary: RotaryEmbedding, local_experts: int | None = None,
                 tp: int = 1):
        super().__init__(args, layer, rotary, local_experts, tp)
        self.e_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.h_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.enorm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hc_head = HyperHead(args)
        self.final_norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)

    def predict(self, streams: Tensor, next_embedded: Tensor, cos: Tensor, sin: Tensor, step: StepInputs) -> Tensor:
        """streams [B, Q, n, D], next_embedded [B, Q, D] -> the module's streams [B, Q, n, D];
        writes its caches for the step's slots."""
        x = self.e_proj(self.enorm(next_embedded))[:, :, None] + self.h_proj(self.hnorm(streams))
        return self(x, cos, sin, step)

    def head_input(self, streams: Tensor) -> Tensor:
        """The module's streams [..., n, D] -> the LM head's input [..., D]."""
        return self.final_norm(self.hc_head(streams))


class Backbone(nn.Module):
    """Embedding, decoder layers, stream head and final norm (HF's `model.` prefix), and the MTP
    module served as the draft (`mtp`, empty without)."""

    def __init__(self, args: V4Args, local_experts: int | None = None, tp: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size // tp)  # this rank's columns
        rope_dims = args.rope_head_dim
        self.main_rotary = RotaryEmbedding(args.main_rope, rope_dims)
        self.compress_rotary = RotaryEmbedding(args.compress_rope, rope_dims)

        def rotary(layer: int) -> RotaryEmbedding:
            return self.main_rotary if args.attention_type(layer) == SLIDING else self.compress_rotary

        self.layers = nn.ModuleList(DecoderLayer(args, i, rotary(i), local_experts, tp)
                                    for i in range(args.num_hidden_layers))
        self.hc_head = HyperHead(args)
        self.norm = FP32RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mtp = nn.ModuleList(MultiTokenPrediction(args, i, rotary(i), local_experts, tp)
                                 for i in range(args.num_hidden_layers, args.served_layers))


class DeepseekV4(nn.Module):
    """DeepSeek-V4 causal LM over a paged pool; one call is one step (the signature of
    `DeepseekV3.forward`)."""

    def __init__(self, args: V4Args, local_experts: int | None = None, tp: int = 1):
        super().__init__()
        self.args, self.tp = args, tp
        self.model = Backbone(args, local_experts, tp)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size // tp, bias=False)  # this rank's vocabulary

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, Q] token ids -> the first layer's input: the embedding in every stream [B, Q, n, D]."""
        x = gather_over_tp(self.model.embed_tokens(input_ids), self.tp)
        return x[:, :, None, :].expand(-1, -1, self.args.hc_mult, -1).contiguous()

    def layer_rope(self, layer: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, Q, P/2] of `positions` as layer `layer` takes them (main or compress RoPE)."""
        return self._served(layer).self_attn.rotary(positions, dtype)

    def _served(self, layer: int) -> DecoderLayer:
        return self.model.layers[layer] if layer < self.args.num_hidden_layers else \
            self.model.mtp[layer - self.args.num_hidden_layers]

    def new_kv_pool(self, num_blocks: int, block_size: int) -> Tensor:
        """A zeroed pool [2L, N, S, C] in the model dtype."""
        shape = kv_pool_shape(self.args.cache_layers, num_blocks, block_size, self.args.kv_cache_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.model.embed_tokens.weight.device)

    def forward(self, input_ids: Tensor, positions: Tensor, block_table: Tensor, slot_mapping: Tensor,
                kv_pool: Tensor, logits_index: Tensor | None = None, parallel: Parallelism = Parallelism(),
                moe_form: str | None = None) -> Tensor:
        """One step; arguments and result as `DeepseekV3.forward`."""
        if moe_form is not None and moe_form not in MOE_FORMS:
            raise ValueError(f"moe_form {moe_form!r}; expected one of {MOE_FORMS}")
        step = StepInputs(positions, block_table, slot_mapping, kv_pool, parallel, moe_form, input_ids)
        streams = self.decoder_layers(input_ids, step)  # [B, Q, n, D]
        if logits_index is not None:
            index = logits_index.view(-1, 1, 1, 1).expand(-1, 1, *streams.shape[2:])
            streams = streams.gather(1, index).squeeze(1)  # [B, n, D]
        return self.logits(streams.flatten(-2))

    def decoder_layers(self, input_ids: Tensor, step: StepInputs) -> Tensor:
        """[B, Q] tokens -> the streams after the last main layer [B, Q, n, D]."""
        streams = self.embed(input_ids)
        ropes = {rotary: rotary(step.positions, self.dtype) for rotary in (self.model.main_rotary,
                                                                           self.model.compress_rotary)}
        for layer in self.model.layers:
            streams = layer(streams, *ropes[layer.self_attn.rotary], step)
        return streams

    # Speculative decoding (`graphc.models.speculation`) sees a position's hidden state as its
    # streams flattened, [..., n * D]: what the LM head collapses and what the MTP module reads.

    def final_hidden(self, input_ids: Tensor, step: StepInputs) -> Tensor:
        """[B, Q] tokens -> the main model's streams after its last layer, flattened [B, Q, n * D]."""
        return self.decoder_layers(input_ids, step.with_input_ids(input_ids)).flatten(-2)

    def logits(self, hidden: Tensor) -> Tensor:
        """The main model's flattened streams [..., n * D] -> logits [..., V]."""
        streams = hidden.unflatten(-1, (self.args.hc_mult, -1))
        return gather_over_tp(self.lm_head(self.model.norm(self.model.hc_head(streams))), self.tp)

    def draft_hidden(self, hidden: Tensor, next_ids: Tensor, step: StepInputs) -> Tensor:
        """The MTP module at the step's positions: `hidden` [B, Q, n * D] (position i's streams, or
        the module's own output when drafting further ahead) and `next_ids` [B, Q] (token i + 1)
        -> its streams [B, Q, n * D]; writes its caches."""
        mtp = self.model.mtp[0]
        step = step.with_input_ids(next_ids)
        cos, sin = mtp.self_attn.rotary(step.positions, self.dtype)
        streams = hidden.unflatten(-1, (self.args.hc_mult, -1))
        return mtp.predict(streams, gather_over_tp(self.model.embed_tokens(next_ids), self.tp), cos, sin,
                           step).flatten(-2)

    def draft_logits(self, drafted: Tensor) -> Tensor:
        """The MTP module's flattened streams [..., n * D] -> its logits for the token after next [..., V]."""
        streams = drafted.unflatten(-1, (self.args.hc_mult, -1))
        return gather_over_tp(self.lm_head(self.model.mtp[0].head_input(streams)), self.tp)
