"""`graphc plan`'s prediction of DeepSeek-V4 attention's collectives over cp (`model.py`)."""

from __future__ import annotations

import dataclasses

from graphc.models.deepseek_v4.args import CSA, HCA, MOE, V4Args
from graphc.models.family import Collective


def attention_collectives(args: V4Args, tokens: int, context_slots: int | None, width: int,
                          tp: int = 1) -> list[Collective]:
    """Each compressed layer combines its compressors' partial window pools, the fp32 pool [T, c]
    and its per-channel log-sum-exp [T, c] (c = head_dim, plus index_head_dim in CSA layers, whose
    indexer pools too); each CSA layer then combines its indexer's top-k candidates, [T, k] int64
    positions and fp32 scores (k = min(index_topk, the entries the block table addresses)); every
    layer combines its attention partials [T, H, head_dim] and [T, H], fp32, of the rank's H =
    heads / tp."""
    kinds = [args.layer_types[i] for i in range(args.num_hidden_layers)]
    out = []
    for kind, pooled in ((HCA, args.head_dim), (CSA, args.head_dim + args.index_head_dim)):
        if kind in kinds:
            out.append(Collective("attention_combine", "cp", kinds.count(kind), tokens * pooled * 2 * 4))
    if CSA in kinds:
        entries = (context_slots // args.csa_rate) if context_slots else args.index_topk
        out.append(Collective("index_topk_combine", "cp", kinds.count(CSA), tokens * min(args.index_topk, entries) * 12))
    heads = args.num_attention_heads // tp
    out.append(Collective("attention_combine", "cp", len(kinds), tokens * heads * (args.head_dim + 1) * 4))
    return out


def draft_layer(args: V4Args) -> V4Args:
    """The MTP module (`mtp.0`: its attention kind, routed by score) as a one-layer model."""
    return dataclasses.replace(args, num_hidden_layers=1, layer_types=(args.attention_type(args.num_hidden_layers),),
                               mlp_layer_types=(MOE,), num_nextn_predict_layers=0, draft_layer_types=(),
                               draft_layers=0)


def tensor_parallel_collectives(args: V4Args, tokens: int, rows: int, context_slots: int, shard_keys: int,
                                width: int, tp: int, shared_with_routed: bool) -> list[Collective]:
    """Over tp: the embedding's columns gathered ([T, D / tp]) before the streams fork; per layer
    one all-reduce of [T, D] after the grouped output projection and one after the shared experts
    (unless the MoE's all-reduce over ep sums them, `shared_with_routed`), and in each CSA layer one of the indexer's fp32 head-weighted scores [T, E] (E the entries the
    block table addresses); the LM head's vocabulary gathered ([B, V / tp]) at the end."""
    kinds = [args.layer_types[i] for i in range(args.num_hidden_layers)]
    out = [Collective("gather_columns", "tp", 1, tokens * args.hidden_size // tp * width)]
    if CSA in kinds:
        entries = context_slots // args.csa_rate
        out.append(Collective("all_reduce", "tp", kinds.count(CSA), tokens * entries * 4))
    out.append(Collective("all_reduce", "tp", (1 if shared_with_routed else 2) * len(kinds),
                          tokens * args.hidden_size * width))
    out.append(Collective("gather_columns", "tp", 1, rows * args.vocab_size // tp * width))
    return out
