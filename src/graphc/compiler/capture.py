"""Capture: one `torch.export` per bucket shape, weights as graph inputs, no dynamic compute dims.

The captured program serves every rank: the model plus the sampler, with the graphc:: ops as
single nodes for the passes to rewrite, and the rank's coordinates (KV shard, expert slice) a
step input. What changes shapes is fixed at capture: the
context- and expert-parallel group sizes, each rank's number of experts, and the MoE form
(static or generic). torch.export bakes sizes into view and reshape arguments, so a pass cannot
soundly turn an all-gathered [T * ep] token batch into a [T] one after the fact. Weights enter as a list input (in
`weight_names` order) rather than as lifted parameters, so graphs of every bucket share one
weight file per rank and identical graphs hash identically whatever the weights.

Weights kept as stored (FP8 with block scales, `load_model(as_stored=True)`) enter as stored and
are dequantised in the graph, one `graphc::dequantize` node each: the parameter the model reads is
that node's output (`place_dequantization` then moves it next to its first reader).

The only symbolic dim is the KV pool's block count: it sizes the cache, not any computation,
and the runtime may change it (`GRAPHC_NUM_KV_BLOCKS`) without recompiling.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.export import Dim, ExportedProgram

from graphc.buckets.selection import Bucket
from graphc.weights.checkpoint import QUANTIZED_WEIGHTS
from graphc.weights.fp8 import QuantizedWeight
from graphc.models.registry import family_of
from graphc.models.scoring import ScoringStep
from graphc.models.speculation import SpeculativeStep
from graphc.models.step_model import Parallelism, StepInputs, StepModel
from graphc.ops import sampler
from graphc.ops.dequantize import dequantize
from graphc.step import FLOAT_INPUTS, POOL_BLOCKS_DIM, STEP_INPUTS, kv_pool_shape, step_shapes


def weight_names(model: StepModel) -> list[str]:
    """The checkpoint-derived tensors the forward reads: parameters (tied ones once), then
    persistent buffers. Non-persistent buffers (RoPE frequencies) are derived from the config and
    become graph constants."""
    persistent = set(model.state_dict())
    return [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in persistent]


def model_weights(model: StepModel) -> dict[str, Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: tensors[name] for name in weight_names(model)}


class StepGraph(torch.nn.Module):
    """One serving step: the model over the paged cache, then the sampler; with `draft_tokens`
    k > 0, a speculative step (`graphc.models.speculation`) of a model that serves its MTP layer;
    with `scores`, a score step (`graphc.models.scoring`).

    Returns:
        tokens: [B] the sampled next token of each row; speculative: [B, 2 + 2k], the accepted
            drafts' count n, tokens t_0 .. t_k (t_0 .. t_n are new), the row's next k drafts.
        logits: [B, V] the logits it was sampled from (speculative: of t_0).
        a score step's `SCORE_OUTPUTS` after them.
    """

    def __init__(self, model: StepModel, parallel: Parallelism = Parallelism(), moe_form: str | None = None,
                 draft_tokens: int = 0, scores: bool = False):
        super().__init__()
        self.draft_tokens, self.scores = draft_tokens, scores
        # Held in a list so nn.Module does not register it: its tensors must reach the graph as
        # inputs, not as lifted parameters.
        self._model = [model]
        self.weight_names = weight_names(model)
        self.parallel = parallel
        self.moe_form = moe_form
        self.quantized: dict[str, QuantizedWeight] = getattr(model, QUANTIZED_WEIGHTS, {})

    def forward(self, weights: list[Tensor], input_ids, positions, block_table, slot_mapping, kv_pool,
                logits_index, temperature, top_k, top_p, seed, coordinates) -> tuple[Tensor, ...]:
        # The rank's coordinates are an input, not constants: the graph is the same on every rank.
        cp_rank, ep_rank, samples = coordinates.unbind()
        parallel = dataclasses.replace(self.parallel, cp_rank=cp_rank, ep_rank=ep_rank)
        parameters = dict(zip(self.weight_names, weights))
        for name, quantized in self.quantized.items():
            if quantized.by_row:  # the module dequantises the rows it reads
                continue
            parameters[name] = dequantize(parameters[name], parameters[quantized.scale], *quantized.block,
                                          quantized.dtype)
        if self.draft_tokens:
            step = StepInputs(positions, block_table, slot_mapping, kv_pool, parallel, self.moe_form)
            return torch.func.functional_call(
                SpeculativeStep(self._model[0], self.draft_tokens, family_of(self._model[0].args).drafter),
                {f"model.{n}": t for n, t in parameters.items()},
                (input_ids, step, logits_index, temperature, top_k, top_p, seed))
        if self.scores:
            step = StepInputs(positions, block_table, slot_mapping, kv_pool, parallel, self.moe_form)
            logits, *scores = torch.func.functional_call(
                ScoringStep(self._model[0]), {f"model.{n}": t for n, t in parameters.items()},
                (input_ids, step, logits_index))
            return sampler.sample(logits, temperature, top_k, top_p, seed, samples), logits, *scores
        logits = torch.func.functional_call(
            self._model[0], parameters,
            (input_ids, positions, block_table, slot_mapping, kv_pool, logits_index), {"parallel": parallel, "moe_form": self.moe_form},
        )  # [B, V]
        return sampler.sample(logits, temperature, top_k, top_p, seed, samples), logits


def step_input_dtype(name: str) -> torch.dtype:
    """The dtype of step input `name` (other than the pool, which is in the model dtype)."""
    return torch.float32 if name in FLOAT_INPUTS else torch.int32 if name == "coordinates" else torch.int64


def example_step_inputs(bucket: Bucket, blocks_per_row: int, kv_pool_shape: tuple[int, ...],
                        dtype: torch.dtype) -> dict[str, Tensor]:
    """Distinct example tensors of the bucket's shapes (one tensor per input: shared example
    tensors would be captured as one aliased input)."""
    shapes = step_shapes(bucket.rows, bucket.width, blocks_per_row)
    inputs = {name: torch.zeros(shapes[name], dtype=step_input_dtype(name)) for name in shapes}
    # Values a step could hold (distinct slots, in-range positions and logits rows), not all zeros.
    inputs["positions"] = torch.arange(bucket.width).repeat(bucket.rows, 1)
    inputs["slot_mapping"] = torch.arange(bucket.rows * bucket.width).view(shapes["slot_mapping"])
    inputs["logits_index"].fill_(bucket.width - 1)
    inputs["top_p"].fill_(1.0)
    inputs["kv_pool"] = torch.zeros(kv_pool_shape, dtype=dtype)
    return {name: inputs[name] for name in STEP_INPUTS}


def capture_bucket(model: StepModel, bucket: Bucket, blocks_per_row: int, num_blocks: int,
                   block_size: int, parallel: Parallelism = Parallelism(), moe_form: str | None = None,
                   weights: dict[str, Tensor] | None = None, draft_tokens: int = 0) -> ExportedProgram:
    """Export the step for one bucket shape.

    `parallel` fixes what changes shapes (group sizes, static or generic MoE; `model` holds one
    rank's share of the experts, of the shapes every rank's share has); the rank's coordinates
    come from the `coordinates` input. `moe_form` fixes the routed
    experts' formulation (`MOE_FORMS`; by default the model's rule for the bucket's size).
    `weights` replaces the model's own (`model_weights`): fake tensors of a shapes-only compile
    (`models/abstract.abstract_shard`). `draft_tokens`: speculative decoding's k (0: off). A
    "score" bucket's step also returns its prompt scores (`graphc.models.scoring`).
    """
    step = StepGraph(model, parallel, moe_form, draft_tokens, scores=bucket.kind == "score")
    args = model.args
    pool_shape = kv_pool_shape(args.cache_layers, num_blocks, block_size, args.kv_cache_dim)
    inputs = example_step_inputs(bucket, blocks_per_row, pool_shape, model.dtype)
    weights = list((weights if weights is not None else model_weights(model)).values())
    dynamic = {name: None for name in STEP_INPUTS}
    dynamic["kv_pool"] = {POOL_BLOCKS_DIM: Dim("num_blocks", min=2)}
    with torch.no_grad():
        program = torch.export.export(
            step, (weights, *inputs.values()),
            dynamic_shapes={"weights": [None] * len(weights), **dynamic},
        )
    # The program keeps its example inputs, the weights among them: every per-rank copy would
    # duplicate them and `torch.export.save` would write them into every graph file.
    program.example_inputs = None
    return program
