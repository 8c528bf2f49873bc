"""One serving step's inputs: their names, order and shapes per bucket, and the arithmetic of the
paged layout they describe. The one definition that capture (which builds example inputs), the
`verify_bucket_shapes` pass, the manifest schema, the leader/follower channel and the engine
share. Torch-free.
"""

from __future__ import annotations

from graphc.sampling import MAX_TOP_LOGPROBS

STEP_INPUTS = (
    "input_ids", "positions", "block_table", "slot_mapping", "kv_pool",
    "logits_index", "temperature", "top_k", "top_p", "seed", "coordinates",
)
"""Per-step graph inputs after the weights, in call order."""

STEP_OUTPUTS = ("tokens", "logits")
"""What every step program returns, in order: the sampled tokens (or a speculative step's
verdicts) and the logits they were drawn from."""

SCORE_OUTPUTS = ("prompt_logprobs", "prompt_top_logprobs", "prompt_top_ids")
"""What a score step (`graphc.models.scoring`) returns after `STEP_OUTPUTS`: [B, W] fp32, each
position's log-probability of the next token in its row; [B, W, N] fp32 and int64, its N most
likely tokens' (`score_top`), most likely first."""


def step_outputs(kind: str) -> tuple[str, ...]:
    """The outputs of a program of bucket kind `kind`, in order."""
    return STEP_OUTPUTS + (SCORE_OUTPUTS if kind == "score" else ())


def score_top(vocab: int) -> int:
    """N, the alternatives a score step returns at each position."""
    return min(MAX_TOP_LOGPROBS, vocab)


FLOAT_INPUTS = frozenset({"temperature", "top_p"})
"""Step inputs (besides the pool, in the model dtype) that are fp32; the others are int64 but
`coordinates`."""

COORDINATES = ("cp_rank", "ep_rank", "samples")
"""What the int32 `coordinates` input holds, in order: the rank's place in its context-parallel
group (its KV shard) and in its expert-parallel group (its experts), and whether it samples (1 on
the leader). The one input that differs between ranks for the same step, so that ranks share
compiled programs."""

POOL_BLOCKS_DIM = 1
"""The dim of `kv_pool` [L, N, S, C] sized at run time (N, the pool's block count): the one
symbolic dim of every graph."""

PADDING_SLOT = -1
"""Slot-mapping value of a padding token: its KV is not written, and it never reaches an expert."""

ELSEWHERE_SLOT = -2
"""Slot-mapping value of a real token whose KV block lives on another context-parallel rank: not
written here, but a token all the same (the all-to-all MoE tells padding from tokens by slot)."""


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def blocks_per_row(context_limit: int, block_size: int) -> int:
    """M, the width of the block table: the blocks one sequence of `context_limit` tokens needs."""
    return ceil_div(context_limit, block_size)


def kv_pool_shape(layers: int, num_blocks: int, block_size: int, slot_width: int) -> tuple[int, int, int, int]:
    """The paged pool [L, N, S, C]: `layers` pool layers (the model's `cache_layers`) of `num_blocks`
    blocks of `block_size` slots, each `slot_width` wide (its `kv_cache_dim`)."""
    return (layers, num_blocks, block_size, slot_width)


def step_shapes(rows: int, width: int, blocks_per_row: int) -> dict[str, tuple[int, ...]]:
    """The shape of every step input but the pool, for `rows` sequences of `width` tokens
    (a bucket's `rows` and `width`), in `STEP_INPUTS` order."""
    tokens, per_row = (rows, width), (rows,)
    return {
        "input_ids": tokens,
        "positions": tokens,
        "block_table": (rows, blocks_per_row),
        "slot_mapping": tokens,
        "logits_index": per_row,
        "temperature": per_row,
        "top_k": per_row,
        "top_p": per_row,
        "seed": per_row,
        "coordinates": (len(COORDINATES),),
    }
