"""Prompt-as-decode: prompts (and long prompts' tails) of at most P tokens run through [B, P]
decode graphs, in the same step as running decodes, and give the tokens prefill gives (fp32),
at cp = 1, 2 and 4."""

from __future__ import annotations

import pytest

from graphc.artifacts.directory import read_manifest
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve

pytestmark = pytest.mark.compiles

PRESET = "lora-groups"
# 35 = 32 + a 3-token tail; 2 and 4 fit P = 4 whole; 9 takes prefill-32 (9 > P).
PROMPTS = [[(7 * i + n) % 250 + 3 for i in range(n)] for n in (35, 2, 4, 9)]


def _requests():
    return [Request(p, 10, stop_at_eos=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def through_prefill(compiled):
    return [r.output_ids for r in Engine(compiled(PRESET, "export", "standard")).generate(_requests())]


def test_the_graphs_exist_for_every_decode_batch(compiled):
    manifest = read_manifest(compiled(PRESET, "export", "prompt_as_decode"))
    graphs = {(g.kind, g.size, g.tokens_per_row) for g in manifest.ranks[0].graphs}
    assert graphs == {("prefill", 8, 1), ("prefill", 32, 1), ("decode", 1, 1), ("decode", 4, 1),
                      ("decode", 1, 4), ("decode", 4, 4)}
    assert manifest.buckets.prompt_as_decode == 4


def test_one_rank_gives_the_prefill_tokens_and_uses_the_prompt_as_decode_graphs(compiled, through_prefill):
    engine = Engine(compiled(PRESET, "export", "prompt_as_decode"))
    assert [r.output_ids for r in engine.generate(_requests())] == through_prefill
    # The two short prompts and the tail went through decode-4x4 with running decodes; nothing
    # else needed a prefill bucket but the 32-token chunk and the 9-token prompt.
    assert engine.stats["prefill-32"].steps == 2 and "prefill-8" not in engine.stats
    assert engine.stats["decode-4x4"].steps >= 1 and engine.stats["decode-4x4"].tokens >= 2 + 4 + 3


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_ranks_give_the_prefill_tokens(cp, compiled, through_prefill):
    # The fewest graphs that still hold a [B, P] step (compiles are most of a multi-rank test's time).
    [outcome] = serve(compiled(PRESET, "export", "prompt_as_decode_small", cp, 2), [_requests()])
    results = outcome.results
    assert [r.output_ids for r in results] == through_prefill
