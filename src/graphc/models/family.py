"""`Family`: everything graphc needs to know of one model family, in one record of typed parts.

Each family package (`deepseek_v3/`, `deepseek_v4/`, `deepseek_v41/`) builds its record in its
`__init__.py`; `registry.py` lists them. Code outside a family's package asks the record, never
the family's classes: the loader reads its checkpoint hooks, the compiler its support limits,
`plan` its collective predictions, `compare` / `sweep` its reference, `make-tiny` its presets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from graphc.errors import GraphcError

if TYPE_CHECKING:
    from torch import nn

    from graphc.models.drafter import Drafter
    from graphc.models.step_model import ModelArgs, StepModel
    from graphc.topology import Topology

Sources = dict[str, list[list[str]]]
"""Per graphc parameter, the stored tensors that make it: one list per routed expert (its
projections, concatenated along rows) for a stacked parameter stored per expert, else one list of
one tensor (for a stacked parameter stored stacked, as transformers' V4 layout may: this rank's
experts are rows of it)."""


@dataclass(frozen=True)
class Collective:
    """One kind of collective a rank issues in a step: `count` calls, each taking `bytes_in`."""

    op: str
    group: str
    count: int
    bytes_in: int


def _no_collectives(*_: Any) -> list[Collective]:
    return []


def _accepts(*_: Any) -> None:
    return None


class BuildModel(Protocol):
    def __call__(self, args: "ModelArgs", local_experts: int | None, sparse_probabilities: str,
                 tp: int = 1) -> "StepModel": ...


class ReleasedSources(Protocol):
    def __call__(self, args: "ModelArgs", parameters: list[str]) -> Sources: ...


class StoredSources(Protocol):
    def __call__(self, args: "ModelArgs", parameters: list[str],
                 stored: set[str]) -> tuple[Sources, list[str], list[str]]: ...


class AttentionCollectives(Protocol):
    def __call__(self, args: "ModelArgs", tokens: int, context_slots: int | None, dtype_bytes: int,
                 tp: int) -> list[Collective]: ...


class TensorParallelCollectives(Protocol):
    def __call__(self, args: "ModelArgs", tokens: int, rows: int, context_slots: int | None, shard_slots: int,
                 dtype_bytes: int, tp: int, shared_with_routed: bool) -> list[Collective]: ...


class ExpertGroupCollectives(Protocol):
    def __call__(self, args: "ModelArgs", tokens: int, dtype_bytes: int, exchange: str,
                 ep: int) -> list[Collective]: ...


@dataclass(frozen=True)
class StoredLayout:
    """What graphc's parameters are stored as in the family's checkpoints, and what a loader keeps
    or skips (`graphc.weights.checkpoint`)."""

    released_sources: ReleasedSources
    """(args, graphc parameter names) -> the tensors the released layout stores for each (what
    graphc's tiny checkpoints are written in)."""
    skips: Callable[[str, "ModelArgs"], bool]
    """Stored tensors a text-only loader of the main layers skips (multi-token prediction, vision)."""
    keeps_fp32: Callable[[str, "ModelArgs"], bool]
    """Parameters that stay fp32 whatever the model dtype."""
    stored_sources: StoredSources | None = None
    """(args, graphc parameter names, stored names) -> (sources, missing, unexpected) for families
    read from more than one layout; None: the released layout only."""
    stored_stacked: Callable[[str], bool] = lambda name: False
    """Whether a stored tensor holds every routed expert of a layer (rows of it per expert)."""
    index_tensors: tuple[str, ...] = ()
    """Name suffixes of integer tables of routed-expert ids (V4's `tid2eid`), loaded as int64 and
    checked to name experts 0..E-1."""
    row_sharded_tables: tuple[str, ...] = ()
    """Name suffixes of tables whose rows shard over the expert-parallel group and whose FP8
    scales are per row (V4.1's Engram tables)."""
    ue8m0_scales: bool = False
    """FP8 scales named and stored as DeepSeek-V4.1's (`fp8.UE8M0_SUFFIX`)."""
    fp8_quantised: re.Pattern = re.compile(r"(?!)")
    """The stored weights its FP8 releases quantise (what `make-tiny --fp8-block` quantises)."""
    fp4_quantised: re.Pattern = re.compile(r"(?!)")
    """Of those, the ones stored as FP4 instead (`weights/fp4.py`: the routed experts) where config.json
    says `expert_dtype: fp4` (`fp4_experts`: DeepSeek-V4-Flash and V4.1-Flash; V4-Flash-Base keeps them FP8)."""


@dataclass(frozen=True)
class TensorParallelism:
    """How tensor parallelism splits the family's weights; none where it is served with tp = 1 only."""

    dims: tuple[tuple[re.Pattern, int], ...] = ()
    """(graphc parameter name pattern, the dim tensor parallelism splits it along) for each split
    weight (`tensor_shard`); every rank of a tp group holds the others whole."""
    widths: Callable[["ModelArgs"], dict[str, int]] = lambda args: {}
    """What tensor parallelism splits, by config.json field (tp must divide each)."""


@dataclass(frozen=True)
class Support:
    """What the family is served with, and the refusal of what it is not."""

    backends: tuple[str, ...] = ("export", "inductor", "neuron")
    data_parallel: bool = True
    """Whether data-parallel attention (dp > 1) is built for it."""
    check_exchange: Callable[["ModelArgs", str], None] = _accepts
    """Raises `GraphcError` for an MoE exchange its layers cannot take."""
    check_loadable: Callable[["ModelArgs"], None] = _accepts
    """Raises CheckpointError where graphc takes the config (plan, shapes-only compiles) but cannot
    load its weights yet."""
    probe_refusal: str | None = None
    """Why `graphc probe` does not take its layers, or None."""


@dataclass(frozen=True)
class Reference:
    """The external reference: transformers' model of the architecture, or graphc's own."""

    model: Callable[["ModelArgs"], "nn.Module"] | None = None
    """graphc's eager reference (released parameter names; token ids [1, T] -> logits [1, T, V];
    its token embedding `embed`, which `compare` perturbs), for a family transformers lacks; None:
    transformers implements it."""
    name: str = "transformers"


@dataclass(frozen=True)
class Predictions:
    """`graphc plan`'s predictions of a step's collectives beside the MoE's."""

    attention_collectives: AttentionCollectives = _no_collectives
    """The attention's collectives over cp, given the block table's token capacity."""
    tensor_parallel_collectives: TensorParallelCollectives = _no_collectives
    """The collectives over tp, given a KV shard's key slots and whether the MoE's all-reduce over
    ep sums the shared experts too (`moe_forms.shared_experts_reduced_with_routed`)."""
    expert_group_collectives: ExpertGroupCollectives = _no_collectives
    """Collectives over ep beside the MoE's (Engram)."""


@dataclass(frozen=True)
class TinyCheckpoints:
    """What `make-tiny` writes for the family."""

    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """make-tiny presets: complete config.json dicts."""
    draft_and_extra_shapes: Callable[["ModelArgs", dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]] = \
        lambda args, shapes: {}
    """Tensors a released checkpoint stores beside the main layers' (MTP, vision), that loaders skip:
    `make-tiny` writes them too."""
    serving_every_draft_layer: Callable[["ModelArgs"], "ModelArgs"] = lambda args: args
    """The args of a model that serves every draft layer its checkpoint stores, where the family's
    model can (V4.1: all DSpark stages): `make-tiny` writes their tensors through the model's own
    layout; others' draft layers are `draft_and_extra_shapes`'."""
    quantization_config: dict[str, Any] = field(default_factory=dict)
    """Extra `quantization_config` fields of its FP8 releases."""


@dataclass(frozen=True)
class Family:
    """One model family: how to recognise, read, build, load, check and describe it."""

    name: str
    """What messages call it ("DeepSeek-V4")."""
    architectures: tuple[str, ...]
    """config.json `architectures` names it takes (listed when a checkpoint names none)."""
    recognises: Callable[[dict[str, Any]], bool]
    """Whether a config.json is this family's (by architecture or model_type)."""
    args_from_hf_config: Callable[[dict[str, Any]], "ModelArgs"]
    """config.json -> the family's args, refusing what it cannot run (`CheckpointError`)."""
    build_model: BuildModel
    """The step model of a rank holding `local_experts` routed experts (None: all), V3.2's P
    precision, weights uninitialised (build it under a meta device); `tp` is passed to families
    that split over it only (`build`)."""
    stored: StoredLayout
    tensor_parallel: TensorParallelism = TensorParallelism()
    support: Support = Support()
    drafter: "Drafter | None" = None
    """How its draft layers draft in speculative decoding (`models/drafter.py`); None: it has none."""
    reference: Reference = Reference()
    predictions: Predictions = Predictions()
    tiny: TinyCheckpoints = TinyCheckpoints()

    def build(self, args: "ModelArgs", local_experts: int | None, sparse_probabilities: str, tp: int = 1) -> "StepModel":
        """The step model of one rank of `tp` tensor-parallel ranks (`build_model`)."""
        if tp == 1:
            return self.build_model(args, local_experts, sparse_probabilities)
        self.check_tensor_parallel(args, tp)
        return self.build_model(args, local_experts, sparse_probabilities, tp)

    def tensor_parallel_dim(self, name: str) -> int | None:
        """The dim parameter `name` is split along (`tensor_parallel_dims`), or None: held whole."""
        return next((dim for pattern, dim in self.tensor_parallel.dims if pattern.search(name)), None)

    def check_tensor_parallel(self, args: "ModelArgs", tp: int) -> None:
        """Refuse a tp the family does not split over, or one that does not divide what it splits."""
        if tp == 1:
            return
        if not self.tensor_parallel.dims:
            raise GraphcError(f"topology.tp: {tp}; {args.architecture} is served with tp = 1 so far")
        for name, width in self.tensor_parallel.widths(args).items():
            if width % tp:
                raise GraphcError(f"topology.tp: {tp} must divide the checkpoint's {name} ({width}); "
                                  f"{width} % {tp} = {width % tp}")

    def check_compile(self, args: "ModelArgs", topology: "Topology", exchange: str, backend: str) -> None:
        """Refuse what is not built for this family, naming the field."""
        self.check_tensor_parallel(args, topology.tp)
        if topology.dp > 1 and not self.support.data_parallel:
            raise GraphcError(f"topology.dp: {topology.dp}; {args.architecture} is served with dp = 1 so far "
                              "(context and expert parallelism only)")
        self.support.check_exchange(args, exchange)
        if backend not in self.support.backends:
            raise GraphcError(f"model.checkpoint: {args.architecture} has no {backend} lowering yet; use the "
                              f"{' or '.join(self.support.backends)} backend")
