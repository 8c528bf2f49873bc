"""`graphc plan`: what a compile would build and what serving it costs, before any capture.

Everything here is arithmetic on the config, the checkpoint's config.json and (optionally) a
workload of prompt lengths: the bucket table, the padding the workload would pay in it (against
a power-of-two ladder with as many graphs), the graphs per rank and in all, and the collectives
each rank issues per step with their payloads. Tests hold the collective counts to those of
compiled graphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from graphc.backends import backend
from graphc.buckets.selection import Bucket, max_prefill_chunk

from graphc.buckets.planner import Histogram, chunk_histogram, padding_waste, power_of_two_ladder
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.models.family import Collective
from graphc.models.moe_forms import shared_experts_reduced_with_routed, step_moe_form
from graphc.models.registry import family_of
from graphc.models.step_model import ModelArgs
from graphc.step import blocks_per_row
from graphc.topology import GROUPS, Topology

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_collectives(args: ModelArgs, topology: Topology, bucket: Bucket, dtype: str, exchange: str,
                     context_slots: int | None = None, block_size: int = 1, draft_tokens: int = 0) -> list[Collective]:
    """The collectives of one step in `bucket` on any rank (every rank issues the same ones, each
    over its own group of the name).

    Attention over cp: the family's prediction (`Family.predictions.attention_collectives`), given the
    block table's token capacity `context_slots` (of blocks of `block_size` tokens). Tensor
    parallelism's over tp (`Family.predictions.tensor_parallel_collectives`), given the keys of a KV shard
    (`context_slots` when the table's blocks are dealt over cp). MoE layers over ep, by `exchange` (`MOE_EXCHANGES`): `static` all-reduces the routed output
    [T, D]; `ag_rs` all-gathers the tokens [T, D] and reduce-scatters [T * ep, D]; the
    all-to-alls send [ep, T] blocks of rows [D] and fp32 routes [2K] and take back [ep, T, D]
    (`a2a_v` sends only the rows routed, so these are its upper bounds, plus an all-gather of its
    int64 split counts [ep]), plus the family's other collectives over ep
    (`Family.predictions.expert_group_collectives`: V4.1's Engram lookups). A group of one rank issues nothing
    (the pass lowers it away).

    A speculative step (`draft_tokens` k > 0, `models/speculation.py`) takes the LM head at 1 + k
    positions a row, then runs its draft layers (`Drafter.layer`) as `draft_passes` says; a score
    step at every position (`Bucket.head_rows`).
    Collectives of the same op, group and payload are counted together.
    """
    tokens, rows = bucket.rows * bucket.width, bucket.rows
    passes = [(args, tokens, bucket.head_rows(draft_tokens))]
    if draft_tokens:
        draft = family_of(args).drafter.layer(args)
        passes += [(draft, *counts) for counts in draft_passes(args, tokens, rows, draft_tokens)]
    counted: dict[tuple[str, str, int], int] = {}
    for layers, layer_tokens, head_rows in passes:
        for c in _model_collectives(layers, topology, layer_tokens, head_rows, dtype, exchange, context_slots,
                                    block_size):
            counted[c.op, c.group, c.bytes_in] = counted.get((c.op, c.group, c.bytes_in), 0) + c.count
    return [Collective(op, group, count, payload) for (op, group, payload), count in counted.items()]


def draft_passes(args: ModelArgs, tokens: int, rows: int, draft_tokens: int) -> list[tuple[int, int]]:
    """The draft layers' passes in a speculative step of `rows` rows and `tokens` tokens, as (tokens
    through the draft layers, rows through the LM head): the family drafter's (`Drafter.passes`)."""
    return family_of(args).drafter.passes(args, tokens, rows, draft_tokens)


def _model_collectives(args: ModelArgs, topology: Topology, tokens: int, rows: int, dtype: str, exchange: str,
                       context_slots: int | None, block_size: int) -> list[Collective]:
    """`step_collectives` of the layers of `args` over `tokens` tokens, the LM head over `rows`."""
    moe_layers = args.num_hidden_layers - args.first_k_dense_replace
    width = DTYPE_BYTES[dtype]
    hidden = tokens * args.hidden_size * width
    family = family_of(args)
    out = family.predictions.attention_collectives(args, tokens, context_slots, width, topology.tp) if topology.cp > 1 else []
    if topology.tp > 1:
        slots = context_slots or 0
        shard_keys = -(-slots // block_size // topology.cp) * block_size
        out += family.predictions.tensor_parallel_collectives(args, tokens, rows, slots, shard_keys, width, topology.tp,
                                                  shared_experts_reduced_with_routed(exchange, topology.ep, topology.tp))
    ep = topology.ep
    if ep == 1 or not moe_layers:
        return out
    out += family.predictions.expert_group_collectives(args, tokens, width, exchange, ep)
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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe(config: GraphcConfig, workload: Histogram | None) -> list[str]:
    """The plan report, line by line."""
    args = config.model_args
    b, topology = config.buckets, config.topology
    buckets = config.compiled_buckets
    origin = f"planned from {b.auto.workload}, budget {b.auto.graphs} graphs per rank" if b.auto else "as listed"
    lines = [f"buckets ({origin}); context_limit {b.context_limit}",
             f"  prefill chunks      {b.prefill}",
             f"  decode batches      {b.decode}",
             f"  prompt-as-decode P  {b.prompt_as_decode}" + ("  (off)" if b.prompt_as_decode == 0 else
                                                              "  (plain decode rows)" if b.prompt_as_decode == 1 else
                                                              f"  ([B, {b.prompt_as_decode}] graphs per decode batch)")]
    if config.draft_tokens:
        lines.append(f"  speculative k       {config.draft_tokens}  ({config.model.speculative.method} drafts; decode rows "
                     f"are [B, {1 + config.draft_tokens}] verify graphs)")
    if workload:
        lines += _waste_lines(config, workload)
    exchange, _ = backend(config.backend).exchange(config.model.moe_lowering, topology)
    world = topology.world
    lines += [f"graphs: {len(buckets)} per rank x {world} rank(s) = {len(buckets) * world} in all, "
              f"{len(buckets)} distinct (one program per bucket, every rank's; a rank's KV shard and experts "
              "are an input, its tensor-parallel slice its weights)"]
    lines.append(f"groups (dp={topology.dp}, cp={topology.cp}, tp={topology.tp}, ep={topology.ep}; "
                 f"MoE exchange {exchange}):")
    for name in GROUPS:
        groups = topology.groups(name)
        lines.append(f"  {name:5s} {len(groups)} x {topology.group_size(name)} rank(s): "
                     + " ".join(str(ranks) for ranks in groups))
    lines.append("routed-expert form and collectives per step per group, every rank:")
    for bucket in buckets:
        slots = blocks_per_row(config.buckets.context_limit, config.kv_cache.block_size) * config.kv_cache.block_size
        calls = step_collectives(args, topology, bucket, config.model.dtype, exchange, context_slots=slots,
                                 block_size=config.kv_cache.block_size, draft_tokens=config.draft_tokens)
        text = ", ".join(f"{c.count} x {c.op}({c.group}) of {format_bytes(c.bytes_in)}" for c in calls) or "none"
        form = step_moe_form(config.model.moe_form, bucket.rows * bucket.width, args.num_experts_per_tok,
                             args.n_routed_experts, topology.ep, exchange,
                             backend(config.backend).fuses_gather)
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


def plot(path: Path, config: GraphcConfig, workload: Histogram | None,
         memory_panel: Callable[[Any], None] | None = None) -> None:
    """The prompt-length distribution with the prefill bucket edges and each bucket's padding
    (given a workload), and beside it `memory_panel`'s drawing on its own axis (a rank's memory
    against its device: `device_plan.plot`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GraphcError("--plot needs matplotlib (pip install matplotlib)") from None
    panels = [p for p in (workload, memory_panel) if p is not None]
    figure, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 4.5), squeeze=False)
    if workload is not None:
        _plot_workload(axes[0][0], config, workload)
    if memory_panel is not None:
        memory_panel(axes[0][-1])
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_workload(axis, config: GraphcConfig, workload: Histogram) -> None:
    b = config.buckets
    chunks = _chunks(config, workload)
    waste = padding_waste(chunks, b.prefill)
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
