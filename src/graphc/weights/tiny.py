"""Tiny checkpoints in each family's real layout, for tests, CI and the README's demo.

The presets are the families' (`Family.tiny.presets`: `deepseek_v3/presets.py`, ...); this module
writes any of them: random weights of every tensor the released layout stores, the MTP and other
skipped tensors included, optionally FP8 with block scales, and a byte-level tokenizer. One more,
`trained`, is not random: a tiny DeepSeek-V3 and its MTP layer trained on text
(`scripts/train_tiny.py`), shipped in the package, so generations read as text and speculative
decoding's drafts are accepted as they would be with a released model.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from graphc.errors import GraphcError
from graphc.weights import fp4
from graphc.weights.checkpoint import expected_tensors
from graphc.weights.fp8 import quantize, quantize_ue8m0, scale_name
from graphc.models.family import Family
from graphc.models.registry import FAMILIES, family_of_config

PRESETS: dict[str, dict[str, Any]] = {name: config for family in FAMILIES for name, config in family.tiny.presets.items()}
"""Every family's presets, by name."""
DEFAULT_PRESET = "lora-groups"
TRAINED_PRESET = "trained"
TRAINED_CHECKPOINT = Path(__file__).parent / "trained"
"""The `trained` preset's checkpoint: config.json, model.safetensors (fp32, 1.4 M parameters),
the byte-level tokenizer, and training.json (its held-out losses)."""
TRANSFORMERS_PRESETS = tuple(name for family in FAMILIES if family.reference.model is None for name in family.tiny.presets)
"""The presets whose architecture transformers implements."""


def preset_difference(preset: str) -> tuple[str, dict[str, Any]]:
    """The preset's family name and its config: whole for the family's first preset, else what it
    sets differently from that one."""
    family = family_of_config(preset_config(preset))
    base = next(iter(family.tiny.presets))
    config = family.tiny.presets[preset]
    if preset == base:
        return family.name, config
    return family.name, {k: v for k, v in config.items() if family.tiny.presets[base].get(k) != v}


def preset_config(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise GraphcError(f"preset {preset!r} is unknown; available: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[preset])


V4_OFFSETS = re.compile(r"(attn_sink|\.ape|_base)$")
"""V4 parameters that transformers zeroes: sinks, position biases, HC bases (0.5-scale here)."""


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # Unit-scale activations (std 1/sqrt(fan_in) weights) keep logits spread out, so greedy
    # decoding is decisive and reference comparisons are meaningful.
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith(("e_score_correction_bias", "gate.bias", "gate.bias_vl")):
        return 0.05 * torch.randn(shape, generator=generator)
    if name.endswith(("embed_tokens.weight", "embed.weight")):
        return torch.randn(shape, generator=generator)
    if V4_OFFSETS.search(name):
        return 0.5 * torch.randn(shape, generator=generator)
    if name.endswith("_scale"):  # the HC mixes' scales
        return 1.0 + 0.2 * torch.randn(shape, generator=generator)
    if name.endswith(("q_weight", "k_weight")):  # Engram's gate norms: near 1, so gates spread
        return 1.0 + 0.3 * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])


def tiny_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 tensors for every name the checkpoint holds, MTP layers (and what else loaders
    skip) included."""
    family = family_of_config(config)
    args = family.args_from_hf_config(config)
    shapes = expected_tensors(family.tiny.serving_every_draft_layer(args))
    shapes.update(family.tiny.draft_and_extra_shapes(args, shapes))
    generator = torch.Generator().manual_seed(seed)
    return {name: _token_experts(shapes[name], args.n_routed_experts, generator) if name.endswith("tid2eid")
            else _random_tensor(name, shapes[name], generator) for name in sorted(shapes)}


def _token_experts(shape: tuple[int, ...], experts: int, generator: torch.Generator) -> torch.Tensor:
    """A hash layer's `tid2eid` [V, K]: K distinct experts for every token."""
    return torch.stack([torch.randperm(experts, generator=generator)[:shape[1]] for _ in range(shape[0])])


TINY_TOKENIZER_CONFIG = {
    "chat_template": (Path(__file__).parent / "tiny_chat_template.jinja").read_text(),
    "bos_token": None,
    "eos_token": None,
}
"""A chat template in transformers' format (tokenizer_config.json), so the tiny checkpoints can be
served over a chat API like a released model: DeepSeek-V3.1's markup, tool calls and thinking
switch (`tiny_chat_template.jinja`)."""


def byte_level_tokenizer():
    """A byte-level tokenizer whose ids are the byte values 0..255 (GPT-2's byte alphabet, no
    merges): any text round-trips, and it fits the presets' 256-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    remapped = [b for b in range(256) if b not in printable]
    alphabet = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(remapped)}
    tokenizer = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def quantize_fp8(tensors: dict[str, torch.Tensor], block: tuple[int, int], family: Family,
                 experts_fp4: bool = False, ue8m0: bool = False) -> dict[str, torch.Tensor]:
    """The family's FP8 release layout: the weights it quantises (`Family.stored.fp8_quantised`: the decoder
    layers' projections) as float8_e4m3fn with block scales (power-of-two `X.scale` ones with
    `ue8m0` or `Family.stored.ue8m0_scales`, as DeepSeek-V4's releases store them; a row-sharded table's
    per row), or, with `experts_fp4`, as FP4 (`fp4_quantised`: the routed experts, their bytes as
    int8, as the releases store them); embeddings, norms, the router and the head stay as they are."""
    out = {}
    ue8m0 = ue8m0 or family.stored.ue8m0_scales
    quantizer = quantize_ue8m0 if ue8m0 else quantize
    for name, tensor in tensors.items():
        if experts_fp4 and family.stored.fp4_quantised.match(name):
            pairs, out[scale_name(name, ue8m0)] = fp4.quantize(tensor)
            out[name] = pairs.view(torch.int8)
        elif family.stored.fp8_quantised.match(name):
            per_row = name.endswith(family.stored.row_sharded_tables)
            out[name], out[scale_name(name, ue8m0)] = quantizer(tensor, (1, block[1]) if per_row else block)
        else:
            out[name] = tensor
    return out


def make_tiny_checkpoint(out: str | Path, preset: str = DEFAULT_PRESET, seed: int = 0, force: bool = False,
                         fp8_block: int | None = None, index_topk: int | None = None) -> Path:
    """Write config.json, model.safetensors and a byte-level tokenizer.json for `preset` into
    `out`, atomically; with `fp8_block`, projection weights are FP8 with fp8_block^2 scale blocks;
    `index_topk` replaces a V3.2 preset's (a value below the context makes attention sparse).

    Raises:
        GraphcError: unknown preset, `index_topk` for a preset without an indexer, or `out`
            exists and `force` is not set.
    """
    out = Path(out)
    config = json.loads((TRAINED_CHECKPOINT / "config.json").read_text()) if preset == TRAINED_PRESET \
        else preset_config(preset)
    if out.exists() and not force:
        raise GraphcError(f"output {str(out)!r} already exists; pass --force to replace it")
    if fp8_block is not None and fp8_block < 1:
        raise GraphcError(f"fp8 block size {fp8_block} must be a positive integer")
    if index_topk is not None:
        if "index_topk" not in config:
            with_indexer = [name for name in PRESETS if "index_topk" in PRESETS[name]]
            raise GraphcError(f"--index-topk: preset {preset!r} has no sparse-attention indexer; "
                              f"presets with one: {', '.join(with_indexer)}")
        if index_topk < 1:
            raise GraphcError(f"--index-topk: {index_topk} must be a positive integer")
        config["index_topk"] = index_topk
    if fp8_block is not None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [fp8_block, fp8_block]}
        config["quantization_config"].update(family_of_config(config).tiny.quantization_config)
    if preset == TRAINED_PRESET:
        return write_checkpoint(out, config, load_file(TRAINED_CHECKPOINT / "model.safetensors"))
    return write_random_checkpoint(out, config, seed)


def write_random_checkpoint(out: Path, config: dict[str, Any], seed: int) -> Path:
    """Write `config` (an HF config.json dict) with random weights into `out`, atomically,
    replacing what is there: `quantization_config`, if present, says how to store the FP8 weights.
    `make_tiny_checkpoint` writes the presets through it; `bench/bench_scale.py` its larger shapes."""
    return write_checkpoint(out, config, tiny_tensors(config, seed))


def write_checkpoint(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """`write_random_checkpoint` of the given fp32 `tensors` (every tensor the layout stores)."""
    family = family_of_config(config)
    if "quantization_config" in config:
        quantization = config["quantization_config"]
        tensors = quantize_fp8(tensors, tuple(quantization["weight_block_size"]), family, fp4.experts_in_fp4(config),
                               quantization.get("scale_fmt") == "ue8m0")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        if family.args_from_hf_config(config).vocab_size == 256:
            byte_level_tokenizer().save(str(staging / "tokenizer.json"))
            (staging / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER_CONFIG, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
