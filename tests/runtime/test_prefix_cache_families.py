"""Prefix caching on every family's real cache: fp32 tokens with caching on equal tokens with it off.

The eager models run the scheduler's steps directly (no graphs), so the block size can be 4: V4's
heavily compressed windows (8 tokens) then span two blocks, and a reused prefix can end inside an
open compressor window. The compiled and multi-rank paths are in test_prefix_cache_serving.py.
"""

from __future__ import annotations

import pytest
import torch

from graphc.weights.checkpoint import load_model
from graphc.runtime.paged import step_metadata
from graphc.runtime.scheduler import Request, Scheduler
from graphc.step import ceil_div
from support import SPARSE_V32, serve_arrivals

BLOCK, CONTEXT = 4, 64
FAMILIES = ["lora-groups", SPARSE_V32, "v4", "v41"]
BASE = [(13 * i) % 200 + 5 for i in range(32)]
OTHER = [(7 * i + 3) % 200 + 5 for i in range(32)]
# What each prompt shares with those served before it (sequential arrivals), and the tokens its
# cached blocks hold. The block is 4 tokens; V4's compressor windows are 4 (CSA) and 8 (HCA).
SEQUENTIAL = [
    (BASE[:21], 0),               # nothing cached yet; ends inside a block and an HCA window
    (BASE[:21] + [9, 11], 20),    # many blocks; the cached prefix ends inside an HCA window (16..23)
    (BASE[:4] + OTHER[:9], 4),    # one block
    (OTHER[9:20], 0),             # none
    (BASE[:24], 20),              # ends on a block and a window boundary: all blocks but its last
    (BASE[:12], 8),               # ends on a block boundary inside an HCA window
    (BASE[:21] + [9, 11, 4], 20),  # all of an earlier prompt: its last block held generated tokens
]
NEW_TOKENS = 4


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tiny_checkpoints):
    return load_model(tiny_checkpoints[request.param])


def _eager(model, num_blocks: int, caching: bool, arrivals):
    """The scheduler's steps run by the eager model on a pool of its own; greedy tokens."""
    scheduler = Scheduler([], prefill=[8], decode=[1, 4], context_limit=CONTEXT, block_size=BLOCK,
                          num_blocks=num_blocks, max_num_prefilling_tokens=8, eos_token_ids=[],
                          prefix_cache_salt=("eager", "float32") if caching else None)
    pool = model.new_kv_pool(num_blocks, BLOCK)

    def run(step):
        rows = [(sequence.blocks, tokens, start) for sequence, tokens, start in step.rows]
        fields = step_metadata(rows, max(len(tokens) for _, tokens, _ in rows), ceil_div(CONTEXT, BLOCK))
        with torch.no_grad():
            return model(*fields[:4], pool, fields[4]).argmax(-1).tolist()

    return serve_arrivals(scheduler, arrivals, run), scheduler


def _requests(prompts):
    return [Request(prompt, NEW_TOKENS, stop_at_eos=False) for prompt in prompts]


def test_each_prompt_reuses_what_earlier_ones_cached_and_gives_caching_offs_tokens(model):
    prompts, cached = zip(*SEQUENTIAL)
    arrivals = [(40 * i, request) for i, request in enumerate(_requests(prompts))]  # each after the last ends
    on, scheduler = _eager(model, 64, True, arrivals)
    off, _ = _eager(model, 64, False, arrivals)
    assert [r.cached_tokens for r in on] == list(cached)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert scheduler.blocks_in_use == 0


def test_overlapping_arrivals_on_a_pool_that_must_evict_give_caching_offs_tokens(model):
    prompts = [p for p, _ in SEQUENTIAL] * 2
    arrivals = [(3 * i, request) for i, request in enumerate(_requests(prompts))]
    on, scheduler = _eager(model, 20, True, arrivals)  # two or three sequences at a time
    off, _ = _eager(model, 20, False, arrivals)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert {r.finish_reason for r in on} == {"length"}
    assert sum(r.cached_tokens for r in on) > 0 and scheduler.cached_blocks <= 20
