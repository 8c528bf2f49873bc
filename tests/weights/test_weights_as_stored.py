"""FP8 weights kept as stored (`model.weights: as-stored`): a loaded model holds every FP8 tensor
of the checkpoint as stored, with its fp32 scales (V4.1's FP4 routed experts and their scales as
bytes), and a step dequantising them in the graph gives the logits of the model dequantised on
load, bit for bit, for a preset of every family."""

from __future__ import annotations

import math

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import StepGraph, model_weights
from graphc.weights.checkpoint import QUANTIZED_WEIGHTS, check_checkpoint, fp8_tensors, load_model
from graphc.weights import fp4
from graphc.weights.fp8 import FP8
from support import FP8_PRESETS, V4_FP4_EXPERTS, run_step


FP4_EXPERTS = ("v41", V4_FP4_EXPERTS)
"""The checkpoints whose routed experts are FP4 (config.json's `expert_dtype: fp4`)."""


@pytest.mark.parametrize("preset", [*FP8_PRESETS, V4_FP4_EXPERTS])
def test_every_fp8_tensor_is_kept_as_stored_with_its_scales(fp8_checkpoints, preset):
    checkpoint = fp8_checkpoints[preset]
    model = load_model(checkpoint, torch.bfloat16, as_stored=True)
    plain = load_model(checkpoint, torch.bfloat16)
    quantized = getattr(model, QUANTIZED_WEIGHTS)
    parameters, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    assert quantized and not getattr(plain, QUANTIZED_WEIGHTS)
    checked = check_checkpoint(checkpoint)
    for name, weight in quantized.items():
        packed = parameters[name].dtype == fp4.PAIRS
        assert parameters[name].dtype == FP8 or (packed and ".experts." in name and preset in FP4_EXPERTS)
        assert buffers[weight.scale].dtype == (fp4.EXPONENTS if packed else torch.float32)
        assert weight.block == fp4.BLOCK or not packed
        assert weight.dtype == dict(plain.named_parameters())[name].dtype
    # Nothing FP8 (FP4) of the main layers was dequantised on the way, V4.1's Engram tables included
    # (the rows a step reads are dequantised where they are read, `by_row`).
    stored = [n for n in fp8_tensors(checkpoint) if n in checked.expected]
    assert all(q.by_row == n.endswith(checked.family.stored.row_sharded_tables) for n, q in quantized.items())
    values = sum(p.numel() * (2 if p.dtype == fp4.PAIRS else 1) for p in map(parameters.get, quantized))
    assert values == sum(math.prod(checked.expected[n]) for n in stored + list(checked.fp4_bytes))  # values, not bytes
    assert bool(checked.fp4_bytes) == (preset in FP4_EXPERTS)
    for name, parameter in plain.named_parameters():
        if name not in quantized:
            assert torch.equal(parameters[name], parameter)
    kept_bytes = sum(t.numel() * t.element_size() for t in model_weights(model).values())
    plain_bytes = sum(t.numel() * t.element_size() for t in model_weights(plain).values())
    assert kept_bytes < plain_bytes


@pytest.mark.parametrize("preset", [*FP8_PRESETS, V4_FP4_EXPERTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_dequantising_in_the_graph_equals_dequantising_on_load(fp8_checkpoints, preset, dtype):
    checkpoint = fp8_checkpoints[preset]
    as_stored, plain = load_model(checkpoint, dtype, as_stored=True), load_model(checkpoint, dtype)
    for bucket in (Bucket("prefill", 8), Bucket("decode", 2)):
        (tokens, logits), pool = run_step(StepGraph(as_stored), as_stored, bucket, seed=3)
        (tokens_plain, logits_plain), pool_plain = run_step(StepGraph(plain), plain, bucket, seed=3)
        assert torch.equal(logits, logits_plain), (preset, bucket)
        assert torch.equal(tokens, tokens_plain) and torch.equal(pool, pool_plain)


@pytest.mark.compiles
@pytest.mark.parametrize("preset, backend", [
    ("lora-groups", "export"), ("lora-groups", "neuron"), (V4_FP4_EXPERTS, "export"),
    pytest.param("lora-groups", "inductor", marks=[pytest.mark.slow, pytest.mark.inductor]),
    pytest.param("v41", "neuron", marks=pytest.mark.slow),  # FP4 experts too
    pytest.param("v41", "inductor", marks=[pytest.mark.slow, pytest.mark.inductor]),
])
def test_artifacts_store_the_fp8_weights_and_serve_the_eager_tokens(fp8_checkpoints, tmp_path, preset, backend):
    """On every backend: the weights file holds the checkpoint's FP8 (FP4) tensors as stored (not
    dequantised), and the served tokens are the eager model's, dequantised on load (fp32)."""
    import yaml
    from safetensors.torch import load_file

    from graphc.artifacts.directory import read_manifest
    from graphc.compiler.pipeline import CompileOptions, compile
    from graphc.config import load_config
    from graphc.runtime import Engine, Request
    from graphc.tools.generate import PagedKV, generate
    from support import model_yaml

    checkpoint = fp8_checkpoints[preset]
    buckets = {"prefill": [8], "decode": [1], "prompt_as_decode": 0, "context_limit": 64}  # decode 1: matvecs
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(checkpoint, buckets, backend)))
    compile(load_config(tmp_path / "model.yaml"), tmp_path / "artifacts", CompileOptions(show_progress=False))
    rank = read_manifest(tmp_path / "artifacts").ranks[0]
    weights = load_file(tmp_path / "artifacts" / rank.weights)
    model = load_model(checkpoint, as_stored=True)
    for name, quantized in model.quantized_weights.items():
        kept = dict(model.named_parameters())[name]
        assert weights[name].dtype == kept.dtype in (FP8, fp4.PAIRS)
        assert torch.equal(weights[name].view(torch.uint8), kept.view(torch.uint8))
        assert weights[quantized.scale].dtype == (fp4.EXPONENTS if kept.dtype == fp4.PAIRS else torch.float32)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7]]
    served = Engine(tmp_path / "artifacts").generate([Request(p, 6, stop_at_eos=False) for p in prompts])
    eager = generate(load_model(checkpoint), prompts, max_new_tokens=6, kv=PagedKV(8, 64), prefill_chunk=8,
                     stop_at_eos=False)
    assert [r.output_ids for r in served] == eager
