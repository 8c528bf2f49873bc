"""The DeepSeek-V4.1 tiny-checkpoint preset, in the released layout (config under `text_config`).

Every layer role (sliding, a KV + index source at rate 2 and one at rate 1, a layer reusing
entries and selection, a re-indexing layer choosing among the candidate layer's blocks), Engram
at two layers (4-grams, 2 hash heads, tables of ~6 k rows), rms_norm_eps 1e-20 as released, and
DSpark's draft stages.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {}
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
        # + Engram; 5 re-indexes layer 4's keys among its candidate blocks. The last entries are
        # the DSpark stages' (the release lists its draft layers' ratios too).
        "compress_ratios": [0, 0, 2, 2, 1, 1, 0, 0, 0],
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
        # DSpark as the release has it (3 stages over the last 3 layers' residuals), smaller: a
        # block of 4, half the experts.
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 4,
        "dspark_noise_token_id": 250,
        "dspark_target_layer_ids": [3, 4, 5],
        "dspark_markov_rank": 8,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "dtype": "float32",
}
