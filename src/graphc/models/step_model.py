"""The step's contract: its inputs and the rank's place among the others (`StepInputs`,
`Parallelism`), and what the compiler, the tools and the generic loader may read of any family's
args and model.

Capture, probe, generate and the engine's eager paths call a model only through `StepModel`;
plan, the manifest writer and the loader read args only through `ModelArgs`. A family's own
args and model classes satisfy these structurally (nothing inherits from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Parallelism:
    """How this rank's step relates to the other ranks' (the defaults are one device).

    Numbers and, in a step graph, the rank's coordinates as tensors: the module never touches
    torch.distributed; the graphc ops it calls do.
    """

    cp_rank: int | Tensor = 0
    """This rank's shard of every sequence's KV blocks (block j lives on rank j % cp). In a step
    graph, a 0-d int32 slice of the step's `coordinates` input: one graph serves every rank."""
    cp: int = 1
    """Context-parallel ranks."""
    ep_rank: int | Tensor = 0
    """This rank's position in its expert-parallel group: it holds experts
    [ep_rank * E / ep, (ep_rank + 1) * E / ep). A tensor in a step graph, as `cp_rank`."""
    ep: int = 1
    """Expert-parallel group size."""
    moe_exchange: str = "local"
    """How tokens reach their experts' ranks (`graphc.models.moe_forms.MOE_EXCHANGES`): `static`
    when every rank of the EP group holds the same tokens (compute this rank's experts on its own
    tokens, then all-reduce); `ag_rs` gathers the group's tokens first and reduce-scatters after;
    `a2a_even` / `a2a_v` route at the source and send each token only to its experts' ranks."""

    def kv_shard(self) -> Tensor:
        """`cp_rank` as the ops take it (a 0-d int32 tensor)."""
        return torch.as_tensor(self.cp_rank, dtype=torch.int32)

    def expert_shard(self) -> Tensor:
        """`ep_rank` as the ops take it (a 0-d int32 tensor)."""
        return torch.as_tensor(self.ep_rank, dtype=torch.int32)



class StepInputs:
    """The host metadata of one step (a plain holder so layer signatures stay short).

    Attributes:
        positions: [B, Q] int64 absolute position of each token.
        block_table: [B, M] int32/int64 pool blocks of each row's sequence.
        slot_mapping: [B, Q] int64 flat pool slot per token, `PADDING_SLOT` for padding.
        kv_pool: [L, N, S, C] the paged cache, written in place.
        parallel: this rank's place among the others.
        moe_form: the routed experts' form (one of `MOE_FORMS`), or None for `moe_form_for`'s.
        input_ids: [B, Q] the tokens (DeepSeek-V4's hash-routed layers choose experts by them).
    """

    def __init__(self, positions: Tensor, block_table: Tensor, slot_mapping: Tensor, kv_pool: Tensor,
                 parallel: Parallelism, moe_form: str | None = None, input_ids: Tensor | None = None):
        self.positions = positions
        self.block_table = block_table
        self.slot_mapping = slot_mapping
        self.kv_pool = kv_pool
        self.parallel = parallel
        self.moe_form = moe_form
        self.input_ids = input_ids

    def with_input_ids(self, input_ids: Tensor) -> "StepInputs":
        """The same step over other tokens (what hash routing reads), as a layer run on other
        inputs at the same positions sees it (DeepSeek-V4's MTP module)."""
        return StepInputs(self.positions, self.block_table, self.slot_mapping, self.kv_pool, self.parallel,
                          self.moe_form, input_ids)


class ModelArgs(Protocol):
    """The hyper-parameters shared code reads (names follow the HF `config.json`)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    """Decoder layers of the main model (the multi-token-prediction layers are not among them)."""
    n_routed_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    """Leading layers without routed experts."""
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...]

    @property
    def architecture(self) -> str:
        """The `architectures` name of config.json (what the manifest records)."""

    @property
    def sparse_attention(self) -> bool:
        """Whether attention reads only the keys an indexer picks (V3.2's `sparse_probabilities`)."""

    @property
    def cache_layers(self) -> int:
        """L: layers of the paged pool [L, N, S, C]."""

    @property
    def kv_cache_dim(self) -> int:
        """C: width of one pool slot."""


class StepModel(Protocol):
    """A family's causal LM over the paged pool: one call is one step (`StepInputs`
    documents the inputs)."""

    args: ModelArgs
    model: nn.Module
    """HF's `model.` prefix: `embed_tokens`, `layers` (the decoder layers), `norm`."""
    lm_head: nn.Linear

    @property
    def dtype(self) -> torch.dtype: ...

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, Q] token ids -> the first decoder layer's input."""

    def layer_rope(self, layer: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of `positions` as decoder layer `layer` takes them."""

    def new_kv_pool(self, num_blocks: int, block_size: int) -> Tensor:
        """A zeroed pool [L, N, S, C] in the model dtype."""

    def forward(self, input_ids: Tensor, positions: Tensor, block_table: Tensor, slot_mapping: Tensor,
                kv_pool: Tensor, logits_index: Tensor | None = None, parallel: Parallelism = Parallelism(),
                moe_form: str | None = None) -> Tensor: ...

    # nn.Module's, which every model is
    def named_parameters(self, *args, **kwargs): ...

    def named_buffers(self, *args, **kwargs): ...

    def state_dict(self, *args, **kwargs): ...

    def __call__(self, *args, **kwargs): ...
