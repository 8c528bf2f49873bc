"""The work of one step on the busiest rank (`step_time.StepWork`), from a layout's weights.

A layout is graphc's compiled one (`config_work`: the config's topology, backend and MoE form per
bucket) or one described before graphc compiles it (`step_work` over a `Layout` of its own:
`perf.reference`'s NxD Inference layout, with expert tensor parallelism), both counted by the same
rules:

- weights: every tensor the rank holds but the routed experts, the embedding (one row a token)
  and the row-sharded lookup tables (a few rows a token, not counted), each in its stored dtype.
- routed experts, as the MoE lowering reads and computes them (`EXPERT_LOWERINGS`), per MoE
  layer on the busiest rank of the EP group (`routing.busiest_rank`).
- KV: every slot of each row's block table on the rank's cp shard (static shapes read the whole
  table, masked), at the context limit.
- matmuls: each 2-D weight over the step's tokens (the LM head over its rows), the routed experts'
  per the lowering; collectives: the runtime calls of the config's predicted collectives
  (`RUNTIME_CALLS`), each over its group's span on the device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from graphc.backends import backend
from graphc.buckets.selection import Bucket
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.models.layers import STACKED_EXPERT
from graphc.models.moe_forms import expert_blocks, local_rows_bound, step_moe_form
from graphc.models.registry import family_of
from graphc.models.step_model import ModelArgs
from graphc.ops.collectives import combine_gathers
from graphc.perf.device import DeviceModel, neuron_grouped_block
from graphc.perf.routing import busiest_rank
from graphc.perf.step_time import Matmul, RuntimeCollective, StepWork
from graphc.step import blocks_per_row
from graphc.tools.plan import draft_passes, step_collectives
from graphc.topology import Topology
from graphc.weights.abstract import StoredTensor, stored_tensors

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
"""Every family's token embedding in graphc's module: a step reads one row of it a token."""

EXPERT_LOWERINGS = {
    "dense": ("all", "experts x rows"),
    "expert-major": ("all", "experts x routes"),
    "blockwise": ("blocks", "blocks x block"),
    "grouped": ("hit", "routes"),
    "gather": ("routes", "routes"),
}
"""What a lowering of the routed experts reads (every local expert, each one the routes hit once,
one per route, or one per block) and computes (every local expert over every row or every route,
the blocks' padded rows, or the routes' rows alone), by name:
- `dense`, `gather`: the MoE forms of `RoutedExperts` (`gather` is also NxD Inference's selective
  loading for token generation: each route's expert slice read by index);
- `grouped` as ATen's grouped GEMM runs it on the CPU (dynamic: only the experts hit, only their rows);
- `grouped-neuron`: the neuron backend's rule, per call the cheaper by the step model on the
  program's target (`device.neuron_grouped_block`) of `expert-major` (one batched GEMM over every
  local expert and every route) and `blockwise` (routes sorted into blocks of `Layout.block`
  rows, a static ceil(L / B) + E' - 1 of them for L = `local_rows_bound`, each one GEMM against
  its expert's matrix read by index; also NxD Inference's dropless context encoding)."""

RUNTIME_CALLS = {
    "all_reduce": (("all_reduce", 1.0),),
    "all_reduce_max": (("all_reduce", 1.0),),
    "index_topk_combine": (("all_gather", 8 / 12), ("all_gather", 4 / 12)),  # int64 positions, fp32 scores
    "gather_columns": (("all_gather", 1.0),),
    "moe_dispatch": (("all_gather", 1.0),),
    "moe_combine": (("reduce_scatter", 1.0),),
    "moe_a2a_combine": (("all_to_all", 1.0),),
}
"""The runtime collectives a predicted collective op lowers to, each with its share of the op's
bytes (`runtime_calls`: the ops whose form depends on more than their name)."""


def runtime_calls(op: str, exchange: str, payload: int, group_size: int) -> tuple[tuple[str, float], ...]:
    if op == "attention_combine":  # one all-gather of every rank's payload, or the lse's max (tiny), then the sum
        if combine_gathers(payload, group_size):
            return (("all_gather", 1.0),)
        return (("all_reduce", 0.0), ("all_reduce", 1.0))
    if op == "moe_a2a_dispatch":  # the rows, then the routes; a2a_v all-gathers its split counts first
        return (("all_to_all", 1.0), ("all_to_all", 0.0)) + ((("all_gather", 0.0),) if exchange == "a2a_v" else ())
    if op not in RUNTIME_CALLS:
        raise GraphcError(f"the step model has no runtime form for the collective {op!r}")
    return RUNTIME_CALLS[op]


def rank_tensors(config: GraphcConfig) -> list[StoredTensor]:
    """Every tensor of one rank's weights file (`abstract.stored_tensors`)."""
    topology = config.topology
    return stored_tensors(config.model_args, config.model.checkpoint, getattr(torch, config.model.dtype),
                          config.model.weights == "as-stored", topology.ep, topology.tp)


def draft_tensor_names(config: GraphcConfig) -> set[str]:
    """The names of the tensors of the draft layers served (none without speculation)."""
    if not config.draft_tokens:
        return set()
    topology = config.topology
    plain = dataclasses.replace(config.model_args, draft_layers=0)
    main = stored_tensors(plain, config.model.checkpoint, getattr(torch, config.model.dtype),
                          config.model.weights == "as-stored", topology.ep, topology.tp)
    return {t.name for t in rank_tensors(config)} - {t.name for t in main}


@dataclass(frozen=True)
class Layout:
    """How a step's work lies on the ranks: enough to count the busiest rank's."""

    topology: Topology
    expert_lowering: str
    """A key of `EXPERT_LOWERINGS`, or `grouped-neuron` (resolved per call into one of them)."""
    exchange: str
    """The MoE exchange (`MOE_EXCHANGES`): which rows reach a rank's experts."""
    etp: int = 1
    """Expert tensor parallelism: each expert's intermediate split over etp ranks (described
    layouts only: graphc does not compile it yet)."""
    context_slots: int = 0
    block_size: int = 1
    block: int = 512
    """Rows a block of the `blockwise` lowering."""


def step_work(args: ModelArgs, tensors: list[StoredTensor], draft: set[str], layout: Layout, bucket: Bucket,
              dtype: str, draft_tokens: int, collectives: tuple[RuntimeCollective, ...]) -> StepWork:
    """`bucket`'s step on the busiest rank of `layout`, the rank holding `tensors`."""
    family = family_of(args)
    tokens, head_rows = bucket.rows * bucket.width, bucket.head_rows(draft_tokens)
    passes = draft_passes(args, tokens, bucket.rows, draft_tokens) if draft_tokens else []
    draft_tokens_through = sum(t for t, _ in passes)
    head_rows += sum(r for _, r in passes)
    tables = family.stored.row_sharded_tables
    weights, expert_bytes, matmuls = 0.0, 0.0, []
    for t in tensors:
        through = draft_tokens_through if t.name in draft else tokens
        if t.name == EMBEDDING:
            weights += t.nbytes / t.shape[0] * (tokens + draft_tokens_through)
        elif tables and t.name.endswith(tables):
            continue
        elif STACKED_EXPERT.match(t.name):
            continue
        else:
            weights += t.nbytes
            if len(t.shape) == 2 and t.dtype.is_floating_point:
                matmuls.append(Matmul(head_rows if t.name == HEAD else through, t.shape[1], t.shape[0]))
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    main = _expert_work(args, [t for t in tensors if STACKED_EXPERT.match(t.name) and t.name not in draft],
                        layout, tokens, itemsize)
    drafted = [_expert_work(family.drafter.layer(args), [t for t in tensors if STACKED_EXPERT.match(t.name)
                                                         and t.name in draft], layout, passed, itemsize)
               for passed, _ in passes]
    for reads, products in (main, *drafted):
        expert_bytes += reads
        matmuls += products
    context = math.ceil(layout.context_slots / layout.block_size / layout.topology.cp) * layout.block_size
    kv = bucket.rows * context * args.cache_layers * args.kv_cache_dim * itemsize
    layers = args.num_hidden_layers
    if passes:
        layers += len(passes) * family.drafter.layer(args).num_hidden_layers
    return StepWork(bucket.name, bucket.rows if bucket.kind == "decode" else tokens, layers, dtype, weights,
                    expert_bytes, kv, tuple(matmuls), collectives)


def _expert_work(args: ModelArgs, experts: list[StoredTensor], layout: Layout, tokens: int, itemsize: int
                 ) -> tuple[float, list[Matmul]]:
    """(bytes read, matmuls) of the routed experts of the MoE layers of `args` on the busiest rank;
    `itemsize` the compute dtype's bytes (what the neuron grouped GEMM's choice sees)."""
    moe_layers = args.num_hidden_layers - args.first_k_dense_replace
    if not experts or not moe_layers or not tokens:
        return 0.0, []
    topology, etp = layout.topology, layout.etp
    local = experts[0].shape[0]
    ep = args.n_routed_experts // local
    group_tokens = tokens * max(1, ep // topology.replica) if not topology.tokens_replicated else tokens
    rows = tokens if layout.exchange in ("local", "static") else tokens * ep  # what reaches a rank's experts
    per_token = args.num_experts_per_tok
    routes, bound = rows * per_token, local_rows_bound(rows, per_token, local)
    reads_bytes, matmuls = 0.0, []
    for t in experts[:2]:  # one MoE layer's gate-up [E', F, D] and down [E', D, I], every layer alike
        out_dim, in_dim = t.shape[1], t.shape[2]
        if t.name.endswith("gate_up_proj"):
            out_dim //= etp
        else:
            in_dim //= etp
        lowering, block = layout.expert_lowering, layout.block
        if lowering == "grouped-neuron":
            block = neuron_grouped_block(bound, routes, local, in_dim, out_dim, itemsize)
            lowering = "blockwise" if block else "expert-major"
        reads, computes = EXPERT_LOWERINGS[lowering]
        blocks = expert_blocks(bound, local, block) if lowering == "blockwise" else 0
        hit = reads == "hit"
        busiest = busiest_rank(group_tokens, args.n_routed_experts, per_token, getattr(args, "n_group", 1) or 1,
                               getattr(args, "topk_group", 1) or 1, ep) if hit else None
        expert_reads = {"all": local, "routes": routes, "blocks": blocks}[reads] if not hit else busiest.experts
        # A dispatch brings each token of the group once from every rank that holds it: their routes repeat.
        row_count = ({"experts x rows": local * rows, "experts x routes": local * routes,
                      "blocks x block": blocks * block, "routes": routes}[computes] if not hit
                     else busiest.routes * rows / group_tokens)
        reads_bytes += t.nbytes / local / etp * expert_reads * moe_layers
        matmuls.append(Matmul(row_count, in_dim, out_dim, moe_layers, routed=True))
    return reads_bytes, matmuls


def config_work(config: GraphcConfig, device: DeviceModel, tensors: list[StoredTensor] | None = None
                ) -> list[StepWork]:
    """Every bucket's step of `config` as graphc compiles it, on the busiest rank (`tensors`: the
    rank's, when known)."""
    args, topology = config.model_args, config.topology
    tensors, draft = tensors if tensors is not None else rank_tensors(config), draft_tensor_names(config)
    exchange, _ = backend(config.backend).exchange(config.model.moe_lowering, topology)
    slots = blocks_per_row(config.buckets.context_limit, config.kv_cache.block_size) * config.kv_cache.block_size
    works = []
    for bucket in config.compiled_buckets:
        form = step_moe_form(config.model.moe_form, bucket.rows * bucket.width, args.num_experts_per_tok,
                             args.n_routed_experts, topology.ep, exchange,
                             backend(config.backend).fuses_gather)
        lowering = backend(config.backend).grouped_gemm if form == "grouped" else form
        layout = Layout(topology, lowering, exchange, context_slots=slots, block_size=config.kv_cache.block_size)
        predicted = step_collectives(args, topology, bucket, config.model.dtype, exchange, context_slots=slots,
                                     block_size=config.kv_cache.block_size, draft_tokens=config.draft_tokens)
        calls = tuple(RuntimeCollective(kind, topology.group_size(c.group),
                                        device.span(topology.group_ranks(c.group, 0)), c.bytes_in * share, c.count)
                      for c in predicted
                      for kind, share in runtime_calls(c.op, exchange, c.bytes_in, topology.group_size(c.group)))
        works.append(step_work(args, tensors, draft, layout, bucket, config.model.dtype, config.draft_tokens, calls))
    return works
