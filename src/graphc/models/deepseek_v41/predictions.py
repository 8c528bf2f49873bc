"""`graphc plan`'s prediction of DeepSeek-V4.1's collectives: its attention's over cp
(`model.py`) and its Engram lookups' over ep (`engram.py`)."""

from __future__ import annotations

from graphc.models.deepseek_v41.args import TOKEN_ID_DIGITS, V41Args
from graphc.models.family import Collective


def attention_collectives(args: V41Args, tokens: int, context_slots: int | None, width: int,
                          tp: int = 1) -> list[Collective]:
    """Each pooling KV source combines its partial window pools, fp32 [T, head_dim] and their
    log-sum-exp; the candidate layer takes the max of its blocks' scores, fp32 [T, blocks]; each
    index layer combines its top-k candidates, [T, k] int64 and fp32 (k = min(index_topk, its
    ratio's entries in the block table)); every layer combines its attention partials; with
    Engram, one all-reduce per step of the n-gram contexts' cached token-id digits [T, N, 3] (the
    left halo). Attention partials are of the rank's heads / tp."""
    def entries(layer: int) -> int:
        return (context_slots or args.index_topk * args.compress_ratios[layer]) // args.compress_ratios[layer]

    out = []
    pooling = [i for i in args.kv_source_layer_ids if args.compress_ratios[i] > 1]
    if pooling:
        out.append(Collective("attention_combine", "cp", len(pooling), tokens * args.head_dim * 2 * 4))
    if args.candidate_source_layer_id >= 0:
        blocks = -(-entries(args.candidate_source_layer_id) // args.candidate_block_size)
        out.append(Collective("all_reduce_max", "cp", 1, tokens * blocks * 4))
    for layer in args.index_source_layer_ids:
        out.append(Collective("index_topk_combine", "cp", 1, tokens * min(args.index_topk, entries(layer)) * 12))
    out.append(Collective("attention_combine", "cp", args.num_hidden_layers,
                          tokens * args.num_attention_heads // tp * (args.head_dim + 1) * 4))
    if args.engram is not None:
        out.append(Collective("all_reduce", "cp", 1, tokens * args.engram.max_ngram * TOKEN_ID_DIGITS * width))
    return out


def tensor_parallel_collectives(args: V41Args, tokens: int, rows: int, context_slots: int, shard_keys: int,
                                width: int, tp: int, shared_with_routed: bool) -> list[Collective]:
    """Over tp: the embedding's columns gathered ([T, D / tp]); per layer one all-reduce of [T, D]
    after the grouped output projection and one after the shared expert (unless the MoE's
    all-reduce over ep sums it, `shared_with_routed`); per index layer one of its indexer's fp32
    scores [T, E] (E its ratio's entries in the block table); the fp32 logits' vocabulary gathered
    ([B, V / tp]) at the end."""
    out = [Collective("gather_columns", "tp", 1, tokens * args.hidden_size // tp * width)]
    for layer in args.index_source_layer_ids:
        out.append(Collective("all_reduce", "tp", 1, tokens * (context_slots // args.compress_ratios[layer]) * 4))
    out.append(Collective("all_reduce", "tp", (1 if shared_with_routed else 2) * args.num_hidden_layers,
                          tokens * args.hidden_size * width))
    out.append(Collective("gather_columns", "tp", 1, rows * args.vocab_size // tp * 4))
    return out


def engram_collectives(args: V41Args, tokens: int, width: int, exchange: str, ep: int) -> list[Collective]:
    """Each Engram layer's table lookup over ep: the rows read [T, K d] all-reduced when the group
    shares its tokens (`static`), else the int64 row ids [T, K] all-gathered and the rows
    [T * ep, K d] reduce-scattered."""
    if args.engram is None:
        return []
    layers, columns = len(args.engram.layer_ids), args.engram.columns
    rows = tokens * columns * args.engram.head_dim * width
    if exchange == "static":
        return [Collective("all_reduce", "ep", layers, rows)]
    return [Collective("moe_dispatch", "ep", layers, tokens * columns * 8),
            Collective("moe_combine", "ep", layers, rows * ep)]
