"""DeepSeek-V4.1's DSpark drafter (`models/deepseek_v41/dspark.py`) in graphc's speculative step
against the eager reference's (`reference.DeepseekV41Reference.draft`): the same drafts after a
prompt and after a verify step (the stages' context keys read past the sliding window from the
pool), as stored (FP8, FP4 experts) as dequantised, its config's errors, its released layout and
an expert shard's share of its experts."""

from __future__ import annotations

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import StepGraph
from graphc.errors import CheckpointError
from graphc.weights.checkpoint import check_checkpoint, load_model, load_reference
from graphc.models.registry import family_of
from graphc.models.speculation import SpeculativeStep
from graphc.models.step_model import Parallelism, StepInputs
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from support import run_step
from test_deepseek_v41 import args_with

STAGES, DRAFTS, BLOCK_SIZE = 3, 4, 4
PROMPT = [(29 * i + 5) % 240 + 3 for i in range(13)]  # past the sliding window (8)


class Drafting:
    """One sequence through graphc's eager speculative step (greedy) over a fresh pool."""

    def __init__(self, model):
        self.step_module, self.pool = SpeculativeStep(model, DRAFTS, family_of(model.args).drafter), model.new_kv_pool(12, BLOCK_SIZE)
        self.sequence = SequenceBlocks(BLOCK_SIZE)
        self.sequence.reserve(40, BlockAllocator(12))

    def run(self, tokens: list[int], start: int, logits_at: int) -> tuple[int, int, list[int]]:
        """-> the accepted count, the token after the accepted ones, the next drafts."""
        ids, positions, table, slots, _ = step_metadata([(self.sequence, tokens, start)], len(tokens), 10)
        step = StepInputs(positions, table, slots, self.pool, Parallelism())
        zero = torch.zeros(1, dtype=torch.int64)
        with torch.no_grad():
            out, _ = self.step_module(ids, step, torch.tensor([logits_at]), torch.zeros(1), zero, torch.ones(1), zero)
        accepted = int(out[0, 0])
        return accepted, int(out[0, 1 + accepted]), out[0, 2 + DRAFTS:].tolist()


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    path = tiny_checkpoints["v41"]
    return load_model(path, checked=check_checkpoint(path, STAGES)), load_reference(path, draft_layers=STAGES)


def test_drafts_are_the_references_after_a_prompt_and_after_a_verify_step(models):
    paged, reference = models
    drafting = Drafting(paged)
    _, token, drafts = drafting.run(PROMPT, 0, len(PROMPT) - 1)
    with torch.no_grad():
        expected_token = int(reference(torch.tensor([PROMPT]))[0, -1].argmax())
        assert (token, drafts) == (expected_token, reference.draft(torch.tensor([PROMPT]), token, DRAFTS))
        # The next step verifies [token, drafts]: whatever it accepts, its drafts continue the
        # sequence it keeps, from the stages' context keys the two steps wrote.
        row = [token, *drafts]
        accepted, following, drafts = drafting.run(row, len(PROMPT), 0)
        committed = torch.tensor([PROMPT + row[:1 + accepted]])
        assert following == int(reference(committed)[0, -1].argmax())
        assert drafts == reference.draft(committed, following, DRAFTS)


def test_the_stages_are_served_with_the_released_names_and_an_expert_shard_holds_its_share(models,
                                                                                           tiny_checkpoints):
    paged, _ = models
    stages = paged.model.mtp
    assert len(stages) == STAGES and hasattr(stages[0], "main_proj") and hasattr(stages[-1], "markov_head")
    assert not any(hasattr(stage, "markov_head") for stage in stages[:-1])
    assert tuple(stages[0].mlp.experts.gate_up_proj.shape[:1]) == (4,)  # dspark_n_routed_experts
    path = tiny_checkpoints["v41"]
    half = load_model(path, experts=range(4, 8), checked=check_checkpoint(path, STAGES))  # ep = 2, shard 1
    assert torch.equal(half.model.mtp[1].mlp.experts.down_proj, stages[1].mlp.experts.down_proj[2:])
    assert torch.equal(half.model.layers[0].mlp.experts.down_proj, paged.model.layers[0].mlp.experts.down_proj[4:])


def test_a_speculative_step_with_the_stages_as_stored_equals_dequantising_on_load(fp8_checkpoints):
    """The release's layout: the stages' projections FP8 (32 x 32 e8m0 blocks), their experts FP4,
    kept so in the step graph and dequantised next to their use: the same verdict, drafts, logits
    and pool as with every weight dequantised on load."""
    path = fp8_checkpoints["v41"]
    as_stored = load_model(path, as_stored=True, checked=check_checkpoint(path, STAGES))
    plain = load_model(path, checked=check_checkpoint(path, STAGES))
    kept = as_stored.quantized_weights
    assert kept["model.mtp.0.attn.wq_a.weight"].block == (32, 32) and "model.mtp.2.mlp.experts.down_proj" in kept
    for bucket in (Bucket("prefill", 8), Bucket("decode", 2, 1 + DRAFTS)):
        (out, logits), pool = run_step(StepGraph(as_stored, draft_tokens=DRAFTS), as_stored, bucket, seed=3)
        (out_plain, logits_plain), pool_plain = run_step(StepGraph(plain, draft_tokens=DRAFTS), plain, bucket, seed=3)
        assert torch.equal(out, out_plain) and torch.equal(logits, logits_plain) and torch.equal(pool, pool_plain)


@pytest.mark.parametrize("changes, message", [
    ({"dspark_target_layer_ids": [3, 9]}, r"dspark_target_layer_ids \[3, 9\] must be layers of 0\.\.5"),
    ({"dspark_noise_token_id": 256}, r"dspark_noise_token_id 256 is not a token id of 0\.\.255"),
    ({"dspark_n_routed_experts": 3}, r"dspark_n_routed_experts \(3\) must divide n_routed_experts \(8\)"),
    ({"dspark_num_experts_per_tok": 5}, r"dspark_num_experts_per_tok \(5\) must be <= dspark_n_routed_experts"),
    ({"dspark_markov_rank": None}, r"dspark_block_size is set but text_config lacks dspark_markov_rank"),
    ({"num_nextn_predict_layers": 0}, r"num_nextn_predict_layers \(the DSpark stages\) is 0"),
])
def test_dspark_config_errors_name_the_field(changes, message):
    with pytest.raises(CheckpointError, match=message):
        args_with(**changes)
