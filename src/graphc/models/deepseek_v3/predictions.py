"""`graphc plan`'s prediction of DeepSeek-V3 / V3.2 attention's collectives over cp."""

from __future__ import annotations

from graphc.models.deepseek_v3.args import V3Args
from graphc.models.family import Collective


def attention_collectives(args: V3Args, tokens: int, context_slots: int | None, width: int) -> list[Collective]:
    """One `attention_combine` per layer, all-gathering the fp32 partial output [T, H, R] and its
    log-sum-exp [T, H]. Sparse attention (V3.2) adds one `index_topk_combine` per layer,
    all-gathering each token's k candidate positions (int64) and scores (fp32), k =
    min(index_topk, context_slots), context_slots being the block table's token capacity."""
    out = []
    if args.sparse_attention:
        selected = min(args.index_topk, context_slots or args.index_topk)
        out.append(Collective("index_topk_combine", "cp", args.num_hidden_layers, tokens * selected * (8 + 4)))
    out.append(Collective("attention_combine", "cp", args.num_hidden_layers,
                          tokens * args.num_attention_heads * (args.kv_lora_rank + 1) * 4))
    return out
