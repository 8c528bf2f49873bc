"""Tiny random DeepSeek-V3 checkpoints in real HF layout, for tests, CI and the README's demo.

The presets together exercise every architecture feature graphc implements: DeepSeek-V3.2's
sparse attention indexer, q LoRA on and off,
group-limited routing and plain top-k, dense first layers or none, YaRN with and without an
mscale attention factor, interleaved and half-split RoPE, normalised and raw top-k weights,
several shared experts, and a multi-token-prediction layer stored after the main layers (as
DeepSeek's releases do) that loaders must skip.

The `v4` preset is DeepSeek-V4 in the released layout (`v4_layout`): all three attention kinds
(sliding only, CSA, HCA) with rates small enough (4 and 8, a window of 8) that short prompts close
many windows and slide past the window, an indexer keeping fewer entries than a prompt closes,
hash-routed layers, 4 residual streams, clamped SwiGLU, YaRN on the compress RoPE, and an MTP
module stored under `mtp.` that loaders skip. The parameters transformers initialises to zero
(sinks, position biases, HC bases, correction biases, `tid2eid`) are random, non-zero and distinct.

The `v41` preset is DeepSeek-V4.1 in the released layout (config under `text_config`): every layer
role (sliding, a KV + index source at rate 2 and one at rate 1, a layer reusing entries and
selection, a re-indexing layer choosing among the candidate layer's blocks), Engram at two layers
(4-grams, 2 hash heads, tables of ~6 k rows), rms_norm_eps 1e-20 as released, and an MTP layer.
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
from safetensors.torch import save_file

from graphc.errors import GraphcError
from graphc.models import v4_layout
from graphc.models.args import ModelArgs, model_args_from_hf_config
from graphc.models.checkpoint import expected_tensors
from graphc.models.fp8 import quantize, quantize_ue8m0, scale_name
from graphc.models.v41_args import V41Args, is_v41_config
from graphc.models.v4_args import V4Args, is_v4_config

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    # q LoRA, 4 groups choose 2, one dense layer, plain RoPE.
    "lora-groups": {},
    # Direct q projection, plain top-k (one group), every layer MoE, YaRN, raw top-k weights.
    "direct-q-yarn": {
        "q_lora_rank": None,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "rope_scaling": {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    },
    # YaRN whose cos/sin factor is not 1 (mscale != mscale_all_dim), half-split RoPE, 2 shared experts.
    "yarn-mscale": {
        "q_lora_rank": 32,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 2,
        "rope_interleave": False,
        "rope_scaling": {
            "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
        },
    },
    # 16 routed experts in 4 groups, 4 per token: enough experts for a 16-way expert-parallel run.
    "wide-16e": {
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 0,
    },
    # DeepSeek-V3.2: a lightning indexer (16 heads of 32) picks each query's keys. index_topk covers
    # every tiny context, so attention is dense, as `DeepseekV32ForCausalLM` computes it; the sparse
    # tests lower index_topk.
    "v32": {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 2048,
    },
}
PRESETS["v4"] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 256,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 32,
    "partial_rotary_factor": 0.25,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "sliding_window": 8,
    # 16 indexer heads: a score is exactly 0 (a top-k tie) only when every head's ReLU is.
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "o_groups": 2,
    "o_lora_rank": 16,
    "swiglu_limit": 3.0,  # low enough that random activations reach it
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "float32",
}
PRESETS["v41"] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 3.0,
        "rms_norm_eps": 1e-20,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 256,
        "sliding_window": 8,
        # Layer roles: 0 sliding; 1 sliding + Engram; 2 KV and index source (rate 2); 3 reuses
        # layer 2's entries and selection; 4 KV and index source (rate 1), the candidate layer,
        # + Engram; 5 re-indexes layer 4's keys among its candidate blocks. The last entry is the
        # draft layer's (the release lists its draft layers' ratios too).
        "compress_ratios": [0, 0, 2, 2, 1, 1, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 5],
        "candidate_source_layer_id": 4,
        # 3 blocks of 4 candidates >= index_topk + a block: a candidate-masked layer always has
        # index_topk entries to choose from once it sees that many (no ambiguous -inf picks).
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 6,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 4],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 2,
        "engram_head_dim": 16,
        "engram_vocab_size": 1000,
        "engram_num_embeddings": [6126, 6332],
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 256,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "dtype": "float32",
}
DEFAULT_PRESET = "lora-groups"
MLA_PRESETS = tuple(name for name, preset in PRESETS.items() if not (is_v4_config(preset) or is_v41_config(preset)))
"""The DeepSeek-V3 / V3.2 presets (multi-head latent attention)."""
TRANSFORMERS_PRESETS = tuple(name for name, preset in PRESETS.items() if not is_v41_config(preset))
"""The presets whose architecture transformers implements (every one but DeepSeek-V4.1)."""

FP8_QUANTISED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(?!weights_proj)(\w+_proj|wq_b|wk)\.weight$")
"""The weights DeepSeek's FP8 releases quantise: the decoder layers' linear projections (the
indexer's too, but not its per-head weights, which stay in full precision)."""
V41_FP8 = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)"
                     r"\.w[123]|engram\.(wkv|embed))\.weight$")
"""The weights DeepSeek-V4.1's release stores as FP8 (its routed experts are FP4 there; graphc's
tiny checkpoints store them as FP8 too), the Engram tables with a scale per row and 32 columns."""
MTP_EXTRA_TENSORS = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                     "shared_head.norm.weight", "shared_head.head.weight")


def preset_config(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise GraphcError(f"preset {preset!r} is unknown; available: {', '.join(PRESETS)}")
    whole = is_v4_config(PRESETS[preset]) or is_v41_config(PRESETS[preset])
    base = {} if whole else BASE_CONFIG
    return copy.deepcopy({**base, **PRESETS[preset]})


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
    """Random fp32 tensors for every name the checkpoint holds, MTP layers included."""
    args = model_args_from_hf_config(config)
    shapes = expected_tensors(args)
    if isinstance(args, (V4Args, V41Args)):
        # DeepSeek-V4 and V4.1 keep their MTP modules under `mtp.`: one more decoder layer's tensors here.
        shapes.update({f"mtp.{mtp}." + n.removeprefix("layers.0."): shape
                       for mtp in range(args.num_nextn_predict_layers)
                       for n, shape in list(shapes.items()) if n.startswith("layers.0.")})
    if isinstance(args, V41Args):  # the image tokens' router bias, which text-only loaders skip
        shapes.update({f"layers.{i}.ffn.gate.bias_vl": (args.n_routed_experts,) for i in range(args.num_hidden_layers)})
    last = args.num_hidden_layers - 1
    for mtp in range(args.num_nextn_predict_layers if isinstance(args, ModelArgs) else 0):
        # An MTP module is a full (MoE) decoder layer plus its own projections and head.
        layer = args.num_hidden_layers + mtp
        prefix = f"model.layers.{layer}."
        for name, shape in list(shapes.items()):
            if name.startswith(f"model.layers.{last}."):
                shapes[prefix + name.removeprefix(f"model.layers.{last}.")] = shape
        d, v = args.hidden_size, args.vocab_size
        extra_shapes = [(v, d), (d,), (d,), (d, 2 * d), (d,), (v, d)]
        shapes.update({prefix + n: s for n, s in zip(MTP_EXTRA_TENSORS, extra_shapes)})
    generator = torch.Generator().manual_seed(seed)
    return {name: _token_experts(shapes[name], args.n_routed_experts, generator) if name.endswith("tid2eid")
            else _random_tensor(name, shapes[name], generator) for name in sorted(shapes)}


def _token_experts(shape: tuple[int, ...], experts: int, generator: torch.Generator) -> torch.Tensor:
    """A hash layer's `tid2eid` [V, K]: K distinct experts for every token."""
    return torch.stack([torch.randperm(experts, generator=generator)[:shape[1]] for _ in range(shape[0])])


TINY_TOKENIZER_CONFIG = {
    "chat_template": "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "bos_token": None,
    "eos_token": None,
}
"""A chat template in transformers' format (tokenizer_config.json), so the tiny checkpoints can be
served over a chat API like a released model (whose template is longer, not different in kind)."""


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


def quantize_fp8(tensors: dict[str, torch.Tensor], block: tuple[int, int],
                 quantised: re.Pattern = FP8_QUANTISED, ue8m0: bool = False) -> dict[str, torch.Tensor]:
    """DeepSeek's FP8 release layout: every projection weight of the decoder layers (attention,
    dense and expert MLPs; `quantised` names them) as float8_e4m3fn with block scales (`ue8m0`:
    V4.1's power-of-two scales, and its Engram tables' per row); embeddings, norms, the router and
    the head stay as they are."""
    out = {}
    for name, tensor in tensors.items():
        if quantised.match(name):
            per_row = ue8m0 and name.endswith("engram.embed.weight")
            quantizer = quantize_ue8m0 if ue8m0 else quantize
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
    config = preset_config(preset)
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
        if is_v41_config(config):
            config["quantization_config"]["scale_fmt"] = "ue8m0"
    return write_random_checkpoint(out, config, seed)


def write_random_checkpoint(out: Path, config: dict[str, Any], seed: int) -> Path:
    """Write `config` (an HF config.json dict) with random weights into `out`, atomically,
    replacing what is there: `quantization_config`, if present, says how to store the FP8 weights.
    `make_tiny_checkpoint` writes the presets through it; `bench/bench_scale.py` its larger shapes."""
    tensors = tiny_tensors(config, seed)
    if "quantization_config" in config:
        v41 = is_v41_config(config)
        quantised = V41_FP8 if v41 else v4_layout.FP8_RELEASED if is_v4_config(config) else FP8_QUANTISED
        tensors = quantize_fp8(tensors, tuple(config["quantization_config"]["weight_block_size"]), quantised, v41)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        if model_args_from_hf_config(config).vocab_size == 256:
            byte_level_tokenizer().save(str(staging / "tokenizer.json"))
            (staging / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER_CONFIG, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
