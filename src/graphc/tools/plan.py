"""`graphc plan`: what a compile would build and what serving it costs, before any capture.

Everything here is arithmetic on the config, the checkpoint's config.json and (optionally) a
workload of prompt lengths: the bucket table, the padding the workload would pay in it (against
a power-of-two ladder with as many graphs), the graphs per rank and in all, and the collectives
each rank issues per step with their payloads. Tests hold the collective counts to those of
compiled graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graphc.backends import backend
from graphc.buckets.selection import Bucket, all_buckets, max_prefill_chunk

from graphc.buckets.planner import Histogram, chunk_histogram, padding_waste, power_of_two_ladder
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.models.args import ModelArgs
from graphc.models.moe_forms import moe_exchange, step_moe_form
from graphc.models.v41_args import TOKEN_ID_DIGITS, V41Args
from graphc.models.v4_args import CSA, HCA, V4Args
from graphc.step import blocks_per_row
from graphc.topology import GROUPS, Topology

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Collective:
    """One kind of collective a rank issues in a step: `count` calls, each taking `bytes_in`."""

    op: str
    group: str
    count: int
    bytes_in: int


def step_collectives(args: ModelArgs | V4Args | V41Args, topology: Topology, bucket: Bucket, dtype: str, exchange: str,
                     context_slots: int | None = None) -> list[Collective]:
    """The collectives of one step in `bucket` on any rank (every rank issues the same ones, each
    over its own group of the name).

    Attention: one `attention_combine` per layer over cp, all-gathering the fp32 partial output
    [T, H, R] and its log-sum-exp [T, H]. Sparse attention (V3.2) adds one `index_topk_combine`
    per layer over cp, all-gathering each token's k candidate positions (int64) and scores (fp32),
    k = min(index_topk, context_slots), context_slots being the block table's token capacity.
    MoE layers over ep, by `exchange` (`MOE_EXCHANGES`): `static` all-reduces the routed output
    [T, D]; `ag_rs` all-gathers the tokens [T, D] and reduce-scatters [T * ep, D]; the
    all-to-alls send [ep, T] blocks of rows [D] and fp32 routes [2K] and take back [ep, T, D]
    (`a2a_v` sends only the rows routed, so these are its upper bounds, plus an all-gather of its
    int64 split counts [ep]). A group of one rank issues nothing (the pass lowers it away).
    DeepSeek-V4's attention collectives: `_v4_attention_collectives`; V4.1's,
    `_v41_attention_collectives`, and its Engram lookups over ep, `_engram_collectives`.
    """
    tokens = bucket.rows * bucket.width
    moe_layers = args.num_hidden_layers - args.first_k_dense_replace
    width = DTYPE_BYTES[dtype]
    hidden = tokens * args.hidden_size * width
    out: list[Collective] = []
    if topology.cp > 1 and isinstance(args, V41Args):
        out += _v41_attention_collectives(args, tokens, context_slots, width)
    elif topology.cp > 1 and isinstance(args, V4Args):
        out += _v4_attention_collectives(args, tokens, context_slots)
    elif topology.cp > 1:
        heads = args.num_attention_heads
        if args.sparse_attention:
            selected = min(args.index_topk, context_slots or args.index_topk)
            out.append(Collective("index_topk_combine", "cp", args.num_hidden_layers, tokens * selected * (8 + 4)))
        out.append(Collective("attention_combine", "cp", args.num_hidden_layers, tokens * heads * (args.kv_lora_rank + 1) * 4))
    ep = topology.ep
    if ep == 1 or not moe_layers:
        return out
    if isinstance(args, V41Args) and args.engram is not None:
        out += _engram_collectives(args, tokens, width, exchange, ep)
    if exchange == "static":
        out.append(Collective("all_reduce", "ep", moe_layers, hidden))
    elif exchange == "ag_rs":
        out.append(Collective("moe_dispatch", "ep", moe_layers, hidden))
        out.append(Collective("moe_combine", "ep", moe_layers, hidden * ep))
    else:
        routes = ep * tokens * 2 * args.num_experts_per_tok * 4
        counts = ep * 8 if exchange == "a2a_v" else 0
        out.append(Collective("moe_a2a_dispatch", "ep", moe_layers, ep * hidden + routes + counts))
        out.append(Collective("moe_a2a_combine", "ep", moe_layers, ep * hidden))
    return out


def _v4_attention_collectives(args: V4Args, tokens: int, context_slots: int | None) -> list[Collective]:
    """DeepSeek-V4's attention over cp (`models/deepseek_v4.py`): each compressed layer combines
    its compressors' partial window pools, the fp32 pool [T, c] and its per-channel log-sum-exp
    [T, c] (c = head_dim, plus index_head_dim in CSA layers, whose indexer pools too); each CSA
    layer then combines its indexer's top-k candidates, [T, k] int64 positions and fp32 scores
    (k = min(index_topk, the entries the block table addresses)); every layer combines its
    attention partials [T, H, head_dim] and [T, H], fp32."""
    kinds = [args.layer_types[i] for i in range(args.num_hidden_layers)]
    out = []
    for kind, width in ((HCA, args.head_dim), (CSA, args.head_dim + args.index_head_dim)):
        if kind in kinds:
            out.append(Collective("attention_combine", "cp", kinds.count(kind), tokens * width * 2 * 4))
    if CSA in kinds:
        entries = (context_slots // args.csa_rate) if context_slots else args.index_topk
        out.append(Collective("index_topk_combine", "cp", kinds.count(CSA), tokens * min(args.index_topk, entries) * 12))
    heads = args.num_attention_heads
    out.append(Collective("attention_combine", "cp", len(kinds), tokens * heads * (args.head_dim + 1) * 4))
    return out


def _v41_attention_collectives(args: V41Args, tokens: int, context_slots: int | None,
                               width: int) -> list[Collective]:
    """DeepSeek-V4.1's attention over cp (`models/deepseek_v41.py`): each pooling KV source
    combines its partial window pools, fp32 [T, head_dim] and their log-sum-exp; the candidate
    layer takes the max of its blocks' scores, fp32 [T, blocks]; each index layer combines its
    top-k candidates, [T, k] int64 and fp32 (k = min(index_topk, its ratio's entries in the block
    table)); every layer combines its attention partials; with Engram, one all-reduce per step of
    the n-gram contexts' cached token-id digits [T, N, 3] (the left halo)."""
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
                          tokens * args.num_attention_heads * (args.head_dim + 1) * 4))
    if args.engram is not None:
        out.append(Collective("all_reduce", "cp", 1, tokens * args.engram.max_ngram * TOKEN_ID_DIGITS * width))
    return out


def _engram_collectives(args: V41Args, tokens: int, width: int, exchange: str, ep: int) -> list[Collective]:
    """Each Engram layer's table lookup over ep (`models/engram.py`): the rows read [T, K d]
    all-reduced when the group shares its tokens (`static`), else the int64 row ids [T, K]
    all-gathered and the rows [T * ep, K d] reduce-scattered."""
    layers, columns = len(args.engram.layer_ids), args.engram.columns
    rows = tokens * columns * args.engram.head_dim * width
    if exchange == "static":
        return [Collective("all_reduce", "ep", layers, rows)]
    return [Collective("moe_dispatch", "ep", layers, tokens * columns * 8),
            Collective("moe_combine", "ep", layers, rows * ep)]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe(config: GraphcConfig, args: ModelArgs, workload: Histogram | None) -> list[str]:
    """The plan report, line by line."""
    b, t = config.buckets, config.topology
    buckets = all_buckets(b.prefill, b.decode, b.prompt_as_decode)
    origin = f"planned from {b.auto.workload}, budget {b.auto.graphs} graphs per rank" if b.auto else "as listed"
    lines = [f"buckets ({origin}); context_limit {b.context_limit}",
             f"  prefill chunks      {b.prefill}",
             f"  decode batches      {b.decode}",
             f"  prompt-as-decode P  {b.prompt_as_decode}" + ("  (off)" if b.prompt_as_decode == 0 else
                                                              "  (plain decode rows)" if b.prompt_as_decode == 1 else
                                                              f"  ([B, {b.prompt_as_decode}] graphs per decode batch)")]
    if workload:
        lines += _waste_lines(config, workload)
    topology = t.topology()
    exchange = moe_exchange(config.model.moe_lowering, topology.ep, topology.tokens_replicated)
    world = topology.world
    programs = backend(config.backend).programs(world)
    lines += [f"graphs: {len(buckets)} per rank x {world} rank(s) = {len(buckets) * world} in all, "
              f"{len(buckets) * len(programs)} distinct ({' and '.join(programs)} program per bucket; "
              "a rank's KV shard and experts are an input)"]
    lines.append(f"groups (dp={topology.dp}, cp={topology.cp}, ep={topology.ep}; MoE exchange {exchange}):")
    for name in GROUPS:
        groups = topology.groups(name)
        lines.append(f"  {name:5s} {len(groups)} x {topology.group_size(name)} rank(s): "
                     + " ".join(str(ranks) for ranks in groups))
    lines.append("routed-expert form and collectives per step per group, every rank:")
    for bucket in buckets:
        slots = blocks_per_row(config.buckets.context_limit, config.kv_cache.block_size) * config.kv_cache.block_size
        calls = step_collectives(args, topology, bucket, config.model.dtype, exchange, context_slots=slots)
        text = ", ".join(f"{c.count} x {c.op}({c.group}) of {_bytes(c.bytes_in)}" for c in calls) or "none"
        form = step_moe_form(config.model.moe_form, bucket.rows * bucket.width, args.num_experts_per_tok,
                             args.n_routed_experts, topology.ep, exchange)
        lines.append(f"  {bucket.name:14s} MoE {form:8s} {text}")
    return lines


def _waste_lines(config: GraphcConfig, workload: Histogram) -> list[str]:
    b = config.buckets
    if max(workload) >= b.context_limit:
        raise GraphcError(f"workload: prompt length {max(workload)} does not fit context_limit {b.context_limit}")
    chunks = _chunks(config, workload)
    requests = sum(workload.values())
    waste = padding_waste(chunks, b.prefill)
    ladder = power_of_two_ladder(len(b.prefill), max(b.prefill))
    ladder_waste = padding_waste(chunks, ladder)
    lines = [f"expected prefill padding over {requests} prompts (tokens per request):"]
    lines += [f"  prefill-{size:<8d} {w / requests:10.1f}" for size, w in waste.items()]
    total, ladder_total = sum(waste.values()) / requests, sum(ladder_waste.values()) / requests
    lines.append(f"  total          {total:10.1f}   vs power-of-two ladder {ladder}: {ladder_total:.1f}"
                 + (f" ({ladder_total / total:.2f}x)" if total else ""))
    return lines


def _chunks(config: GraphcConfig, workload: Histogram) -> Histogram:
    """The prefill chunks the runtime makes of the workload's prompts."""
    return chunk_histogram(workload, max_prefill_chunk(config.buckets.prefill, config.runtime.max_num_prefilling_tokens))


def plot(path: Path, config: GraphcConfig, workload: Histogram) -> None:
    """The prompt-length distribution with the prefill bucket edges and each bucket's padding."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GraphcError("--plot needs matplotlib (pip install matplotlib)") from None
    b = config.buckets
    chunks = _chunks(config, workload)
    waste = padding_waste(chunks, b.prefill)
    figure, axis = plt.subplots(figsize=(9, 4.5))
    lengths = sorted(chunks)
    axis.bar(lengths, [chunks[n] for n in lengths], width=max(1.0, max(lengths) / 300), color="tab:blue",
             label="prefill chunks")
    for size in b.prefill:
        axis.axvline(size, color="tab:red", linestyle="--", linewidth=1)
        axis.annotate(f"{size}\nwaste {waste[size] / sum(workload.values()):.1f}", (size, axis.get_ylim()[1] * 0.9),
                      fontsize=7, ha="right", color="tab:red")
    if b.prompt_as_decode > 1:
        axis.axvspan(0, b.prompt_as_decode, color="tab:green", alpha=0.15, label=f"prompt-as-decode (P={b.prompt_as_decode})")
    axis.set_xlabel("chunk length (tokens)")
    axis.set_ylabel("count")
    axis.set_title("prompt chunks and prefill buckets (padded tokens per request)")
    axis.legend(loc="upper center")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
