"""Compiled multi-rank graphs, served by `graphc.runtime.launch.serve` (one process per rank under
torchrun's agent, gloo collectives, the shared-memory step channel), give the single-rank tokens
(fp32), at every topology of the issue, on both CPU backends, with and without the static-MoE
rewrite. Every rank runs the bucket's one program with its own coordinates (its KV shard, its
experts); followers' sampler returns at once and they take each step from the leader."""

from __future__ import annotations

import pytest

from graphc.artifacts.directory import read_manifest
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve

pytestmark = [pytest.mark.multirank, pytest.mark.compiles]

TOPOLOGIES = [  # (cp, ep, static MoE); with ep = 1 the two MoE forms are the same graph. Per commit: 2
    # ranks in both MoE forms; 4 ranks and the other shapes are the slow tier's (the nightly full suite).
    pytest.param(2, 1, True, marks=pytest.mark.slow), (2, 2, True), (2, 2, False),
    *(pytest.param(cp, ep, static, marks=pytest.mark.slow)
      for cp, ep, static in ((4, 1, True), (4, 2, True), (4, 2, False), (4, 4, True), (4, 4, False))),
]
NEW_TOKENS = 12
# Compiles take most of the time, so one prefill bucket (8) and one decode bucket (2): prompts of
# 1, 9 and 40 tokens run in 1, 2 and 5 chunks (the longest spans 7 KV blocks of 8, on every CP
# shard), and three sequences decode in steps of 2 and a padded 1. Bucket choice itself is tested
# on one rank (test_serve_vs_transformers.py).
PROMPTS = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (1, 9, 40)]
EXPORT_CASE = ("wide-16e", "small", PROMPTS)  # 16 experts
INDUCTOR_CASE = ("lora-groups", "small", PROMPTS)


def _check_tokens(compiled, backend, case, cp, ep, static, new_tokens=NEW_TOKENS, tp=1):
    """The tokens of `backend`'s artifacts at the topology are those of one rank's export artifacts
    (fp32: every backend serves export's tokens, tested one rank at a time)."""
    preset, buckets, prompts = case
    requests = [Request(p, new_tokens, stop_at_eos=False) for p in prompts]
    expected = Engine(compiled(preset, "export", buckets)).generate(requests)
    [outcome] = serve(compiled(preset, backend, buckets, cp, ep, static, tp=tp), [requests])
    results = outcome.results
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]


@pytest.mark.parametrize("cp, ep, static", TOPOLOGIES)
def test_export_ranks_serve_the_single_rank_tokens(cp, ep, static, compiled):
    _check_tokens(compiled, "export", EXPORT_CASE, cp, ep, static)


# Export runs every topology; the inductor backend lowers the same ops, so the two MoE forms at
# two ranks cover every collective it must compile (the static form's all-reduce, the generic
# form's dispatch/combine; attention_combine in both). Each AOTInductor graph costs ~19 s of CPU
# (one program a bucket whatever the world, so a topology costs what one rank does). The GitHub
# sweep workflow runs the inductor backend at 2x1, 2x2, 4x2 and 4x4.
# Tensor parallelism (its all-reduces over tp, the gathered embedding and logits) in the slow tier:
# per commit it is served compiled on export (CI's sweep stage 1x1x2x2).
INDUCTOR_TOPOLOGIES = [(2, 2, True, 1), pytest.param(2, 2, False, 1, marks=pytest.mark.slow),
                       pytest.param(1, 2, True, 2, marks=pytest.mark.slow)]  # per commit: the static form


@pytest.mark.inductor
@pytest.mark.parametrize("cp, ep, static, tp", INDUCTOR_TOPOLOGIES)
def test_inductor_ranks_serve_the_single_rank_tokens(cp, ep, static, tp, compiled):
    _check_tokens(compiled, "inductor", INDUCTOR_CASE, cp, ep, static, tp=tp)


@pytest.mark.parametrize("cp, ep, static", [(2, 2, True), (2, 2, False), (4, 4, True),  # 4-4-True: plan's too
                                            pytest.param(4, 4, False, marks=pytest.mark.slow)])
def test_graph_structure_and_one_program_per_bucket(cp, ep, static, compiled):
    preset, buckets, _ = EXPORT_CASE
    manifest = read_manifest(compiled(preset, "export", buckets, cp, ep, static))
    counts = manifest.extra["op_counts"]
    moe_layers = 3  # wide-16e: first_k_dense_replace = 0
    for bucket in ("prefill-8", "decode-2"):
        ops = counts[bucket]
        assert ops["graphc::sample"] == 1  # returning at once on followers (their `samples` coordinate is 0)
        assert ops["graphc::attention_combine"] == 3  # one per layer, over the cp group
        if static:  # the static form: no dispatch, one all-reduce per MoE layer
            assert ops["graphc::all_reduce"] == moe_layers and "graphc::moe_dispatch" not in ops
        else:
            assert ops["graphc::moe_dispatch"] == ops["graphc::moe_combine"] == moe_layers
            assert "graphc::all_reduce" not in ops
    assert [r.samples for r in manifest.ranks] == [True] + [False] * (cp - 1)
    # One program a bucket whatever the world: every rank's entry names the same file.
    assert len(counts) == len(manifest.ranks[0].graphs)
    assert all([g.file for g in r.graphs] == [g.file for g in manifest.ranks[0].graphs] for r in manifest.ranks)
    assert [r.coordinates for r in manifest.ranks] == [[rank, rank % ep, int(rank == 0)] for rank in range(cp)]
    # Every rank holds different experts: different weight files.
    assert len({r.weights for r in manifest.ranks}) == cp


def test_single_rank_engine_refuses_multi_rank_artifacts(compiled):
    from graphc.errors import GraphcError

    with pytest.raises(GraphcError, match=r"compiled for 2 ranks \(dp=1, cp=2, tp=1, ep=2\); serve it with `graphc run`"):
        Engine(compiled(EXPORT_CASE[0], "export", EXPORT_CASE[1], 2, 2))


# DeepSeek-V4 (its windows, compressed entries and indexer cross the CP shards) at the issue's
# topologies on export (one prefill and one decode bucket: CI's sweep of examples/tiny-v4.yaml
# runs every bucket kind at 2x2), and at 2x2 on inductor in every bucket kind (prefill 32, decode
# 4, prompt-as-decode [4, 4]), against the single-rank export tokens. Static MoE only: the ag_rs
# exchange cannot carry the hash layers' token ids (refused at compile time).
V4_CASE = ("v4", "prompt_as_decode_small", PROMPTS)


@pytest.mark.parametrize("cp, ep", [pytest.param(2, 1, marks=pytest.mark.slow), (2, 2),
                                    pytest.param(4, 4, marks=pytest.mark.slow)])
def test_v4_export_ranks_serve_the_single_rank_tokens(cp, ep, compiled):
    _check_tokens(compiled, "export", ("v4", "small", PROMPTS), cp, ep, True)


@pytest.mark.inductor
@pytest.mark.slow
def test_v4_inductor_ranks_serve_the_single_rank_export_tokens(compiled):
    preset, buckets, prompts = V4_CASE
    requests = [Request(p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    expected = Engine(compiled(preset, "export", buckets)).generate(requests)
    [outcome] = serve(compiled(preset, "inductor", buckets, 2, 2, True), [requests])
    assert [r.output_ids for r in outcome.results] == [r.output_ids for r in expected]
