"""`graphc plan`'s prediction of DeepSeek-V4 attention's collectives over cp (`model.py`)."""

from __future__ import annotations

from graphc.models.deepseek_v4.args import CSA, HCA, V4Args
from graphc.models.family import Collective


def attention_collectives(args: V4Args, tokens: int, context_slots: int | None, width: int) -> list[Collective]:
    """Each compressed layer combines its compressors' partial window pools, the fp32 pool [T, c]
    and its per-channel log-sum-exp [T, c] (c = head_dim, plus index_head_dim in CSA layers, whose
    indexer pools too); each CSA layer then combines its indexer's top-k candidates, [T, k] int64
    positions and fp32 scores (k = min(index_topk, the entries the block table addresses)); every
    layer combines its attention partials [T, H, head_dim] and [T, H], fp32."""
    kinds = [args.layer_types[i] for i in range(args.num_hidden_layers)]
    out = []
    for kind, pooled in ((HCA, args.head_dim), (CSA, args.head_dim + args.index_head_dim)):
        if kind in kinds:
            out.append(Collective("attention_combine", "cp", kinds.count(kind), tokens * pooled * 2 * 4))
    if CSA in kinds:
        entries = (context_slots // args.csa_rate) if context_slots else args.index_topk
        out.append(Collective("index_topk_combine", "cp", kinds.count(CSA), tokens * min(args.index_topk, entries) * 12))
    heads = args.num_attention_heads
    out.append(Collective("attention_combine", "cp", len(kinds), tokens * heads * (args.head_dim + 1) * 4))
    return out
