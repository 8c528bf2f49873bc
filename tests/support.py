"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import yaml

from graphc.artifacts.directory import sha256_file
from graphc.artifacts.manifest import MANIFEST
from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket, example_step_inputs, model_weights
from graphc.weights.checkpoint import load_model
from graphc.models.step_model import Parallelism

DELETE = object()
"""A value for `override` that removes the key."""


def override(data: dict, **changes) -> dict:
    """A deep copy of `data` with dotted keys set (`override(d, **{"buckets.prefill": [8]})`);
    a value of DELETE removes the key."""
    data = copy.deepcopy(data)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


def rehash(artifacts: Path, relative: str) -> None:
    """Record the tampered file's new hash in the manifest, as an attacker who controls it would."""
    data = yaml.safe_load((artifacts / MANIFEST).read_text())
    digest = sha256_file(artifacts / relative)
    for rank in data["ranks"]:
        for graph in rank["graphs"]:
            if graph["file"] == relative:
                graph["sha256"] = digest
    if data.get("tokenizer") == relative:
        data["tokenizer_sha256"] = digest
    (artifacts / MANIFEST).write_text(yaml.safe_dump(data, sort_keys=False))


def one_line_refusal(result) -> str:
    """The `error: ...` line of a CLI run (click's CliRunner) refused as bad input: exit status 2,
    and nothing else on stderr but the progress lines."""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("loading ")]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


FP8_PRESETS = ("lora-groups", "v32", "v4", "v41")
"""A preset of each family (and V3.2's indexer) in its FP8 release layout (`fp8_checkpoints`)."""
V4_FP4_EXPERTS = "v4-fp4-experts"
"""`fp8_checkpoints`' V4 laid out as DeepSeek-V4-Flash ships: routed experts FP4 (`expert_dtype: fp4`,
int8 bytes), the FP8 weights' scales power-of-two `X.scale` (`scale_fmt: ue8m0`)."""
FP8_BLOCK = 32
"""Scale blocks that tile the tiny matrices raggedly (48 rows of 64 columns: one and a half blocks)."""

SPARSE_V32 = "v32-sparse"
"""The `tiny_checkpoints` entry of the v32 preset with index_topk = SPARSE_TOPK."""
SPARSE_TOPK = 16


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model for the checkpoint's architecture (DeepseekV3ForCausalLM or V32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


SKEWED = "lora-groups-skewed"
"""lora-groups with a correction bias that routes every token to experts 0-3 alone: with ep = 2,
every route lands on rank 0 (the all-to-all's worst case)."""


def skew_routes_to_first_experts(path: Path, experts: int) -> None:
    """Raise the first `experts` experts' correction bias far above the others in every MoE layer
    (selection uses score + bias; the weights stay the unbiased scores)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name, bias in tensors.items():
        if name.endswith("mlp.gate.e_score_correction_bias"):
            bias[:experts] += 100.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def randomise_v4_zero_inits(model, seed: int = 2) -> None:
    """Make the parameters transformers' DeepSeek-V4 initialises to zero non-zero and distinct
    (sinks, position biases, HC bases) and give every token of the hash layers K distinct experts:
    a reference comparison with them at zero would not test them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                tensor.copy_(torch.stack([torch.randperm(experts, generator=generator)[:tensor.shape[1]]
                                          for _ in range(tensor.shape[0])]))


def rewrite_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' `generate`, greedy, with EOS disabled so exactly `new_tokens` come back."""
    from transformers import GenerationConfig

    # A checkpoint's generation_config.json would re-supply its EOS; override the model's copy.
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False)
    return out[0, len(prompt):].tolist()


TEST_BUCKETS = {
    # Two prefill buckets and two decode buckets: prompts can hit a bucket exactly, fall between
    # buckets, and exceed the largest (chunked); decodes can fill a bucket or pad one.
    "standard": {"prefill": [8, 32], "decode": [1, 4], "prompt_as_decode": 0, "context_limit": 128},
    # A different bucket set over the same model: tokens must not depend on it.
    "alternative": {"prefill": [16], "decode": [3], "prompt_as_decode": 0, "context_limit": 128},
    # "standard" plus prompt-as-decode graphs ([1, 4] and [4, 4]): the same tokens must come out.
    "prompt_as_decode": {"prefill": [8, 32], "decode": [1, 4], "prompt_as_decode": 4, "context_limit": 128},
    # Prompt-as-decode with the fewest graphs (prefill-32, decode-4, decode-4x4): for multi-rank runs.
    "prompt_as_decode_small": {"prefill": [32], "decode": [4], "prompt_as_decode": 4, "context_limit": 128},
    # Every bucket kind in three graphs, decode rows enough for uneven replicas: data-parallel runs.
    "dp": {"prefill": [8], "decode": [8], "prompt_as_decode": 4, "context_limit": 64},
    # The fewest graphs (one prefill, one decode): for the inductor multi-rank runs, whose compiles
    # dominate the suite's time.
    "small": {"prefill": [8], "decode": [2], "prompt_as_decode": 0, "context_limit": 64},
    # Chats with tools: a prompt that holds the tools' schemas and a reply that is a call in
    # byte-level markup (about 25 tokens a marker) need a longer context than the rest.
    "chat": {"prefill": [64], "decode": [2], "prompt_as_decode": 0, "context_limit": 1024},
    # Prompt scores (with `prompt_logprobs`: a score twin of prefill-16): prompts longer than a chunk,
    # and prompt-as-decode rows a scored prompt must never take.
    "scores": {"prefill": [16], "decode": [4], "prompt_as_decode": 4, "context_limit": 128},
}
TEST_KV_BLOCKS = {"chat": 256}
"""The KV pool's blocks where a bucket set needs more than the default 64."""


def model_yaml(checkpoint: Path, buckets: dict, backend: str = "export", dtype: str = "float32",
               num_blocks: int = 64, block_size: int = 8) -> dict:
    return {
        "model": {"checkpoint": str(checkpoint), "dtype": dtype},
        "buckets": buckets,
        "kv_cache": {"block_size": block_size, "num_blocks": num_blocks},
        "runtime": {"max_num_prefilling_tokens": 32, "max_new_tokens": 16},
        "backend": backend,
    }


# A captured step program and a way to run it (pass and capture tests).

BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE = 4, 8, 8


GENERIC_MOE = Parallelism(moe_exchange="ag_rs")
"""One device capturing the all-gather / reduce-scatter MoE: its collectives in the graph, over
groups of one rank (what the collective passes are tested on)."""


def captured(checkpoint, bucket: Bucket, parallel: Parallelism = Parallelism()):
    model = load_model(checkpoint)
    return model, capture_bucket(model, bucket, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE, parallel)


def run_program(program, model, bucket: Bucket, seed: int = 0, coordinates: tuple[int, ...] = (0, 0, 1)):
    """Outputs (tokens, logits) and the written pool for realistic step inputs (on the rank of
    `coordinates`: cp rank, ep rank, samples)."""
    return run_step(program.module(), model, bucket, seed, coordinates)


def run_step(step, model, bucket: Bucket, seed: int = 0, coordinates: tuple[int, ...] = (0, 0, 1)):
    """`run_program` for any callable of the step's signature (a program's module, a `StepGraph`)."""
    args = model.args
    pool_shape = (args.cache_layers, NUM_BLOCKS, BLOCK_SIZE, args.kv_cache_dim)
    inputs = example_step_inputs(bucket, BLOCKS_PER_ROW, pool_shape, model.dtype)
    g = torch.Generator().manual_seed(seed)
    inputs["input_ids"] = torch.randint(0, args.vocab_size, inputs["input_ids"].shape, generator=g)
    inputs["block_table"] = torch.randint(0, NUM_BLOCKS, (bucket.rows, BLOCKS_PER_ROW), generator=g)
    inputs["kv_pool"] = torch.randn(pool_shape, generator=g).to(model.dtype)
    inputs["positions"] = inputs["positions"] + 3
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[: bucket.rows * bucket.width]
    inputs["slot_mapping"] = slots.view(bucket.rows, bucket.width)
    inputs["coordinates"] = torch.tensor(coordinates, dtype=torch.int32)
    with torch.no_grad():
        outputs = step(list(model_weights(model).values()), *inputs.values())
    return outputs, inputs["kv_pool"]


def copy_program(program):
    return copy.deepcopy(program)


def serve_arrivals(scheduler, arrivals: list, run_step, max_steps: int = 2000) -> list:
    """Submit each (step, request) of `arrivals` once that many steps have run, and run steps
    (`run_step(step) -> one token per row`) until every request has ended; their results, in
    arrival order. Requests arriving over time are what lets one reuse another's cached prefix."""
    pending, indices, steps = sorted(arrivals, key=lambda arrival: arrival[0]), [], 0
    while pending or not scheduler.done:
        while pending and pending[0][0] <= steps:
            indices.append(scheduler.submit(pending.pop(0)[1]))
        if not scheduler.done:
            step = scheduler.next_step()
            scheduler.complete(step, run_step(step))
        steps += 1
        assert steps < max_steps, "the scheduler did not finish"
    return [scheduler.results[i] for i in indices]
