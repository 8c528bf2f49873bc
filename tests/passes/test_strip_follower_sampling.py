"""strip_follower_sampling: followers' graphs have no sampler but keep the logits (and with them
every collective); the leader's graph is untouched."""

from __future__ import annotations

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.passes.collective_schedule import program_collectives
from graphc.passes.manager import op_counts
from graphc.passes.strip_follower_sampling import strip_follower_sampling
from graphc.passes.verifier import verify
from support import captured, copy_program, run_program
from passes_support import context

BUCKET = Bucket("decode", 2)


def test_a_followers_sampler_becomes_zeros_and_its_logits_stay(tiny_checkpoints):
    model, program = captured(tiny_checkpoints["lora-groups"], BUCKET)
    before = copy_program(program)
    ctx = context(BUCKET, cp=2, ep=2, program="followers")

    result = strip_follower_sampling(program.graph_module, ctx)

    assert result.modified
    assert "graphc::sample" not in op_counts(result.graph_module)
    assert program_collectives(result.graph_module) == program_collectives(before.graph_module)
    verify(result.graph_module, ctx)
    (tokens, logits), pool = run_program(program, model, BUCKET)
    (tokens_before, logits_before), pool_before = run_program(before, model, BUCKET)
    assert torch.equal(tokens, torch.zeros_like(tokens_before)) and tokens.dtype == tokens_before.dtype
    assert torch.equal(logits, logits_before) and torch.equal(pool, pool_before)


@pytest.mark.parametrize("program", ["leader", "every-rank"])
def test_the_leaders_and_the_shared_graph_keep_their_sampler(tiny_checkpoints, program):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET)
    result = strip_follower_sampling(program.graph_module, context(BUCKET, cp=2, ep=2, program=program))
    assert not result.modified
    assert op_counts(result.graph_module)["graphc::sample"] == 1
