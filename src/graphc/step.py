"""What a step graph takes after its weights: shared by capture (which builds them), the manifest
schema (which checks every graph lists them) and the runtime (which feeds them). Torch-free."""

STEP_INPUTS = (
    "input_ids", "positions", "block_table", "slot_mapping", "kv_pool",
    "logits_index", "temperature", "top_k", "top_p", "seed",
)
"""Per-step graph inputs after the weights, in call order."""
