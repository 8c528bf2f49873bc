"""Data-parallel attention replicas with the all-to-all MoE, served from compiled artifacts on
real gloo ranks: the same tokens as one rank, whatever the lowering, the load or the skew."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from graphc.artifacts.directory import read_manifest
from graphc.errors import GraphcError
from graphc.runtime import Engine, Request
from graphc.runtime.launch import FAULT_ENV, open_engine, serve
from graphc.runtime.replicas import ReplicatedScheduler, scheduler_for
from multirank import channel_segments, run_ranks
from support import SKEWED

pytestmark = [pytest.mark.multirank, pytest.mark.compiles]

PRESET = "lora-groups"
# Long prompts (chunked over the 8-token prefill bucket), short ones (prompt-as-decode, P = 4):
# every bucket kind runs, in both replicas at once and in one alone.
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5], [6, 6, 6]]
NEW_TOKENS = 6


def _requests(prompts=PROMPTS, new_tokens=NEW_TOKENS):
    return [Request(p, new_tokens, stop_at_eos=False) for p in prompts]


def _artifacts(compiled, dp, cp, ep, lowering="auto", preset=PRESET):
    return compiled(preset, "export", "dp", cp, ep, True, dp, lowering)


@pytest.fixture(scope="module")
def one_rank(compiled):
    """Tokens of one rank's artifacts (same buckets) for a list of requests."""
    def tokens(requests, preset=PRESET):
        return [r.output_ids for r in Engine(compiled(preset, "export", "dp")).generate(requests)]
    return tokens


def _serve_on_ranks(rank, topology, artifacts, channel_name, requests):
    """One job's ranks in this harness (as `graphc run` starts them): the leader's tokens, every
    rank's step count, and whether the rank's KV pool is as it started."""
    engine = open_engine(str(artifacts), read_manifest(artifacts), rank, channel_name)
    before = engine.kv_pool.clone()
    try:
        if rank == 0:
            tokens = [r.output_ids for r in engine.generate(requests)]
            engine.stop_followers()
        else:
            tokens = None
            engine.follow()
        return tokens, engine.steps, torch.equal(before, engine.kv_pool)
    finally:
        engine.channel.close()


def _run(artifacts, requests):
    topology = read_manifest(artifacts).topology
    return run_ranks(topology, _serve_on_ranks, artifacts, f"graphc-test-{uuid.uuid4().hex[:8]}", requests)


# Every lowering at two ranks; auto (a2a_v for groups of 4) at four (two replicas of cp 2 per
# commit, four replicas in the slow tier). The other lowerings at four ranks are held to one rank
# in the eager model (ops/test_parallel_eager.py), where a job is a third of the price: four-rank
# jobs are most of this file's time.
@pytest.mark.parametrize("dp, cp, ep, lowering", [
    (2, 1, 2, "ag_rs"), (2, 1, 2, "a2a_even"), (2, 1, 2, "a2a_v"),
    pytest.param(4, 1, 4, "auto", marks=pytest.mark.slow), (2, 2, 4, "auto"),
])
def test_replicas_give_one_ranks_tokens_with_every_lowering(dp, cp, ep, lowering, compiled, one_rank):
    artifacts = _artifacts(compiled, dp, cp, ep, lowering)
    exchange = "a2a_v" if lowering == "auto" else lowering
    assert {g.moe_exchange for r in read_manifest(artifacts).ranks for g in r.graphs} == {exchange}
    results = _run(artifacts, _requests())
    assert results[0][0] == one_rank(_requests())
    assert len({steps for _, steps, _ in results}) == 1  # every rank ran every step


def test_uneven_replicas_and_an_idle_one(compiled, one_rank):
    """A long-lived request reserves more of replica 0's pool (6 blocks) than five short ones
    take of replica 1's (1 each): admission puts the five on replica 1, so the first decode steps
    run 1 and 5 rows in a bucket of 8. Then one request alone: replica 1 runs padding only, and
    its pool is untouched."""
    artifacts = _artifacts(compiled, 2, 1, 2, "a2a_v")
    uneven = [Request([4, 2, 4, 2], 44, stop_at_eos=False)] + _requests([[i, i + 1, i + 2] for i in range(5)], 5)
    scheduler = scheduler_for(read_manifest(artifacts), read_manifest(artifacts).kv_cache.num_blocks)
    assert isinstance(scheduler, ReplicatedScheduler)
    for request in uneven:
        scheduler.submit(request)
    assert [len(replica.waiting) for replica in scheduler.replicas] == [1, 5]
    [(tokens, _, _), _] = _run(artifacts, uneven)
    assert tokens == one_rank(uneven)

    alone = _requests(PROMPTS[:1])
    [(tokens, _, leader_pool_kept), (_, _, idle_pool_kept)] = _run(artifacts, alone)
    assert tokens == one_rank(alone)
    assert idle_pool_kept and not leader_pool_kept


def test_every_route_on_one_rank(compiled, one_rank):
    """The correction bias sends every token's experts to rank 0: its receive buffers fill with
    both replicas' tokens, rank 1's experts get none; tokens still equal one rank's."""
    artifacts = _artifacts(compiled, 2, 1, 2, "a2a_v", preset=SKEWED)
    assert _run(artifacts, _requests())[0][0] == one_rank(_requests(), preset=SKEWED)


def test_a_replica_leader_killed_mid_step_stops_the_job_naming_it(compiled, monkeypatch):
    """Rank 1 samples replica 1's rows and returns them to the leader, which waits on them."""
    artifacts = _artifacts(compiled, 2, 1, 2, "a2a_v")
    before = channel_segments()
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 SIGKILLs itself at its 4th step
    start = time.monotonic()
    with pytest.raises(GraphcError, match=r"rank 1 failed with exit code -9 \(signal 9\); the other ranks were stopped"):
        serve(artifacts, [_requests()])
    assert time.monotonic() - start < 30 + 20  # within 30 s of the death (plus start-up)
    assert channel_segments() <= before
