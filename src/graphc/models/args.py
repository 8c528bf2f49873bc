"""`ModelArgs`: the DeepSeek-V3 / V3.2 hyper-parameters graphc needs, read from an HF `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphc.errors import CheckpointError

if TYPE_CHECKING:
    from graphc.models.v41_args import V41Args
    from graphc.models.v4_args import V4Args

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM",
                           "DeepseekV41ForCausalLM")
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32")
SPARSE_MODEL_TYPE = "deepseek_v32"
INDEXER_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
"""transformers' `DeepseekV32Config` defaults (the released model's values), for config.json files
that leave them out."""


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


@dataclass(frozen=True)
class ModelArgs:
    """DeepSeek-V3 architecture hyper-parameters (names follow the HF `config.json`).

    Shape letters used in the model code: T tokens per row (Q in the step layout), B rows,
    H heads, R kv_lora_rank, E routed experts, K experts per token, D hidden size.
    """

    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """D: width of the residual stream."""
    intermediate_size: int
    """Hidden width of the dense MLP used by the first `first_k_dense_replace` layers."""
    moe_intermediate_size: int
    """Hidden width of one routed expert (and, times `n_shared_experts`, of the shared expert)."""
    num_hidden_layers: int
    """Decoder layers of the main model (multi-token-prediction layers come after these)."""
    num_attention_heads: int
    """H: attention heads."""
    kv_lora_rank: int
    """R: width of the compressed KV latent that the cache stores."""
    q_lora_rank: int | None
    """Width of the query LoRA; None means a direct `q_proj`."""
    qk_nope_head_dim: int
    """Per-head query/key dims without position encoding."""
    qk_rope_head_dim: int
    """Per-head query/key dims with RoPE; the key part is shared by all heads and cached."""
    v_head_dim: int
    """Per-head value dims."""
    n_routed_experts: int
    """E: routed experts per MoE layer."""
    n_shared_experts: int
    """Shared experts per MoE layer, fused into one MLP of `n_shared_experts` times the width."""
    num_experts_per_tok: int
    """K: routed experts chosen per token."""
    n_group: int
    """Expert groups for group-limited routing."""
    topk_group: int
    """Groups a token may route into."""
    norm_topk_prob: bool
    """Renormalise the chosen experts' weights to sum to one."""
    routed_scaling_factor: float
    """Multiplier on the routed experts' weights."""
    first_k_dense_replace: int
    """Leading layers that use the dense MLP instead of the MoE."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    max_position_embeddings: int
    """Longest position the model supports."""
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction layers stored after the main layers; graphc does not run them."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    hidden_act: str = "silu"
    """Activation of every MLP; only SiLU is supported."""
    attention_bias: bool = False
    """Biases on q_a_proj, kv_a_proj_with_mqa and o_proj."""
    eos_token_id: tuple[int, ...] = ()
    """Token ids that end generation."""
    rope: RopeArgs = field(default_factory=RopeArgs)
    """Rotary embedding settings."""
    index_n_heads: int | None = None
    """DeepSeek-V3.2's lightning indexer: its query heads. None (with the two below) is dense MLA
    (DeepSeek-V3)."""
    index_head_dim: int | None = None
    """Width of the indexer's query heads and of its one cached key per token; its first
    `qk_rope_head_dim` dims are roped (half-split layout)."""
    index_topk: int | None = None
    """Keys each query attends to under sparse attention (all visible keys when fewer)."""

    def __post_init__(self) -> None:
        checks = [
            (self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts ({self.n_routed_experts})"),
            (self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})"),
            (1 <= self.topk_group <= self.n_group,
             f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})"),
            (self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
             f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= topk_group * experts per group "
             f"({self.topk_group} * {self.n_routed_experts // self.n_group})"),
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even"),
            (self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported; only 'silu' is"),
            (0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace ({self.first_k_dense_replace}) must be in 0..num_hidden_layers "
             f"({self.num_hidden_layers})"),
        ]
        indexer = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if any(v is not None for v in indexer):
            checks += [
                (all(v is not None and v > 0 for v in indexer),
                 f"index_n_heads, index_head_dim and index_topk ({', '.join(map(str, indexer))}) must all be "
                 "positive integers"),
                (self.q_lora_rank is not None, "the indexer (index_* fields) needs q_lora_rank; it reads the q latent"),
                (self.index_head_dim is None or self.index_head_dim > self.qk_rope_head_dim,
                 f"index_head_dim ({self.index_head_dim}) must exceed qk_rope_head_dim ({self.qk_rope_head_dim})"),
            ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"config.json: {message}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek Sparse Attention: an indexer picks each query's keys (DeepSeek-V3.2)."""
        return self.index_topk is not None

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token: the normalised latent, the roped shared key, and under sparse
        attention the indexer's key."""
        return self.kv_lora_rank + self.qk_rope_head_dim + (self.index_head_dim or 0)

    @property
    def cache_layers(self) -> int:
        """Layers of the paged pool: one per decoder layer."""
        return self.num_hidden_layers

    @property
    def architecture(self) -> str:
        return "DeepseekV32ForCausalLM" if self.sparse_attention else "DeepseekV3ForCausalLM"

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.yarn_factor is not None and self.rope.yarn_mscale_all_dim:
            mscale = yarn_mscale(self.rope.yarn_factor, self.rope.yarn_mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


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
        "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk")},
    **{name: (int, COUNT) for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")},
    **{name: (float, 0.0) for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta")},
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


def model_args_from_hf_config(config: dict[str, Any]) -> "ModelArgs | V4Args | V41Args":
    """Translate an HF DeepSeek `config.json` into `ModelArgs` (V3 / V3.2), `V4Args` (V4) or
    `V41Args` (V4.1), refusing other architectures.

    One function on purpose: a field-by-field translation that reads top to bottom."""
    # V4's and V4.1's build on this module
    from graphc.models.v41_args import is_v41_config, v41_args_from_hf_config
    from graphc.models.v4_args import is_v4_config, v4_args_from_hf_config

    if is_v41_config(config):
        return v41_args_from_hf_config(config)
    if is_v4_config(config):
        return v4_args_from_hf_config(config)
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    model_type = config.get("model_type")
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures) and model_type not in SUPPORTED_MODEL_TYPES:
        named = ", ".join(architectures) or f"model_type {model_type!r}"
        raise CheckpointError(
            f"config.json: architecture {named} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    required = [
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok",
    ]
    missing = [k for k in required if config.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json: missing required field(s) {', '.join(missing)}")
    check_field_types(config)
    first_dense = config.get("first_k_dense_replace") or 0
    layer_types = config.get("mlp_layer_types")
    implied = ["dense"] * first_dense + ["sparse"] * (config["num_hidden_layers"] - first_dense)
    if layer_types is not None and list(layer_types) != implied:
        raise CheckpointError(f"config.json: mlp_layer_types {layer_types} is not supported; graphc runs "
                              f"first_k_dense_replace ({first_dense}) dense layers, then MoE layers")
    attention_types = set(config.get("layer_types") or [])
    if attention_types - {"indexed_attention"}:
        raise CheckpointError(f"config.json: layer_types {sorted(attention_types)} is not supported; graphc runs "
                              "'indexed_attention' (DeepSeek-V3.2's) in every layer")
    indexer = {}
    if model_type == SPARSE_MODEL_TYPE or "DeepseekV32ForCausalLM" in architectures:
        indexer = {k: default if config.get(k) is None else config[k] for k, default in INDEXER_DEFAULTS.items()}
    eos = config.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ModelArgs(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        moe_intermediate_size=config["moe_intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        kv_lora_rank=config["kv_lora_rank"],
        q_lora_rank=config.get("q_lora_rank"),
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        n_routed_experts=config["n_routed_experts"],
        n_shared_experts=config.get("n_shared_experts") or 0,
        num_experts_per_tok=config["num_experts_per_tok"],
        n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=first_dense,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        num_nextn_predict_layers=config.get("num_nextn_predict_layers") or 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        attention_bias=bool(config.get("attention_bias", False)),
        eos_token_id=eos_ids,
        rope=_rope_args(config),
        **indexer,
    )


def _rope_args(config: dict[str, Any]) -> RopeArgs:
    # Released DeepSeek checkpoints use `rope_scaling` + top-level `rope_theta`; transformers 5 writes
    # `rope_parameters` with the theta inside. Accept both.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    interleave = bool(config.get("rope_interleave", True))
    if rope_type == "default":
        return RopeArgs(theta=theta, interleave=interleave)
    if rope_type != "yarn":
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported; supported: default, yarn")
    original = params.get("original_max_position_embeddings", config.get("max_position_embeddings", 4096))
    factor = params.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / original
    return RopeArgs(
        theta=theta,
        interleave=interleave,
        yarn_factor=float(factor),
        yarn_original_max_position=int(original),
        yarn_beta_fast=float(params.get("beta_fast") or 32),
        yarn_beta_slow=float(params.get("beta_slow") or 1),
        yarn_mscale=params.get("mscale"),
        yarn_mscale_all_dim=params.get("mscale_all_dim"),
        yarn_attention_factor=params.get("attention_factor"),
        yarn_truncate=bool(params.get("truncate", True)),
    )
