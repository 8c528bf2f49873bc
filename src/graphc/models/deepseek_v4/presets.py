"""The DeepSeek-V4 tiny-checkpoint preset, in the released layout (`layout.py`).

All three attention kinds (sliding only, CSA, HCA) with rates small enough (4 and 8, a window of
8) that short prompts close many windows and slide past the window, an indexer keeping fewer
entries than a prompt closes, hash-routed layers, 4 residual streams, clamped SwiGLU, YaRN on the
compress RoPE, and an MTP module stored under `mtp.` that loaders skip. The parameters
transformers initialises to zero (sinks, position biases, HC bases, correction biases, `tid2eid`)
are random, non-zero and distinct (`tiny.py`).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {}
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
