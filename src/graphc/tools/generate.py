"""Eager generation on the paged cache: the in-repo reference every compiled path is checked against.

Each prompt is prefilled alone in chunks of at most `prefill_chunk` tokens (B = 1), then all live
sequences decode together, one token per row per step. No buckets and no padding beyond what the
step layout needs: this is the plainest correct use of the model's step contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphc.models.step_model import StepModel
from graphc.ops import sampler
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from graphc.sampling import Sampling, sampler_inputs
from graphc.step import ceil_div


@dataclass(frozen=True)
class PagedKV:
    """Shape of the pool the reference runs on."""

    block_size: int = 16
    num_blocks: int = 64


def _sample_rows(logits: torch.Tensor, sampling: Sampling, steps: list[int]) -> list[int]:
    inputs = sampler_inputs([sampling] * len(steps), steps, logits.shape[0])
    return sampler.sample(logits, inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["seed"]).tolist()


@torch.no_grad()
def generate(
    model: StepModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    kv: PagedKV = PagedKV(),
    prefill_chunk: int | None = None,
    sampling: Sampling = Sampling(),
    stop_at_eos: bool = True,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` for each prompt; returns only the new tokens.

    Args:
        model: the eager model.
        prompts: token ids, each non-empty.
        max_new_tokens: tokens to generate per prompt (fewer if EOS stops it).
        kv: the pool to run on; all prompts must fit at once.
        prefill_chunk: longest prefill step; None prefills each prompt in one step.
        sampling: greedy by default.
        stop_at_eos: stop a sequence once it emits one of the model's EOS ids.
    """
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    pool = model.new_kv_pool(kv.num_blocks, kv.block_size)
    allocator = BlockAllocator(kv.num_blocks)
    longest = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_row = ceil_div(longest, kv.block_size)
    sequences = [SequenceBlocks(kv.block_size) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]

    def run(rows, width):
        input_ids, positions, block_table, slots, last = step_metadata(rows, width, blocks_per_row)
        return model(input_ids, positions, block_table, slots, pool, last)

    live = []
    for i, prompt in enumerate(prompts):
        sequences[i].reserve(len(prompt), allocator)
        chunk = prefill_chunk or len(prompt)
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            logits = run([(sequences[i], piece, start)], len(piece))
        outputs[i].append(_sample_rows(logits, sampling, [0])[0])
        live.append(i)

    def finished(i: int) -> bool:
        return len(outputs[i]) >= max_new_tokens or (stop_at_eos and outputs[i][-1] in model.args.eos_token_id)

    live = [i for i in live if not finished(i)]
    while live:
        rows = []
        for i in live:
            position = len(prompts[i]) + len(outputs[i]) - 1
            sequences[i].reserve(position + 1, allocator)
            rows.append((sequences[i], [outputs[i][-1]], position))
        logits = run(rows, 1)
        for i, token in zip(live, _sample_rows(logits, sampling, [len(outputs[i]) for i in live])):
            outputs[i].append(token)
        live = [i for i in live if not finished(i)]
    return outputs
