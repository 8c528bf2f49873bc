"""What the compiler, the tools and the generic loader may read of any family's args and model.

Capture, probe, generate and the engine's eager paths call a model only through `StepModel`;
plan, the manifest writer and the loader read args only through `ModelArgs`. A family's own
args and model classes satisfy these structurally (nothing inherits from them).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from graphc.models.layers import Parallelism


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
    """A family's causal LM over the paged pool: one call is one step (`layers.StepInputs`
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
