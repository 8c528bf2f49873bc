"""What every family reads of an HF `config.json` the same way: the file itself, the field
types and ranges, the architecture names, the EOS ids, and RoPE's settings."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphc.errors import CheckpointError


@dataclass(frozen=True)
class RopeArgs:
    """Rotary embedding of the `qk_rope_head_dim` slice of queries and keys."""

    theta: float = 10000.0
    """Base wavelength."""
    interleave: bool = True
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's weights expect; False rotates
    the two halves (x[:d/2], x[d/2:])."""
    yarn_factor: float | None = None
    """YaRN context-extension factor; None means plain RoPE."""
    yarn_original_max_position: int = 4096
    """The pre-training context YaRN's correction range is computed against."""
    yarn_beta_fast: float = 32.0
    """Rotations above which a frequency is extrapolated (kept)."""
    yarn_beta_slow: float = 1.0
    """Rotations below which a frequency is interpolated (divided by the factor)."""
    yarn_mscale: float | None = None
    """Numerator coefficient of the cos/sin attention factor."""
    yarn_mscale_all_dim: float | None = None
    """Denominator coefficient of the cos/sin attention factor; also scales the softmax by
    mscale(factor, mscale_all_dim)**2, as DeepSeek does."""
    yarn_attention_factor: float | None = None
    """An explicit cos/sin factor; None derives it from the mscales."""
    yarn_truncate: bool = True
    """Round the correction range outwards to whole dims."""



def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context `factor` times the original."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0



def read_hf_config(checkpoint_dir: Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointError(f"checkpoint dir {str(checkpoint_dir)!r} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; an HF-layout checkpoint needs config.json beside its safetensors")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config



POSITIVE, COUNT = 1, 0



FIELD_TYPES: dict[str, tuple[type, float]] = {
    **{name: (int, POSITIVE) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk",
        # DeepSeek-V4's and V4.1's
        "head_dim", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters", "sliding_window",
        "candidate_topk_blocks", "candidate_block_size", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
        "engram_vocab_size", "compress_rate_csa", "compress_rate_hca",
        # V4.1's DSpark drafter
        "dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok")},
    **{name: (int, COUNT) for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers",
                                       "num_hash_layers", "engram_pad_token_id",
                                       "dspark_noise_token_id")},
    **{name: (float, 0.0) for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta", "compress_rope_theta",
                                       "hc_eps", "swiglu_limit", "gate_temp")},
    **{name: (bool, 0) for name in ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "rope_interleave")},
}
"""config.json fields graphc reads, with their JSON type and the least value allowed (floats
must exceed theirs); null means the default wherever the field is optional."""



def check_field_types(config: dict[str, Any]) -> None:
    """One-line errors for a config.json field of the wrong type or range (before any is used)."""
    for name, (kind, least) in FIELD_TYPES.items():
        value = config.get(name)
        if value is None:
            continue
        # JSON has no int/float distinction for 1.0, but true is not a count; a float must be finite.
        if kind is bool:
            fits = isinstance(value, bool)
        elif kind is int:
            fits = isinstance(value, int) and not isinstance(value, bool) and value >= least
        else:
            fits = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and value > least
        if not fits:
            allowed = {bool: "true or false", int: "an integer >= 1" if least == POSITIVE else "an integer >= 0",
                       float: "a finite number > 0"}[kind]
            raise CheckpointError(f"config.json: {name} is {value!r}; expected {allowed}")
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    vocab = config.get("vocab_size")
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
        raise CheckpointError(f"config.json: eos_token_id is {eos!r}; expected a token id or a list of token ids "
                              f"in 0..{vocab - 1}")


def check_id_lists(config: dict[str, Any], names: tuple[str, ...], where: str = "config.json") -> None:
    """One-line errors for a list-of-ids field (layer ids, compress ratios) that is not a list of
    integers >= 0, or that lists a layer twice (`*_layer_ids`)."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
            raise CheckpointError(f"{where}: {name} is {value!r}; expected a list of integers >= 0")
        if name.endswith("_layer_ids") and len(set(value)) != len(value):
            raise CheckpointError(f"{where}: {name} {value} lists a layer twice")


def architectures(config: dict[str, Any]) -> list[str]:
    """config.json's `architectures`, a list whether it is written as one or as a string."""
    named = config.get("architectures") or []
    return [named] if isinstance(named, str) else list(named)


def names_architecture(config: dict[str, Any], architecture: str, model_type: str) -> bool:
    """Whether config.json names `architecture` or its `model_type` (HF writes either)."""
    return architecture in architectures(config) or config.get("model_type") == model_type


def eos_token_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    """config.json's `eos_token_id` (absent, one id or a list) as a tuple of ids."""
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
