"""Prefix caching through compiled artifacts: the engine on one rank, and multi-rank jobs (CP and
EP shards, data-parallel replicas with cache-aware routing), fp32 tokens with caching on equal
tokens with it off (GRAPHC_PREFIX_CACHING=0: the same artifacts on one rank; the multi-rank jobs'
tokens against one rank's with caching off, as multi-rank serving is held to one rank elsewhere). Prompts arrive one after
another, each once the one before has ended, so each can reuse what the earlier ones cached."""

from __future__ import annotations

import os
import uuid

import pytest

from graphc.artifacts.directory import read_manifest
from graphc.runtime import Engine, Request
from graphc.runtime.launch import open_engine
from multirank import run_ranks
from support import SPARSE_V32, serve_arrivals

pytestmark = [pytest.mark.compiles]

BASE = [(13 * i) % 200 + 5 for i in range(32)]
OTHER = [(7 * i + 3) % 200 + 5 for i in range(32)]
# (prompt, the tokens its cached blocks hold) with blocks of 8 (the test artifacts' block size).
PROMPTS = [
    (BASE[:21], 0),
    (BASE[:21] + [9, 11], 16),   # many blocks (all it can: 22 // 8 full blocks before its last token)
    (BASE[:8] + OTHER[:5], 8),   # one block
    (OTHER[:11], 0),             # none: OTHER's tokens after another prefix are other blocks
    (BASE[:24], 16),             # ends on a block boundary: all but its last block
    (BASE[:16], 8),
]
NEW_TOKENS, SPACING = 4, 16


def _arrivals(prompts=PROMPTS):
    return [(SPACING * i, Request(prompt, NEW_TOKENS, stop_at_eos=False)) for i, (prompt, _) in enumerate(prompts)]


def _on_one_rank(artifacts, caching: bool, monkeypatch, arrivals=None):
    monkeypatch.setenv("GRAPHC_PREFIX_CACHING", "1" if caching else "0")
    engine = Engine(artifacts)
    return serve_arrivals(engine.session().scheduler, arrivals or _arrivals(), engine.run_step)


@pytest.mark.parametrize("preset", ["lora-groups", SPARSE_V32, "v4", "v41"])
def test_one_rank_reuses_cached_prefixes_with_caching_offs_tokens(preset, compiled, monkeypatch):
    artifacts = compiled(preset, "export", "small")
    on, off = _on_one_rank(artifacts, True, monkeypatch), _on_one_rank(artifacts, False, monkeypatch)
    assert [r.cached_tokens for r in on] == [cached for _, cached in PROMPTS]
    assert [r.cached_tokens for r in off] == [0] * len(PROMPTS)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]


def _serve_arrivals_on_ranks(rank, topology, artifacts, channel_name, caching, arrivals):
    """A job's ranks (as `graphc run` starts them): the leader serves the arrivals; its results'
    tokens and cached-token counts."""
    os.environ["GRAPHC_PREFIX_CACHING"] = "1" if caching else "0"
    engine = open_engine(str(artifacts), read_manifest(artifacts), rank, channel_name)
    try:
        if rank != 0:
            engine.follow()
            return None
        results = serve_arrivals(engine.session().scheduler, arrivals, engine.run_step)
        engine.stop_followers()
        return [(r.output_ids, r.cached_tokens) for r in results]
    finally:
        engine.channel.close()


def _on_ranks(artifacts, caching: bool, arrivals=None):
    topology = read_manifest(artifacts).topology
    return run_ranks(topology, _serve_arrivals_on_ranks, artifacts, f"graphc-test-{uuid.uuid4().hex[:8]}",
                     caching, arrivals or _arrivals())[0]


# Two families per commit (V3's latent cache, and V4's windows and compressor states, which cross
# the CP shards); V3.2's indexer keys and V4.1's Engram ids at 2x2 in the slow tier (each family's
# cache at a block boundary is held to caching off on one rank per commit, above).
@pytest.mark.multirank
@pytest.mark.parametrize("preset", ["lora-groups", "v4", pytest.param(SPARSE_V32, marks=pytest.mark.slow),
                                    pytest.param("v41", marks=pytest.mark.slow)])
def test_cp_and_ep_ranks_reuse_cached_prefixes_with_caching_offs_tokens(preset, compiled, monkeypatch):
    on = _on_ranks(compiled(preset, "export", "small", 2, 2), True)
    off = _on_one_rank(compiled(preset, "export", "small"), False, monkeypatch)
    assert [cached for _, cached in on] == [cached for _, cached in PROMPTS]
    assert [tokens for tokens, _ in on] == [r.output_ids for r in off]


@pytest.mark.multirank
def test_data_parallel_replicas_route_to_the_cached_prefix_with_caching_offs_tokens(compiled, monkeypatch):
    # Replica 0 takes an unrelated prompt first and the first of PROMPTS goes to replica 1: the
    # rest, all on equally roomy replicas, would go to replica 0 but for their cached prefixes.
    arrivals = [(0, Request(OTHER[16:30], NEW_TOKENS, stop_at_eos=False)), *_arrivals()]
    on = _on_ranks(compiled("lora-groups", "export", "dp", 1, 2, True, 2, "a2a_v"), True, arrivals)
    off = _on_one_rank(compiled("lora-groups", "export", "dp"), False, monkeypatch, arrivals)
    assert [cached for _, cached in on] == [0, *(cached for _, cached in PROMPTS)]
    assert [tokens for tokens, _ in on] == [r.output_ids for r in off]
