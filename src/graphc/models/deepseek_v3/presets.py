"""DeepSeek-V3 / V3.2 tiny-checkpoint presets (`graphc checkpoint make-tiny --preset`).

Together they exercise every V3 feature graphc implements: DeepSeek-V3.2's sparse-attention
indexer, q LoRA on and off, group-limited routing and plain top-k, dense first layers or none,
YaRN with and without an mscale attention factor, interleaved and half-split RoPE, normalised
and raw top-k weights, several shared experts, and a multi-token-prediction layer stored after
the main layers (as DeepSeek's releases do) that loaders must skip.
"""

from __future__ import annotations

import copy
from typing import Any

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


OVERRIDES: dict[str, dict[str, Any]] = {
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
"""Each preset as its difference from `BASE_CONFIG`."""

PRESETS = {name: copy.deepcopy({**BASE_CONFIG, **overrides}) for name, overrides in OVERRIDES.items()}
