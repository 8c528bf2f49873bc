"""Which formulation of the routed experts a step uses: a pure rule shared by the model (its
eager default), the compiler (one form per bucket, recorded in the manifest) and `graphc plan`.

Torch-free, so `graphc plan` stays arithmetic.
"""

from __future__ import annotations

from typing import Literal

MOE_FORMS = ("dense", "gather", "grouped")
"""The routed experts' static-shape formulations (`layers.RoutedExperts` describes each);
all give the same values up to fp32 rounding."""

MOE_FORM_CHOICES = ("auto", *MOE_FORMS)
"""What model.yaml's `model.moe_form` accepts: `auto` applies `moe_form_for` per bucket."""
MoeFormChoice = Literal[MOE_FORM_CHOICES]  # noqa: typed.build reads the choices from this Literal


def moe_form_for(rows: int, experts_per_token: int, local_experts: int, fuses_gather: bool = True) -> str:
    """The cheapest form for `rows` tokens entering a rank's `local_experts` (E') experts.

    The cost that bounds a step on a memory-bound device is the expert weight bytes it reads.
    `gather` reads one expert per route: R*K reads, no sort. `grouped` reads each local expert
    that has routes once, at most min(E', R*K), but sorts the routes and runs one GEMM per
    expert, which costs more than the gather's fused loop while the routes are few (measured
    in bench/bench_scale.py, AOTInductor). `dense` reads all E' and computes every expert on
    every row. So `gather` while R*K <= E' (it reads no more than one pass over the rank's
    experts), else `grouped`. `dense` is never chosen: it is the reference.

    Where the backend runs the gather unfused (`fuses_gather` False: the export backend's ATen
    ops copy every route's matrices, then multiply), `gather` only for one row: at the 140 M
    ladder model's size, fp32, decode-8 took 557 ms gathered and 152 ms grouped, decode-1 36 and
    41 ms (`graphc profile`, bench/bench_step_model.py).
    """
    if rows * experts_per_token > local_experts or (not fuses_gather and rows > 1):
        return "grouped"
    return "gather"


def step_moe_form(choice: str, tokens: int, experts_per_token: int, experts: int, ep: int, exchange: str,
                  fuses_gather: bool = True) -> str:
    """The form of a step of `tokens` tokens on one rank: `choice` itself, or for `auto` the
    rule's pick for the rows that reach the rank's experts (its own tokens when nothing is
    exchanged or they are replicated over the EP group; the group's ep * tokens rows after a
    dispatch, `MOE_EXCHANGES`) on a backend that does or does not fuse the gather."""
    if choice != "auto":
        return choice
    rows = tokens if exchange in ("local", "static") else tokens * ep
    return moe_form_for(rows, experts_per_token, experts // ep, fuses_gather)


BLOCK_SIZES = tuple(2**i for i in range(10))
"""The blocked grouped GEMM's candidate rows a block (1 to 512)."""


def local_rows_bound(rows: int, experts_per_token: int, local_experts: int) -> int:
    """The most routes `rows` rows can send to a rank's `local_experts` experts: a row's K routes
    go to K distinct experts, so at most min(K, E') of them are local."""
    return rows * min(experts_per_token, local_experts)


def expert_blocks(local_rows: int, local_experts: int, block: int) -> int:
    """The static block count of the blocked grouped GEMM: each expert's rows padded to whole
    blocks fit in ceil(L / B) + E' - 1 blocks (the sum of ceil(c_e / B) over the experts)."""
    return -(-local_rows // block) + local_experts - 1


def grouped_block(local_rows: int, rows: int, local_experts: int, matrix_bytes: int, row_flops: int,
                  bandwidth: float, flops: float) -> int:
    """The grouped GEMM's form for one call, by the step model's cost (the larger of its weight
    reads' and its FLOPs' times): a block size B of `BLOCK_SIZES` (each block one GEMM of B rows
    against its expert's matrix, read by index), or 0 for expert-major (every local expert's
    matrix once, over every one of the `rows` rows). Ties go to fewer computed rows.

    Args:
        local_rows: `local_rows_bound` of the call's rows. rows: all of them (off-shard included).
        matrix_bytes, row_flops: one expert's matrix and a row's FLOPs through it.
        bandwidth, flops: the device's bytes/s and FLOP/s.
    """
    def cost(reads: int, computed: int) -> tuple[float, int]:
        return max(reads * matrix_bytes / bandwidth, computed * row_flops / flops), computed

    best = (cost(local_experts, local_experts * rows), 0)
    for block in BLOCK_SIZES:
        blocks = expert_blocks(local_rows, local_experts, block)
        best = min(best, (cost(blocks, blocks * block), block))
    return best[1]


MOE_LOWERINGS = ("ag_rs", "a2a_even", "a2a_v")
"""How tokens that are not replicated over their EP group reach their experts' ranks and come
back; all give the same values (`graphc.ops.all_to_all` describes the all-to-all ones):
- `ag_rs`: all-gather every token of the group, route on every rank, reduce-scatter the sums.
- `a2a_even`: route at the source; an even all-to-all of fixed-position buffers, row t of the
  block for rank d holding token t when it has an expert on d and zeros otherwise; back the same way.
- `a2a_v`: the same buffers packed by destination: the W x W split matrix all-gathered first, so
  every rank knows every size, then variable all-to-alls, unpacked into the same fixed positions
  (so bit-identical to `a2a_even`)."""

MOE_EXCHANGES = ("local", "static", *MOE_LOWERINGS)
"""What a graph's MoE exchanges (recorded per graph in the manifest): nothing (`local`: ep = 1),
an all-reduce over an EP group that already shares the tokens (`static`), or one of the lowerings."""

MOE_LOWERING_CHOICES = ("auto", *MOE_LOWERINGS)
"""What model.yaml's `model.moe_lowering` and `graphc compile --moe-lowering` accept."""
MoeLoweringChoice = Literal[MOE_LOWERING_CHOICES]  # noqa: as `MoeFormChoice`


def moe_lowering_for(group_size: int, lowerings: tuple[str, ...] | None = None) -> str:
    """The all-to-all lowering for an EP group of `group_size` ranks: a variable-count all-to-all
    where the target collective library has one (groups of 4 and 8 on Neuron) and the backend
    lowers it (`lowerings`: the backend's, None for every one), else a padded even one. A
    function of the group size alone, so every rank picks the same (never a rank's splits)."""
    variable = group_size in (4, 8) and (lowerings is None or "a2a_v" in lowerings)
    return "a2a_v" if variable else "a2a_even"


def shared_experts_reduced_with_routed(exchange: str, ep: int, tp: int) -> bool:
    """Whether the static MoE's all-reduce over the EP group also sums the shared experts'
    tensor-parallel partials: when each EP group is whole tp groups (ep a multiple of tp > 1,
    inside one replica as the static form is), one all-reduce of their sum replaces two, a
    collective fewer per MoE layer and step. Where ep > tp the group holds ep / tp copies of each
    tp partial (its cp coordinates compute the same tokens): one copy, the lowest cp coordinate's,
    is added and the others add zeros (`contributes_shared_partial`)."""
    return exchange == "static" and tp > 1 and ep % tp == 0


def contributes_shared_partial(cp_rank, ep: int, tp: int):
    """Whether a rank at context-parallel coordinate `cp_rank` (an int, or a 0-d tensor in a step
    graph) adds its shared experts' partial to the fused all-reduce: one cp coordinate of each EP
    group's ep / tp (its lowest)."""
    return cp_rank % (ep // tp) == 0


def moe_exchange(choice: str, ep: int, tokens_replicated: bool, static_enabled: bool = True,
                 lowerings: tuple[str, ...] | None = None) -> str:
    """The exchange of every graph of a topology: `choice` (a lowering or `auto`, which picks among
    the backend's `lowerings`) applies where tokens must travel (not replicated over the EP group,
    or the static form disabled)."""
    if ep == 1:
        return "local"
    if tokens_replicated and static_enabled:
        return "static"
    if choice != "auto":
        return choice
    return "ag_rs" if tokens_replicated else moe_lowering_for(ep, lowerings)
