"""`V4Args`: the DeepSeek-V4 hyper-parameters graphc needs, read from an HF `config.json`.

Accepts what transformers' `DeepseekV4Config` accepts: its own field names (`layer_types`,
`compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, nested `rope_parameters`) and the
released checkpoints' legacy ones (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, a flat
`rope_scaling` with `compress_rope_theta`), folded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphc.errors import CheckpointError
from graphc.weights.hf_config import RopeArgs, check_field_types, check_id_lists, eos_token_ids, names_architecture

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
V4_MODEL_TYPE = "deepseek_v4"

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
"""Every layer attends to a sliding window; CSA adds top-k compressed entries (chosen by the
lightning indexer), HCA all compressed entries."""
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
LEGACY_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
"""The released configs' `compress_ratios` per layer, as transformers reads them."""
HASH_MOE, MOE = "hash_moe", "moe"
DEFAULT_HASH_LAYERS = 3
DEFAULT_ROPE_HEAD_DIM_FRACTION = 64 / 512


@dataclass(frozen=True, kw_only=True)
class V4FamilyArgs:
    """What DeepSeek-V4 and V4.1 share (names follow the HF `config.json`)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    """Width of one routed expert, and of the shared expert."""
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    """Width of every query head and of the one shared K = V head."""
    q_lora_rank: int
    rope_head_dim: int
    """Trailing dims of each head that are roped (interleaved pairs)."""
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    hc_mult: int
    """Parallel residual streams (mHC)."""
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: RopeArgs
    """The sliding-only layers' RoPE."""
    compress_rope: RopeArgs
    """The compressed layers' RoPE (their queries, keys and entries, and the indexer's)."""
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class V4Args(V4FamilyArgs):
    """DeepSeek-V4 architecture hyper-parameters."""

    n_shared_experts: int
    layer_types: tuple[str, ...]
    """Attention kind per layer (`ATTENTION_TYPES`)."""
    mlp_layer_types: tuple[str, ...]
    """`hash_moe` (experts chosen by the frozen `tid2eid[token]` table) or `moe` per layer."""
    csa_rate: int
    """Tokens per compressed entry in CSA layers (windows overlap: each entry pools 2 * rate)."""
    hca_rate: int
    """Tokens per compressed entry in HCA layers."""
    draft_layer_types: tuple[str, ...] = ()
    """Attention kind of each MTP module (`mtp.i`), as config.json lists it after the main layers'
    (`compress_ratios` / `layer_types`); sliding only where it lists none (DeepSeek's MTP module
    stores no compressor)."""
    draft_layers: int = 0
    """Of the MTP modules, how many the model serves as speculative decoding's draft (model.yaml's
    `model.speculative`, not config.json): 0 or 1. Loaders skip the others."""

    first_k_dense_replace = 0
    """Every V4 layer is MoE (the attribute shared code reads of `ModelArgs`)."""
    sparse_attention = False
    """No V3.2-style indexed MLA (CSA's indexer is V4's own)."""

    def __post_init__(self) -> None:
        checks = [
            (len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries; num_hidden_layers is {self.num_hidden_layers}"),
            (set(self.layer_types) <= set(ATTENTION_TYPES),
             f"layer_types {sorted(set(self.layer_types) - set(ATTENTION_TYPES))} unknown; allowed: {ATTENTION_TYPES}"),
            (len(self.mlp_layer_types) == self.num_hidden_layers,
             f"mlp_layer_types has {len(self.mlp_layer_types)} entries; num_hidden_layers is {self.num_hidden_layers}"),
            (set(self.mlp_layer_types) <= {HASH_MOE, MOE},
             f"mlp_layer_types {sorted(set(self.mlp_layer_types) - {HASH_MOE, MOE})} unknown; allowed: hash_moe, moe"),
            (self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts ({self.n_routed_experts})"),
            (self.rope_head_dim % 2 == 0 and 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim),
             f"the rope width ({self.rope_head_dim}) must be even and fit head_dim ({self.head_dim}) and "
             f"index_head_dim ({self.index_head_dim})"),
            ((self.num_attention_heads * self.head_dim) % self.o_groups == 0,
             f"o_groups ({self.o_groups}) must divide num_attention_heads * head_dim"),
            (self.csa_rate >= 1 and self.hca_rate >= 1,
             f"compress_rates ({self.csa_rate}, {self.hca_rate}) must be positive"),
            (self.n_shared_experts == 1, f"n_shared_experts is {self.n_shared_experts}; DeepSeek-V4 has 1"),
            (len(self.draft_layer_types) == self.num_nextn_predict_layers,
             f"{len(self.draft_layer_types)} MTP attention kinds for {self.num_nextn_predict_layers} MTP modules "
             "(num_nextn_predict_layers)"),
            (set(self.draft_layer_types) <= set(ATTENTION_TYPES),
             f"MTP layer kinds {sorted(set(self.draft_layer_types) - set(ATTENTION_TYPES))} unknown; allowed: "
             f"{ATTENTION_TYPES}"),
            (0 <= self.draft_layers <= min(1, self.num_nextn_predict_layers),
             f"model.speculative serves {self.draft_layers} MTP module(s); the checkpoint stores "
             f"{self.num_nextn_predict_layers} (num_nextn_predict_layers) and graphc drafts with one"),
        ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"config.json: {message}")

    @property
    def attention_bias(self) -> bool:
        return False

    @property
    def architecture(self) -> str:
        return V4_ARCHITECTURE

    def attention_type(self, layer: int) -> str:
        """Layer `layer`'s attention kind: a main layer's, or past them the served MTP module's."""
        return (self.layer_types + self.draft_layer_types)[layer]

    def mlp_layer_type(self, layer: int) -> str:
        """A main layer's MoE kind; the MTP module's experts are routed by score (DeepSeek's
        reference routes by token only the first `num_hash_layers` layers)."""
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else MOE

    def compress_rate(self, layer: int) -> int | None:
        """Tokens per compressed entry of `layer`; None for a sliding-only layer."""
        return {SLIDING: None, CSA: self.csa_rate, HCA: self.hca_rate}[self.attention_type(layer)]

    def token_state_dim(self, layer: int) -> int:
        """Width of what one token leaves in its layer's token cache: its K = V, then what its
        compressor(s) need to pool the windows it belongs to (see `deepseek_v4` on the cache)."""
        kind = self.attention_type(layer)
        compressor = {SLIDING: 0, HCA: 2 * self.head_dim, CSA: 4 * self.head_dim + 4 * self.index_head_dim}[kind]
        return self.head_dim + compressor

    def entry_dim(self, layer: int) -> int:
        """Width of a compressed entry in its layer's entry cache (CSA adds the indexer's key)."""
        kind = self.attention_type(layer)
        return {SLIDING: 0, HCA: self.head_dim, CSA: self.head_dim + self.index_head_dim}[kind]

    @property
    def kv_cache_dim(self) -> int:
        """C: the cached width, the widest of any layer's token or entry state."""
        return max(max(self.token_state_dim(i), self.entry_dim(i)) for i in range(self.served_layers))

    @property
    def served_layers(self) -> int:
        """Decoder layers the model runs: the main ones and the served MTP module, numbered after them."""
        return self.num_hidden_layers + self.draft_layers

    @property
    def cache_layers(self) -> int:
        """Pool layers: each served layer has a token cache (2i) and an entry cache (2i + 1)."""
        return 2 * self.served_layers


REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "o_groups", "o_lora_rank",
            "index_n_heads", "index_head_dim", "index_topk")


def is_v4_config(config: dict[str, Any]) -> bool:
    return names_architecture(config, V4_ARCHITECTURE, V4_MODEL_TYPE)


def v4_args_from_hf_config(config: dict[str, Any]) -> V4Args:
    """Translate a DeepSeek-V4 `config.json` into `V4Args` (field by field, top to bottom)."""
    missing = [k for k in REQUIRED if config.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json: missing required field(s) {', '.join(missing)}")
    check_field_types(config)
    check_id_lists(config, ("compress_ratios",))
    for name in ("layer_types", "mlp_layer_types"):
        kinds = config.get(name)
        if kinds is not None and (not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds)):
            raise CheckpointError(f"config.json: {name} is {kinds!r}; expected a list of layer kinds, one per layer")
    rates = config.get("compress_rates") or {}
    if not isinstance(rates, dict) or any(isinstance(r, bool) or not isinstance(r, int) for r in rates.values()):
        raise CheckpointError(f"config.json: compress_rates is {rates!r}; expected {{kind: tokens per entry}}")
    layers, nextn = config["num_hidden_layers"], config.get("num_nextn_predict_layers") or 0
    scoring = config.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise CheckpointError(f"config.json: scoring_func {scoring!r} is not supported; DeepSeek-V4 uses 'sqrtsoftplus'")
    if config.get("num_key_value_heads", 1) != 1:
        raise CheckpointError(f"config.json: num_key_value_heads is {config['num_key_value_heads']}; DeepSeek-V4 "
                              "attention has one shared K = V head")
    if not config.get("norm_topk_prob", True):
        raise CheckpointError("config.json: norm_topk_prob false is not supported; DeepSeek-V4 renormalises")
    rates = {**DEFAULT_COMPRESS_RATES, **(config.get("compress_rates") or {})}
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if config.get(legacy) is not None:
            rates[kind] = config[legacy]
    layer_types = config.get("layer_types")
    if layer_types is None and config.get("compress_ratios") is not None:
        unknown = sorted(set(config["compress_ratios"]) - set(LEGACY_RATIO_TYPES))
        if unknown:
            raise CheckpointError(f"config.json: compress_ratios values {unknown} unknown; allowed: 0, 4, 128")
        layer_types = [LEGACY_RATIO_TYPES[r] for r in config["compress_ratios"]]
    if layer_types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        layer_types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    mlp_types = config.get("mlp_layer_types")
    if mlp_types is None:
        hashed = config.get("num_hash_layers", DEFAULT_HASH_LAYERS)
        mlp_types = [HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed)
    fraction = config.get("partial_rotary_factor")
    if fraction is None:
        legacy = config.get("qk_rope_head_dim")
        fraction = legacy / config["head_dim"] if legacy is not None else DEFAULT_ROPE_HEAD_DIM_FRACTION
    return V4Args(
        **shared_fields(config),
        num_hidden_layers=layers,
        rope_head_dim=int(config["head_dim"] * fraction),
        n_shared_experts=config.get("n_shared_experts", 1),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        layer_types=tuple(layer_types[:layers]),
        draft_layer_types=tuple((list(layer_types[layers:]) + [SLIDING] * nextn)[:nextn]),
        mlp_layer_types=tuple(mlp_types[:layers]),
        csa_rate=int(rates[CSA]),
        hca_rate=int(rates[HCA]),
        num_nextn_predict_layers=nextn,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        eos_token_id=eos_token_ids(config.get("eos_token_id")),
    )


def shared_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `V4FamilyArgs` fields V4 and V4.1 read from their config (V4.1's `text_config`) alike,
    with the same defaults."""
    main_rope, compress_rope = rope_args_from_config(config)
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        moe_intermediate_size=config["moe_intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        head_dim=config["head_dim"],
        q_lora_rank=config["q_lora_rank"],
        n_routed_experts=config["n_routed_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
        max_position_embeddings=config.get("max_position_embeddings", 1048576),
        hc_mult=config.get("hc_mult", 4),
        hc_sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
        hc_eps=float(config.get("hc_eps", 1e-6)),
        swiglu_limit=float(config.get("swiglu_limit", 10.0)),
        sliding_window=config.get("sliding_window", 128),
        o_groups=config["o_groups"],
        o_lora_rank=config["o_lora_rank"],
        index_n_heads=config["index_n_heads"],
        index_head_dim=config["index_head_dim"],
        index_topk=config["index_topk"],
        main_rope=main_rope,
        compress_rope=compress_rope,
    )


def rope_args_from_config(config: dict[str, Any]) -> tuple[RopeArgs, RopeArgs]:
    """The main and compress RoPE. transformers nests them as `rope_parameters: {main, compress}`;
    a flat `rope_parameters` / `rope_scaling` (the released form) is the compress one's YaRN, with
    `rope_theta` and `compress_rope_theta` the two bases. Whatever the YaRN settings say, the
    compress RoPE's cos/sin factor is 1 (DeepSeek's reference does not scale them)."""
    params = config.get("rope_parameters") or {}
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    if nested:
        main, compress = params["main"], params["compress"]
    else:
        flat = {k: v for k, v in (params or config.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": config.get("compress_rope_theta", 160000.0)}
    main_type = main.get("rope_type", main.get("type", "default"))
    if main_type != "default":
        raise CheckpointError(f"config.json: the main rope type {main_type!r} is not supported; DeepSeek-V4's is default")
    main_rope = RopeArgs(theta=float(main.get("rope_theta", 10000.0)))
    compress_type = compress.get("rope_type", compress.get("type", "default"))
    theta = float(compress.get("rope_theta", 160000.0))
    if compress_type == "default":
        return main_rope, RopeArgs(theta=theta)
    if compress_type != "yarn":
        raise CheckpointError(f"config.json: compress rope type {compress_type!r} is not supported; supported: "
                              "default, yarn")
    original = compress.get("original_max_position_embeddings", config.get("max_position_embeddings", 4096))
    factor = compress.get("factor") or config.get("max_position_embeddings", original) / original
    return main_rope, RopeArgs(
        theta=theta,
        yarn_factor=float(factor),
        yarn_original_max_position=int(original),
        yarn_beta_fast=float(compress.get("beta_fast") or 32),
        yarn_beta_slow=float(compress.get("beta_slow") or 1),
        yarn_attention_factor=1.0,
        yarn_truncate=bool(compress.get("truncate", True)),
    )
