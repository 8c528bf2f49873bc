"""Speculative decoding with the trained tiny checkpoint's MTP layer: greedy tokens are the tokens
without drafts (fp32, token for token) on export, inductor and 2 x 2 ranks, while most drafts are
accepted; sampled tokens are distributed as without drafts; the scheduler rolls rejected drafts
back and overlaps prompt chunks by one token."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
from tokenizers import Tokenizer

from graphc.artifacts.directory import read_manifest
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve
from graphc.runtime.scheduler import Scheduler
from graphc.sampling import Sampling
from support import SPARSE_V32

pytestmark = pytest.mark.compiles

PRESET = "trained"
TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass ", "    for i in range(",
         "        if self._closed:\n            raise ValueError('I/O operation on closed file')\n        return self."]
"""Prompts of 17, 28, 19 and 106 bytes: through prefill-8 / prefill-32 chunks (106: several chunks
and a tail), and short enough for prompt-as-decode rows (P = 4) once chunked."""


@pytest.fixture(scope="module")
def prompts(tiny_checkpoints) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(tiny_checkpoints[PRESET] / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


def _requests(prompts, new_tokens=40, sampling=Sampling()):
    return [Request(p, new_tokens, sampling, stop_at_eos=False) for p in prompts]


def _generate(artifacts, requests):
    """Tokens per request, and the drafts verified and accepted per draft position."""
    engine = Engine(artifacts)
    session = engine.session()
    indices = [session.scheduler.submit(r) for r in requests]
    while not session.idle:
        session.step()
    return [session.scheduler.results[i].output_ids for i in indices], session.scheduler.drafts


@pytest.fixture(scope="module")
def without_drafts(compiled, prompts):
    return _generate(compiled(PRESET, "export", "prompt_as_decode"), _requests(prompts))[0]


def test_greedy_tokens_are_the_tokens_without_drafts_and_most_drafts_are_accepted(compiled, prompts, without_drafts):
    artifacts = compiled(PRESET, "export", "prompt_as_decode", speculative=2)
    manifest = read_manifest(artifacts)
    assert manifest.buckets.draft_tokens == 2
    # Decode rows are [B, 1 + k] verify graphs; P = 4 is wider, so its graphs stay.
    assert {g.bucket.name for g in manifest.ranks[0].graphs} == {
        "prefill-8", "prefill-32", "decode-1x3", "decode-4x3", "decode-1x4", "decode-4x4"}
    assert manifest.model.cache_layers == 5  # 4 layers and the MTP layer's
    tokens, drafts = _generate(artifacts, _requests(prompts))
    assert tokens == without_drafts
    # Verify rows carried two drafts (one near a request's end); the trained MTP layer's first
    # draft is right most of the time, its second (drafted from its own output) less often.
    assert drafts.proposed[0] >= drafts.proposed[1] > 0
    assert drafts.accepted[0] > 0.7 * drafts.proposed[0] and 0 < drafts.accepted[1] < drafts.accepted[0]


@pytest.mark.slow
def test_v32_sparse_attention_gives_the_tokens_without_drafts(compiled):
    """DeepSeek-V3.2 under sparse attention (index_topk 16 below the context): its MTP layer has an
    indexer too, whose keys share the MTP layer's pool slots. Random weights: few drafts are
    accepted, so this holds the rejection path and the MTP layer's KV to the plain tokens."""
    requests = [Request([(7 * i + n) % 250 + 3 for i in range(n)], 24, stop_at_eos=False) for n in (5, 30, 40)]
    plain = Engine(compiled(SPARSE_V32, "export", "small")).generate(requests)
    tokens, drafts = _generate(compiled(SPARSE_V32, "export", "small", speculative=1), requests)
    assert tokens == [r.output_ids for r in plain] and drafts.proposed[0] > 0


V4_REQUESTS = [Request([(11 * i + n) % 250 + 3 for i in range(n)], 24, stop_at_eos=False) for n in (5, 19, 40)]
"""Past V4's sliding window (8) and many of its compressor windows (4 and 8), prompts chunked by prefill-8."""


def test_v4_gives_the_tokens_without_drafts(compiled):
    """DeepSeek-V4's MTP module (sliding-window attention over its own cache, mHC streams, its own
    stream head): random weights, so mostly the rejection path, held to the plain tokens."""
    plain = Engine(compiled("v4", "export", "small")).generate(V4_REQUESTS)
    tokens, drafts = _generate(compiled("v4", "export", "small", speculative=2), V4_REQUESTS)
    assert tokens == [r.output_ids for r in plain] and drafts.proposed[0] > drafts.proposed[1] > 0


V41_REQUESTS = [Request([(13 * i + n) % 240 + 3 for i in range(n)], 24, stop_at_eos=False) for n in (5, 19, 40)]
"""Past V4.1's sliding window (8), its compressors' windows and Engram's n-grams, chunked by prefill-8."""


def test_v41_drafting_with_dspark_gives_the_tokens_without_drafts(compiled):
    """DeepSeek-V4.1's DSpark stages draft a block a step (their context keys in their own pool
    layers, the block non-causal, the Markov head's bias token by token): random weights, so
    mostly the rejection path, held to the plain tokens; every draft position is verified."""
    plain = Engine(compiled("v41", "export", "small")).generate(V41_REQUESTS)
    artifacts = compiled("v41", "export", "small", speculative=3)
    assert read_manifest(artifacts).model.cache_layers == 2 * 6 + 1 + 3  # layers, Engram's ids, 3 stages
    tokens, drafts = _generate(artifacts, V41_REQUESTS)
    assert tokens == [r.output_ids for r in plain] and drafts.proposed[2] > 0


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("backend, cp, ep, tp", [("export", 2, 2, 1), ("export", 1, 2, 2), ("neuron", 2, 2, 1),
                                                  pytest.param("inductor", 2, 2, 1, marks=pytest.mark.inductor)])
def test_v41_drafting_over_ranks_gives_the_one_rank_tokens_without_drafts(compiled, backend, cp, ep, tp):
    """The stages' context keys sharded over cp (the block's own keys counted once), their
    experts over ep, their heads and shared expert over tp."""
    plain = Engine(compiled("v41", "export", "small")).generate(V41_REQUESTS)
    outcome = serve(compiled("v41", backend, "small", cp=cp, ep=ep, tp=tp, speculative=3), [V41_REQUESTS])[0]
    assert [r.output_ids for r in outcome.results] == [r.output_ids for r in plain]


@pytest.mark.slow
def test_v41_on_inductor_and_neuron_gives_the_tokens_without_drafts(compiled):
    plain = Engine(compiled("v41", "export", "small")).generate(V41_REQUESTS)
    for backend in ("inductor", "neuron"):
        tokens, _ = _generate(compiled("v41", backend, "small", speculative=2), V41_REQUESTS)
        assert tokens == [r.output_ids for r in plain], backend


@pytest.mark.multirank
@pytest.mark.slow
def test_v4_at_two_by_two_ranks_gives_the_one_rank_tokens_without_drafts(compiled):
    plain = Engine(compiled("v4", "export", "small")).generate(V4_REQUESTS)
    outcome = serve(compiled("v4", "export", "small", cp=2, ep=2, speculative=2), [V4_REQUESTS])[0]
    assert [r.output_ids for r in outcome.results] == [r.output_ids for r in plain]


@pytest.mark.slow
def test_v4_on_neuron_gives_the_tokens_without_drafts(compiled):
    plain = Engine(compiled("v4", "export", "small")).generate(V4_REQUESTS)
    tokens, _ = _generate(compiled("v4", "neuron", "small", speculative=1), V4_REQUESTS)
    assert tokens == [r.output_ids for r in plain]


@pytest.mark.slow
def test_v4_on_inductor_gives_the_tokens_without_drafts(compiled):
    plain = Engine(compiled("v4", "export", "small")).generate(V4_REQUESTS)
    tokens, _ = _generate(compiled("v4", "inductor", "small", speculative=1), V4_REQUESTS)
    assert tokens == [r.output_ids for r in plain]


def test_a_prompt_read_from_the_prefix_cache_gives_the_tokens_without_drafts(compiled, prompts, without_drafts):
    """The fourth prompt again: its second run reads the cached full blocks of 8 before its last
    token, the MTP layer's KV among them, and starts its chunk after them."""
    session = Engine(compiled(PRESET, "export", "prompt_as_decode", speculative=2)).session()
    results = []
    for _ in range(2):  # one after the other, in one session: its scheduler holds the cache
        index = session.scheduler.submit(_requests(prompts[3:])[0])
        while not session.idle:
            session.step()
        results.append(session.scheduler.results[index])
    first, second = results
    assert first.output_ids == second.output_ids == without_drafts[3]
    assert first.cached_tokens == 0 and second.cached_tokens == (len(prompts[3]) - 1) // 8 * 8 > 0


def _diverging_trials(prompts, trials: int) -> list[tuple[Request, Request]]:
    """Per trial a prefix of two blocks of 8 (a window of the prompts' text), a writer that
    continues it with the text's next token and a seeded sampled reader that continues it with
    another: the MTP layer's KV at the prefix's last position is computed from that token."""
    text = [t for p in prompts for t in p]
    pairs = []
    for t in range(trials):
        prefix, token = text[t:t + 16], text[t + 16]
        other = next(u for u in text[t + 17:] + text if u != token)
        pairs.append((Request(prefix + [token], 1, stop_at_eos=False),
                      Request(prefix + [other], 6, Sampling(temperature=1.0, seed=t), stop_at_eos=False)))
    return pairs


def _readers_tokens(artifacts, pairs) -> tuple[list[list[int]], list[int]]:
    """The readers' tokens and cached prompt tokens, each reader served after its writer, ten
    trials at a time (their 60 blocks fit the pool of 64: no writer's block is evicted first)."""
    session, results = Engine(artifacts).session(), []
    for group in range(0, len(pairs), 10):
        for batch in zip(*pairs[group:group + 10]):
            indices = [session.scheduler.submit(r) for r in batch]
            while not session.idle:
                session.step()
        results += [session.scheduler.results[i] for i in indices]
    return [r.output_ids for r in results], [r.cached_tokens for r in results]


@pytest.mark.parametrize("trials", [20, pytest.param(100, marks=pytest.mark.slow)])
def test_sampled_tokens_after_a_prefix_cached_by_another_continuation_are_those_without_caching(
        compiled, prompts, trials, monkeypatch):
    """Seeded sampling draws the same tokens with caching on and off: a reader never drafts from
    MTP KV that a writer's different next token decided (`graphc.runtime.prefix_cache`; reusing
    the writers' second blocks, 4 of the first 20 readers' tokens and 24 of 100 differed)."""
    artifacts = compiled(PRESET, "export", "prompt_as_decode", speculative=2)
    pairs = _diverging_trials(prompts, trials)
    cached, hits = _readers_tokens(artifacts, pairs)
    monkeypatch.setenv("GRAPHC_PREFIX_CACHING", "0")
    uncached, none = _readers_tokens(artifacts, pairs)
    assert cached == uncached
    assert set(hits) == {8} and set(none) == {0}  # each reader reads its writer's first block


@pytest.mark.multirank
def test_two_by_two_ranks_give_the_one_rank_tokens_without_drafts(compiled, prompts, without_drafts):
    """cp 2 x ep 2: the drafts ahead write their MTP KV into the rank's own KV shard."""
    outcome = serve(compiled(PRESET, "export", "prompt_as_decode_small", cp=2, ep=2, speculative=2),
                    [_requests(prompts)])[0]
    assert [r.output_ids for r in outcome.results] == without_drafts


@pytest.mark.multirank
def test_two_data_parallel_replicas_give_the_one_rank_tokens_without_drafts(compiled, prompts, without_drafts):
    """dp 2 x ep 2 (the all-to-all MoE): replica 1's leader returns each row's verdict to the leader."""
    outcome = serve(compiled(PRESET, "export", "dp", dp=2, ep=2, speculative=2), [_requests(prompts[:3], 20)])[0]
    assert [r.output_ids for r in outcome.results] == [t[:20] for t in without_drafts[:3]]
    assert {"decode-8x3", "decode-8x4"} <= set(outcome.stats)


def test_neuron_gives_the_tokens_without_drafts_and_the_sampled_tokens_of_export(compiled, prompts, without_drafts):
    """The neuron programs on XLA:CPU: greedy as without drafts; sampled (the verdict drawing from
    the `noise` input, position j's from seed + j) as the export backend's speculative steps."""
    artifacts = compiled(PRESET, "neuron", "prompt_as_decode_small", speculative=2)
    tokens, drafts = _generate(artifacts, _requests(prompts[:3]))
    assert tokens == without_drafts[:3] and drafts.accepted[0] > 0
    sampled = _requests(prompts[:3], 24, Sampling(temperature=0.8, top_p=0.95, seed=11))
    assert _generate(artifacts, sampled)[0] == _generate(compiled(PRESET, "export", "prompt_as_decode", speculative=2),
                                                         sampled)[0]


@pytest.mark.multirank
@pytest.mark.slow
def test_neuron_at_two_by_two_ranks_gives_the_tokens_without_drafts(compiled, prompts, without_drafts):
    outcome = serve(compiled(PRESET, "neuron", "prompt_as_decode_small", cp=2, ep=2, speculative=2),
                    [_requests(prompts[:3])])[0]
    assert [r.output_ids for r in outcome.results] == without_drafts[:3]


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_gives_the_tokens_without_drafts(compiled, prompts, without_drafts):
    """k = 1, in the fewest graphs (context 64: the first 20 tokens of the three shorter prompts)."""
    tokens, drafts = _generate(compiled(PRESET, "inductor", "small", speculative=1), _requests(prompts[:3], 20))
    assert tokens == [t[:20] for t in without_drafts[:3]] and drafts.accepted[0] > 0


def _chi_square_999(freedom: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1 % for 3+ degrees)."""
    a = 2 / (9 * freedom)
    return freedom * (1 - a + 3.0902 * math.sqrt(a)) ** 3


def test_sampled_tokens_are_distributed_as_without_drafts(compiled, prompts):
    """300 seeds of one prompt at temperature 1: the second and third tokens (the first the drafts
    can change) have the same distribution with drafts and without (a two-sample chi-square)."""
    requests = [Request(prompts[2][:4], 3, Sampling(temperature=1.0, seed=seed), stop_at_eos=False)
                for seed in range(300)]
    plain, _ = _generate(compiled(PRESET, "export", "prompt_as_decode"), requests)
    drafted, drafts = _generate(compiled(PRESET, "export", "prompt_as_decode", speculative=2), requests)
    assert drafts.accepted[0] > 0
    for position in (1, 2):
        a, b = Counter(t[position] for t in plain), Counter(t[position] for t in drafted)
        common = sorted(t for t in a.keys() | b.keys() if a[t] + b[t] >= 10)
        bins = [(a[t], b[t]) for t in common] + [(sum(a.values()) - sum(a[t] for t in common),
                                                   sum(b.values()) - sum(b[t] for t in common))]
        bins = [pair for pair in bins if sum(pair) > 0]
        statistic = sum((x - y) ** 2 / (x + y) for x, y in bins)  # equal sample sizes
        assert len(bins) > 3 and statistic < _chi_square_999(len(bins) - 1), (position, bins, statistic)


def _scheduler(**kwargs) -> Scheduler:
    return Scheduler([], prefill=[4], decode=[2], context_limit=32, block_size=4, num_blocks=16,
                     max_num_prefilling_tokens=4, eos_token_ids=[1], **kwargs)


def test_the_scheduler_overlaps_chunks_rolls_back_rejections_and_reserves_the_drafts_ahead():
    scheduler = _scheduler(draft_tokens=2)
    index = scheduler.submit(Request([10, 11, 12, 13, 14, 15], 5, stop_at_eos=False))
    # 6 + 5 - 1 positions of its life, 2 more for the drafts ahead of its last token: 3 blocks of 4.
    assert scheduler.blocks_needed(Request([10, 11, 12, 13, 14, 15], 5)) == [3]
    step = scheduler.next_step()
    assert [(run, start) for _, run, start in step.rows] == [([10, 11, 12, 13], 0)]
    scheduler.complete(step, [[0, 99, 0, 0, 0, 0]])
    step = scheduler.next_step()  # the chunk's last token runs again: its successor is known now
    assert [(run, start) for _, run, start in step.rows] == [([13, 14, 15], 3)]
    assert scheduler.complete(step, [[0, 20, 0, 0, 21, 22]])[0].token == 20
    step = scheduler.next_step()  # a verify row: the last token and its two drafts
    assert step.bucket.width == 3 and [(run, start) for _, run, start in step.rows] == [([20, 21, 22], 6)]
    emitted = scheduler.complete(step, [[1, 21, 30, 0, 31, 32]])  # 21 accepted, 22 rejected: 30 instead
    assert [e.token for e in emitted] == [21, 30]
    step = scheduler.next_step()  # from the first position after the accepted ones; 22's KV is overwritten
    assert [(run, start) for _, run, start in step.rows] == [([30, 31], 8)]  # one token left: one draft
    emitted = scheduler.complete(step, [[1, 31, 40, 0, 0, 0]])  # accepted: 31, then the model's 40, the fifth
    assert [e.token for e in emitted] == [31, 40] and emitted[1].result.output_ids == [20, 21, 30, 31, 40]
    assert scheduler.results[index].finish_reason == "length"
    assert scheduler.drafts.proposed == [2, 1] and scheduler.drafts.accepted == [2, 0]


def test_graphc_run_reports_the_drafts_accepted_per_position(compiled):
    from click.testing import CliRunner

    from graphc.cli import cli

    result = CliRunner().invoke(cli, ["run", str(compiled(PRESET, "export", "prompt_as_decode", speculative=2)),
                                      "--prompt", TEXTS[0], "--max-new-tokens", "30"])
    assert result.exit_code == 0, result.stderr
    accepted = re.search(r"^speculative decoding: drafts accepted (\d+)/(\d+) at 1, (\d+)/(\d+) at 2 \(draft position\)$",
                         result.stderr, re.M)
    first, proposed, second, _ = map(int, accepted.groups())
    assert 0 < second <= first <= proposed
