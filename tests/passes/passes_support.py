"""Shared by the pass tests: a captured step program and a way to run it."""

from __future__ import annotations

import copy

import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket, example_step_inputs, model_weights
from graphc.models.checkpoint import load_model
from graphc.passes.manager import PassContext
from graphc.topology import Topology

BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE = 4, 8, 8


def captured(checkpoint, bucket: Bucket):
    model = load_model(checkpoint)
    return model, capture_bucket(model, bucket, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE)


def context(bucket: Bucket, cp: int = 1, ep: int = 1, rank: int = 0) -> PassContext:
    return PassContext(Topology(cp, ep), rank, bucket, BLOCKS_PER_ROW)


def run_program(program, model, bucket: Bucket, seed: int = 0):
    """Outputs (tokens, logits) and the written pool for realistic step inputs."""
    return run_step(program.module(), model, bucket, seed)


def run_step(step, model, bucket: Bucket, seed: int = 0):
    """`run_program` for any callable of the step's signature (a program's module, a `StepGraph`)."""
    args = model.args
    pool_shape = (args.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, args.kv_cache_dim)
    inputs = example_step_inputs(bucket, BLOCKS_PER_ROW, pool_shape, model.dtype)
    g = torch.Generator().manual_seed(seed)
    inputs["input_ids"] = torch.randint(0, args.vocab_size, inputs["input_ids"].shape, generator=g)
    inputs["block_table"] = torch.randint(0, NUM_BLOCKS, (bucket.rows, BLOCKS_PER_ROW), generator=g)
    inputs["kv_pool"] = torch.randn(pool_shape, generator=g)
    inputs["positions"] = inputs["positions"] + 3
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[: bucket.rows * bucket.width]
    inputs["slot_mapping"] = slots.view(bucket.rows, bucket.width)
    with torch.no_grad():
        outputs = step(list(model_weights(model).values()), *inputs.values())
    return outputs, inputs["kv_pool"]


def copy_program(program):
    return copy.deepcopy(program)
