"""`graphc plan`'s prediction of DeepSeek-V3 / V3.2's collectives over cp (attention) and tp."""

from __future__ import annotations

import dataclasses

from graphc.models.deepseek_v3.args import V3Args
from graphc.models.family import Collective


def attention_collectives(args: V3Args, tokens: int, context_slots: int | None, width: int,
                          tp: int = 1) -> list[Collective]:
    """One `attention_combine` per layer, of the fp32 partial output [T, H, R] and its log-sum-exp
    [T, H] of the rank's H = heads / tp (all-reduced: the maximum of the one, then both summed).
    Sparse attention (V3.2) adds one `index_topk_combine` per layer, all-gathering each token's k
    candidate positions (int64) and scores (fp32), k = min(index_topk, context_slots),
    context_slots being the block table's token capacity."""
    out = []
    if args.sparse_attention:
        selected = min(args.index_topk, context_slots or args.index_topk)
        out.append(Collective("index_topk_combine", "cp", args.num_hidden_layers, tokens * selected * (8 + 4)))
    out.append(Collective("attention_combine", "cp", args.num_hidden_layers,
                          tokens * args.num_attention_heads // tp * (args.kv_lora_rank + 1) * 4))
    return out


def draft_layer(args: V3Args) -> V3Args:
    """The MTP layer (layer `num_hidden_layers`: MLA, V3.2's indexer, MoE) as a one-layer model."""
    return dataclasses.replace(args, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0,
                               draft_layers=0)


def tensor_parallel_collectives(args: V3Args, tokens: int, rows: int, context_slots: int, shard_keys: int,
                                width: int, tp: int, shared_with_routed: bool) -> list[Collective]:
    """Over tp: the embedding's columns gathered ([T, D / tp]) before the first layer; per layer one
    all-reduce of [T, D] after o_proj and one after the dense or shared FFN (none after the shared
    experts where the MoE's all-reduce over ep sums them, `shared_with_routed`), and under sparse
    attention (V3.2) one of the indexer's fp32 head-summed scores [T, K] of the shard's K keys;
    the LM head's vocabulary gathered ([B, V / tp]) at the end."""
    dense = args.first_k_dense_replace
    shared = args.n_shared_experts and not shared_with_routed
    ffn_layers = dense + (args.num_hidden_layers - dense if shared else 0)
    out = [Collective("gather_columns", "tp", 1, tokens * args.hidden_size // tp * width)]
    if args.sparse_attention:
        out.append(Collective("all_reduce", "tp", args.num_hidden_layers, tokens * shard_keys * 4))
    out.append(Collective("all_reduce", "tp", args.num_hidden_layers + ffn_layers, tokens * args.hidden_size * width))
    out.append(Collective("gather_columns", "tp", 1, rows * args.vocab_size // tp * width))
    return out
