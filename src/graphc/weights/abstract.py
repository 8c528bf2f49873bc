"""A rank's tensors as the artifacts store them, from config.json alone, and shapes-only models.

`stored_tensors` says what one expert-parallel shard's weights file holds (names, shapes, dtypes,
FP8 scales) without reading any tensor data: it mirrors `checkpoint.load_model` (the stacked
experts, the family's fp32 parameters and index tables, and, with `as_stored`, the tensors the
family's FP8 releases quantise (`Family.stored.fp8_quantised`) kept FP8 where config.json's
`quantization_config` says the checkpoint is FP8, their scales stacked as `_kept_as_stored`
stacks them; FP4 (`fp4_quantised`) as their bytes, two values each, and their scales'). `graphc
plan --device` counts its bytes; tests hold it to loaded shards.

`abstract_shard` builds that shard's module on the meta device with fake tensors for its
weights (no weight bytes in memory): what a shapes-only compile captures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from graphc.weights import fp4
from graphc.weights.checkpoint import QUANTIZED_WEIGHTS, build_model, hold_as_stored
from graphc.weights.fp8 import FP8, SCALE_SUFFIX, QuantizedWeight, scale_grid
from graphc.weights.hf_config import read_hf_config
from graphc.models.registry import family_of
from graphc.models.step_model import ModelArgs, StepModel
from graphc.weights.tensor_shard import TensorShard


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a rank's weights file."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quantized: QuantizedWeight | None = None
    """Where kept FP8 (FP4) as stored: its scales' buffer, block and compute dtype."""
    scale_shape: tuple[int, ...] | None = None
    scale_dtype: torch.dtype = torch.float32
    """fp32, or an FP4 weight's float8_e8m0fnu bytes (`fp4.EXPONENTS`)."""

    @property
    def nbytes(self) -> int:
        scales = math.prod(self.scale_shape) * self.scale_dtype.itemsize if self.scale_shape else 0
        return math.prod(self.shape) * self.dtype.itemsize + scales


def released_fp8_block(checkpoint: Path) -> tuple[int, int] | None:
    """The FP8 scale block of config.json's `quantization_config`, if the checkpoint is FP8."""
    quantization = read_hf_config(checkpoint).get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    return (block[0], block[1]) if quantization.get("quant_method") == "fp8" and isinstance(block, list) else None


def stored_tensors(args: ModelArgs, checkpoint: Path, dtype: torch.dtype, as_stored: bool, ep: int,
                   tp: int = 1) -> list[StoredTensor]:
    """Every tensor of one weight shard's file (`Topology.weight_shard`: 1 / ep of the routed
    experts, 1 / tp of the split weights), in the model's `state_dict` order (every shard has the
    same shapes)."""
    family = family_of(args)
    with torch.device("meta"):
        shard, whole = build_model(args, args.n_routed_experts // ep, tp=tp), build_model(args)

    def names(model, tp: int = 1) -> list[str]:
        return [n for n in model.state_dict() if not (n == "lm_head.weight" and args.tie_word_embeddings and tp == 1)]

    sources = family.stored.released_sources(args, names(whole))
    if args.tie_word_embeddings and tp > 1:  # a split head is the embedding's rows
        sources["lm_head.weight"] = sources["model.embed_tokens.weight"]
    whole_shapes = {name: tuple(t.shape) for name, t in whole.state_dict().items()}
    block = released_fp8_block(checkpoint) if as_stored else None
    experts_fp4 = fp4.experts_in_fp4(read_hf_config(checkpoint))
    tensors, shapes = [], {name: tuple(t.shape) for name, t in shard.state_dict().items()}
    for name in names(shard, tp):
        shape = shapes[name]
        stored = [n for group in sources.get(name, []) for n in group]
        if name.endswith(family.stored.index_tensors):
            tensors.append(StoredTensor(name, shape, torch.int64))
            continue
        target = torch.float32 if family.stored.keeps_fp32(name, args) else dtype
        kept_fp8 = (block is not None and stored and all(family.stored.fp8_quantised.match(n) for n in stored)
                    and len(shape) in (2, 3))
        dim = family.tensor_parallel_dim(name) if tp > 1 else None
        if kept_fp8 and name.endswith(family.stored.row_sharded_tables):  # the shard's rows, a scale per row and block
            tensors.append(StoredTensor(name, shape, FP8, QuantizedWeight(name + SCALE_SUFFIX, (1, block[1]), target,
                                                                          by_row=True),
                                        scale_grid(shape, (1, block[1]))))
        elif kept_fp8 and experts_fp4 and len(shape) == 3 and all(family.stored.fp4_quantised.match(n) for n in stored):
            tensors.append(StoredTensor(name, (*shape[:-1], shape[-1] // 2), fp4.PAIRS,
                                        QuantizedWeight(name + SCALE_SUFFIX, fp4.BLOCK, target),
                                        (*shape[:-2], *scale_grid(shape[-2:], fp4.BLOCK)), fp4.EXPONENTS))
        elif kept_fp8 and dim is not None:  # as `checkpoint._kept_as_stored` slices it
            whole_grid = torch.empty(scale_grid(whole_shapes[name], block), device="meta")
            grid, split_block = TensorShard(0, tp).scales(whole_grid, block, dim, whole_shapes[name][dim])
            tensors.append(StoredTensor(name, shape, FP8, QuantizedWeight(name + SCALE_SUFFIX, split_block, target),
                                        tuple(grid.shape)))
        elif kept_fp8:
            rows = block[0] if len(shape) == 2 or (shape[1] // len(sources[name][0])) % block[0] == 0 else 1
            grid = scale_grid(shape[-2:], (rows, block[1]))
            tensors.append(StoredTensor(name, shape, FP8, QuantizedWeight(name + SCALE_SUFFIX, (rows, block[1]), target),
                                        (*shape[:-2], *grid)))
        else:
            tensors.append(StoredTensor(name, shape, target))
    return tensors


def abstract_shard(args: ModelArgs, checkpoint: Path, dtype: torch.dtype, as_stored: bool, ep: int,
                   sparse_probabilities: str, tp: int = 1) -> tuple[StepModel, dict[str, Tensor]]:
    """One weight shard's module (`stored_tensors`) on the meta device, laid out as `load_model`
    lays it out (FP8 kept with its scale buffers and `QUANTIZED_WEIGHTS`), and its weights as fake
    CPU tensors in the order step graphs take them (`capture.weight_names`)."""
    from graphc.compiler.capture import weight_names

    tensors = stored_tensors(args, checkpoint, dtype, as_stored, ep, tp)
    with torch.device("meta"):
        model = build_model(args, args.n_routed_experts // ep, sparse_probabilities, tp)
        state = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in tensors}
        if args.tie_word_embeddings and tp == 1:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        for t in tensors:
            if t.quantized is not None:
                hold_as_stored(model, t.name, state[t.name])
        model.load_state_dict(state, strict=True, assign=True)
        for t in tensors:
            if t.quantized is not None:
                owner, _, attribute = t.quantized.scale.rpartition(".")
                model.get_submodule(owner).register_buffer(attribute, torch.empty(t.scale_shape, dtype=t.scale_dtype))
    setattr(model, QUANTIZED_WEIGHTS, {t.name: t.quantized for t in tensors if t.quantized is not None})
    model = model.requires_grad_(False).eval()
    shapes = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with FakeTensorMode(allow_non_fake_inputs=True):
        weights = {name: torch.empty(shapes[name].shape, dtype=shapes[name].dtype, device="cpu")
                   for name in weight_names(model)}
    return model, weights
