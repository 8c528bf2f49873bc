"""graphc's eager DeepSeek-V3 against transformers' DeepseekV3ForCausalLM, in fp32.

Every preset, from both checkpoint sources (graphc's make-tiny and transformers' save_pretrained):
full-sequence logits to 1e-4 relative, 32 greedy tokens equal to `generate`, and the paged cache
consistent with itself (prefill + cached decode, chunked prefill == one full forward).
"""

from __future__ import annotations

import pytest
import torch

from graphc.weights.checkpoint import load_model
from graphc.weights.tiny import TRANSFORMERS_PRESETS
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from graphc.tools.generate import PagedKV, generate
from support import hf_greedy, load_hf

SOURCES = ["graphc", "transformers"]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [200], list(range(10, 47))]
NEW_TOKENS = 32
LOGITS_RTOL = 1e-4


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] logits of one sequence in a single prefill step."""
    tokens = ids[0].tolist()
    kv = PagedKV(block_size=16, num_blocks=8)
    seq = SequenceBlocks(kv.block_size)
    seq.reserve(len(tokens), BlockAllocator(kv.num_blocks))
    input_ids, positions, block_table, slots, _ = step_metadata([(seq, tokens, 0)], len(tokens), 8)
    with torch.no_grad():
        return model(input_ids, positions, block_table, slots, model.new_kv_pool(kv.num_blocks, kv.block_size))[0]


def _assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("preset", list(TRANSFORMERS_PRESETS))
def test_logits_match_transformers(preset, source, checkpoint_sources, report):
    path = checkpoint_sources[source][preset]
    ours, theirs = load_model(path), load_hf(path)
    ids = _prompt(45, seed=3)
    with torch.no_grad():
        expected = theirs(ids).logits[0]
    actual = _full_logits(ours, ids)
    _assert_logits_close(actual, expected, LOGITS_RTOL)
    worst = ((actual - expected).abs().max() / expected.abs().max()).item()
    report(f"fp32 logits vs transformers [{preset}/{source}]: max |diff| / max |logit| = {worst:.2e}")


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("preset", list(TRANSFORMERS_PRESETS))
def test_greedy_tokens_match_transformers_generate(preset, source, checkpoint_sources):
    path = checkpoint_sources[source][preset]
    ours, theirs = load_model(path), load_hf(path)
    expected = [hf_greedy(theirs, prompt, NEW_TOKENS) for prompt in PROMPTS]
    # All prompts in one batch on our side: batching must not change any sequence's tokens.
    actual = generate(ours, PROMPTS, NEW_TOKENS, kv=PagedKV(block_size=8, num_blocks=32), stop_at_eos=False)
    assert actual == expected


@pytest.mark.parametrize("preset", list(TRANSFORMERS_PRESETS))
def test_prefill_then_cached_decode_equals_full_forward(preset, tiny_checkpoints):
    """Teacher-forced: prefill 13 tokens, then feed the rest one by one through the cache."""
    model = load_model(tiny_checkpoints[preset])
    tokens = _prompt(40, seed=5)[0].tolist()
    full = _full_logits(model, torch.tensor([tokens]))
    pool = model.new_kv_pool(num_blocks=12, block_size=4)  # small blocks: many block boundaries
    seq = SequenceBlocks(block_size=4)
    seq.reserve(len(tokens), BlockAllocator(12))
    steps = [(0, 13)] + [(p, p + 1) for p in range(13, len(tokens))]
    pieces = []
    with torch.no_grad():
        for start, end in steps:
            ids, pos, table, slots, _ = step_metadata([(seq, tokens[start:end], start)], end - start, 12)
            pieces.append(model(ids, pos, table, slots, pool)[0])
    _assert_logits_close(torch.cat(pieces), full, 1e-5)


@pytest.mark.parametrize("preset", ["lora-groups", "direct-q-yarn", "v4"])
def test_chunked_prefill_equals_single_prefill(preset, tiny_checkpoints):
    model = load_model(tiny_checkpoints[preset])
    prompts = [_prompt(37, seed=9)[0].tolist()]
    whole = generate(model, prompts, 8, stop_at_eos=False)
    for chunk in (1, 5, 16):
        assert generate(model, prompts, 8, prefill_chunk=chunk, stop_at_eos=False) == whole
