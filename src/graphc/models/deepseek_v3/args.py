"""`V3Args`: the DeepSeek-V3 / V3.2 hyper-parameters graphc needs, read from an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphc.errors import CheckpointError
from graphc.weights.hf_config import RopeArgs, architectures, check_field_types, eos_token_ids, yarn_mscale

V3_ARCHITECTURE, V32_ARCHITECTURE = "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"
V3_MODEL_TYPES = ("deepseek_v3", "deepseek_v32")
SPARSE_MODEL_TYPE = "deepseek_v32"
INDEXER_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
"""transformers' `DeepseekV32Config` defaults (the released model's values), for config.json files
that leave them out."""


@dataclass(frozen=True)
class V3Args:
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
    """Multi-token-prediction layers stored after the main layers."""
    draft_layers: int = 0
    """Of those, how many the model serves as speculative decoding's draft (model.yaml's
    `model.speculative`, not config.json): 0 or 1. Loaders skip the others."""
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
            (0 <= self.draft_layers <= min(1, self.num_nextn_predict_layers),
             f"model.speculative serves {self.draft_layers} MTP layer(s); the checkpoint stores "
             f"{self.num_nextn_predict_layers} (num_nextn_predict_layers) and graphc drafts with one"),
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
        """Layers of the paged pool: one per decoder layer, the served MTP layer's included."""
        return self.num_hidden_layers + self.draft_layers

    @property
    def architecture(self) -> str:
        return V32_ARCHITECTURE if self.sparse_attention else V3_ARCHITECTURE

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.yarn_factor is not None and self.rope.yarn_mscale_all_dim:
            mscale = yarn_mscale(self.rope.yarn_factor, self.rope.yarn_mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def is_v3_config(config: dict[str, Any]) -> bool:
    """DeepSeek-V3 or V3.2, by architecture or model_type."""
    return bool({V3_ARCHITECTURE, V32_ARCHITECTURE} & set(architectures(config))) or \
        config.get("model_type") in V3_MODEL_TYPES


def v3_args_from_hf_config(config: dict[str, Any]) -> V3Args:
    """Translate a DeepSeek-V3 / V3.2 `config.json` into `V3Args` (field by field, top to bottom)."""
    model_type = config.get("model_type")
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
    if model_type == SPARSE_MODEL_TYPE or V32_ARCHITECTURE in architectures(config):
        indexer = {k: default if config.get(k) is None else config[k] for k, default in INDEXER_DEFAULTS.items()}
    return V3Args(
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
        eos_token_id=eos_token_ids(config.get("eos_token_id")),
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
