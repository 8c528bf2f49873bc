"""The leader's scheduler, driven directly with made-up sampled tokens (no model, no graphs)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc.buckets.selection import Bucket, max_prefill_chunk, smallest_fitting
from graphc.runtime.scheduler import Request, Scheduler, Step
from graphc.sampling import SEED_STRIDE, Sampling, sampler_inputs

EOS = 2
DEFAULTS = dict(prefill=[4, 8, 16], decode=[1, 2, 4], context_limit=64, block_size=4, num_blocks=128,
                max_num_prefilling_tokens=16, eos_token_ids=[EOS])


def make(requests: list[Request], **overrides) -> Scheduler:
    return Scheduler(requests, **{**DEFAULTS, **overrides})


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def sampled(step: Step, token: int = 100) -> list[int]:
    """A non-EOS token per row, distinct per sequence so outputs can be traced."""
    return [token + s.index for s, _, _ in step.rows]


def run_to_end(scheduler: Scheduler, max_steps: int = 1000, token=sampled) -> list[Step]:
    steps = []
    while not scheduler.done:
        assert len(steps) < max_steps, "scheduler did not terminate"
        step = scheduler.next_step()
        steps.append(step)
        scheduler.complete(step, token(step))
    return steps


# --- prefill chunking ---------------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_front_to_back_in_chunks_and_only_the_last_yields_a_token():
    tokens = prompt(37)
    scheduler = make([Request(tokens, max_new_tokens=3)])
    assert scheduler.max_chunk == 16
    expected = [(0, 16, "prefill-16"), (16, 16, "prefill-16"), (32, 5, "prefill-8")]
    for i, (start, n, bucket) in enumerate(expected):
        step = scheduler.next_step()
        assert step.bucket.name == bucket
        assert step.bucket == Bucket("prefill", smallest_fitting([4, 8, 16], n))
        [(seq, run, first)] = step.rows
        assert (first, run) == (start, tokens[start:start + n])
        scheduler.complete(step, [500 + i])
        if i < len(expected) - 1:
            assert seq.output == [] and seq.prefilling  # a middle chunk's sample is discarded
        else:
            assert seq.output == [502] and not seq.prefilling
    # Then it decodes from the first generated token at the position after the prompt.
    step = scheduler.next_step()
    assert step.bucket.name == "decode-1"
    [(seq, run, first)] = step.rows
    assert (run, first) == ([502], 37)
    scheduler.complete(step, [600])
    step = scheduler.next_step()
    assert step.rows[0][1:] == ([600], 38)
    scheduler.complete(step, [601])
    assert scheduler.done
    assert scheduler.results[0].output_ids == [502, 600, 601]
    assert scheduler.results[0].finish_reason == "length"


@pytest.mark.parametrize("budget,chunks", [
    (10, [(8, "prefill-8"), (8, "prefill-8"), (4, "prefill-4")]),  # largest bucket within the budget
    (3, [(3, "prefill-4")] * 6 + [(2, "prefill-4")]),  # below every bucket: the budget, padded
    (100, [(16, "prefill-16"), (4, "prefill-4")]),  # above every bucket: the largest bucket
])
def test_max_num_prefilling_tokens_limits_the_chunk(budget, chunks):
    tokens = prompt(20)
    scheduler = make([Request(tokens, max_new_tokens=1)], max_num_prefilling_tokens=budget)
    assert scheduler.max_chunk == max_prefill_chunk([4, 8, 16], budget)
    start = 0
    for n, bucket in chunks:
        step = scheduler.next_step()
        [(_, run, first)] = step.rows
        assert (step.bucket.name, first, run) == (bucket, start, tokens[start:start + n])
        scheduler.complete(step, [100])
        start += n
    assert start == len(tokens)
    assert scheduler.done and scheduler.results[0].output_ids == [100]


# --- decode batching and rotation ---------------------------------------------------------------


def test_decode_batches_every_decoding_sequence_in_the_smallest_bucket_that_fits():
    requests = [Request(prompt(2, 10 * i), max_new_tokens=10) for i in range(1, 4)]
    scheduler = make(requests)
    expected = [("prefill-4", [0]), ("decode-1", [0]), ("prefill-4", [1]), ("decode-2", [0, 1]),
                ("prefill-4", [2]), ("decode-4", [0, 1, 2]), ("decode-4", [0, 1, 2])]
    for bucket, indices in expected:
        step = scheduler.next_step()
        assert step.bucket.name == bucket
        assert sorted(s.index for s, _, _ in step.rows) == indices
        assert len(step.rows) <= step.bucket.rows
        if step.bucket.kind == "decode":
            for seq, run, first in step.rows:
                assert run == [seq.output[-1]]  # the last sampled token is fed back
                assert first == len(seq.request.prompt) + len(seq.output) - 1
        scheduler.complete(step, sampled(step))


def test_more_decoding_sequences_than_the_largest_bucket_rotate_so_each_advances_in_turn():
    n = 7
    scheduler = make([Request([i + 3], max_new_tokens=50) for i in range(n)])
    # Run until every sequence has been prefilled.
    while len(scheduler.running) < n or any(s.prefilling for s in scheduler.running):
        step = scheduler.next_step()
        scheduler.complete(step, sampled(step))
    base = {s.index: len(s.output) for s in scheduler.running}
    for _ in range(12):
        step = scheduler.next_step()
        assert step.bucket == Bucket("decode", 4) and len(step.rows) == 4
        assert len({s.index for s, _, _ in step.rows}) == 4
        scheduler.complete(step, sampled(step))
        gained = [len(s.output) - base[s.index] for s in scheduler.running]
        # Round robin: nobody gets a second token before everyone has had a first one.
        assert max(gained) - min(gained) <= 1
    assert all(len(s.output) - base[s.index] >= 6 for s in scheduler.running)  # 12 * 4 / 7


def test_a_long_prompt_alternates_with_running_decodes_instead_of_stalling_them():
    short = [Request(prompt(2), max_new_tokens=40), Request(prompt(3), max_new_tokens=40)]
    long = Request(prompt(90), max_new_tokens=2)
    scheduler = make(short + [long], context_limit=128)
    kinds = []
    decoding_before = []
    while not scheduler.done:
        decoding_before.append(sum(not s.prefilling for s in scheduler.running))
        step = scheduler.next_step()
        kinds.append(step.bucket.kind)
        scheduler.complete(step, sampled(step))
    # While anything is decoding, never two prefill steps in a row.
    for i in range(1, len(kinds)):
        if kinds[i - 1] == kinds[i] == "prefill":
            assert decoding_before[i] == 0
    # The long prompt's 6 chunks (90 = 5 * 16 + 10) each sit between decode steps of the short ones.
    long_steps = [i for i, k in enumerate(kinds) if k == "prefill"][2:]
    assert len(long_steps) == 6
    assert all(kinds[i + 1] == "decode" for i in long_steps)
    assert scheduler.results[2].finish_reason == "length"


def test_prefill_steps_back_to_back_when_nothing_is_decoding():
    scheduler = make([Request(prompt(40), max_new_tokens=1), Request(prompt(40), max_new_tokens=1)])
    steps = run_to_end(scheduler)
    assert [s.bucket.name for s in steps] == ["prefill-16", "prefill-16", "prefill-8"] * 2


# --- finishing ----------------------------------------------------------------------------------


def yields_token(step: Step) -> bool:
    """Whether the step's (single) row produces a generated token: a decode or a last prefill chunk."""
    seq, run, first = step.rows[0]
    return step.bucket.kind == "decode" or first + len(run) == len(seq.request.prompt)


def drive(scheduler: Scheduler, tokens: list[int]) -> None:
    """Feed the single running sequence `tokens`, one per step that yields one (999 to middle chunks)."""
    feed = iter(tokens)
    while not scheduler.done:
        step = scheduler.next_step()
        scheduler.complete(step, [next(feed) if yields_token(step) else 999])


def test_eos_stops_a_sequence():
    scheduler = make([Request(prompt(5), max_new_tokens=10)], eos_token_ids=[EOS, 7])
    drive(scheduler, [5, 6, 7, 8, 9])
    result = scheduler.results[0]
    assert (result.output_ids, result.finish_reason, result.error) == ([5, 6, 7], "eos", None)


def test_eos_as_the_first_token_after_prefill_stops_at_once():
    scheduler = make([Request(prompt(20), max_new_tokens=10)])
    drive(scheduler, [EOS, 3])
    assert (scheduler.results[0].output_ids, scheduler.results[0].finish_reason) == ([EOS], "eos")


def test_eos_does_not_stop_a_sequence_with_stop_at_eos_false():
    scheduler = make([Request(prompt(5), max_new_tokens=4, stop_at_eos=False)])
    drive(scheduler, [EOS, 3, EOS, EOS, 9])
    assert (scheduler.results[0].output_ids, scheduler.results[0].finish_reason) == ([EOS, 3, EOS, EOS], "length")


def test_a_middle_chunks_sample_is_not_an_eos():
    scheduler = make([Request(prompt(20), max_new_tokens=2)])
    step = scheduler.next_step()
    scheduler.complete(step, [EOS])  # middle chunk: discarded, even if it happens to be EOS
    assert not scheduler.done and 0 not in scheduler.results
    drive(scheduler, [4, 5])
    assert scheduler.results[0].output_ids == [4, 5]


def test_length_stops_at_max_new_tokens():
    scheduler = make([Request(prompt(5), max_new_tokens=3)])
    drive(scheduler, [4, 5, 6, 7])
    assert (scheduler.results[0].output_ids, scheduler.results[0].finish_reason) == ([4, 5, 6], "length")


def test_max_new_tokens_1_finishes_at_the_end_of_prefill():
    scheduler = make([Request(prompt(5), max_new_tokens=1)])
    steps = run_to_end(scheduler)
    assert [s.bucket.kind for s in steps] == ["prefill"]
    assert (scheduler.results[0].output_ids, scheduler.results[0].finish_reason) == ([100], "length")


def test_context_limit_stops_when_prompt_plus_output_reaches_it():
    scheduler = make([Request(prompt(10), max_new_tokens=20)], context_limit=16)
    steps = run_to_end(scheduler)
    result = scheduler.results[0]
    assert (len(result.output_ids), result.finish_reason) == (6, "context_limit")
    # Nothing ever runs at a position >= context_limit, and every position has a reserved block.
    seq = steps[0].rows[0][0]
    assert len(seq.blocks.blocks) == 4  # 16 positions / block_size 4
    last = max(first + len(run) for step in steps for _, run, first in step.rows)
    assert last <= 15


def test_a_prompt_one_short_of_the_context_limit_yields_one_token():
    scheduler = make([Request(prompt(15), max_new_tokens=5)], context_limit=16)
    run_to_end(scheduler)
    assert (scheduler.results[0].output_ids, scheduler.results[0].finish_reason) == ([100], "context_limit")


# --- per-request errors -------------------------------------------------------------------------


@pytest.mark.parametrize("bad,message", [
    (Request([], max_new_tokens=4), "empty prompt: a request needs at least one token"),
    (Request(prompt(32), max_new_tokens=4),
     "prompt of 32 tokens leaves no room under context_limit 32; shorten it or compile with a larger context_limit"),
    (Request(prompt(40), max_new_tokens=4),
     "prompt of 40 tokens leaves no room under context_limit 32; shorten it or compile with a larger context_limit"),
    (Request(prompt(20), max_new_tokens=10),
     "needs 8 KV blocks but the pool has 6; raise kv_cache.num_blocks or GRAPHC_NUM_KV_BLOCKS"),
    (Request(prompt(4), max_new_tokens=0), "max_new_tokens is 0; it must be at least 1 (0 only to score a prompt)"),
    (Request(prompt(4), max_new_tokens=-2), "max_new_tokens is -2; it must be at least 1 (0 only to score a prompt)"),
])
def test_a_request_that_can_never_run_fails_alone_and_says_what_to_change(bad, message):
    good = [Request(prompt(3), max_new_tokens=2), Request(prompt(6), max_new_tokens=3)]
    scheduler = make([good[0], bad, good[1]], context_limit=32, num_blocks=6)
    # The error is known before any step runs.
    assert scheduler.results[1].finish_reason == "error"
    assert scheduler.results[1].error == message
    assert scheduler.results[1].output_ids == []
    assert scheduler.results[1].request is bad
    run_to_end(scheduler)
    assert sorted(scheduler.results) == [0, 1, 2]
    for i, request in ((0, good[0]), (2, good[1])):
        result = scheduler.results[i]
        assert result.request is request
        assert (result.finish_reason, result.error) == ("length", None)
        assert result.output_ids == [100 + i] * request.max_new_tokens
    assert scheduler.allocator.free_blocks == 6


def test_a_request_needing_exactly_the_whole_pool_is_served():
    scheduler = make([Request(prompt(20), max_new_tokens=4)], num_blocks=6)  # 24 positions = 6 blocks
    run_to_end(scheduler)
    assert scheduler.results[0].finish_reason == "length"
    assert scheduler.allocator.free_blocks == 6


# --- admission and blocks -----------------------------------------------------------------------


def test_admission_waits_for_free_blocks_and_reuses_the_released_ones():
    # Each request's lifetime is 6 + 10 - 1 = 15 cached positions = 4 blocks: the whole pool.
    a, b = Request(prompt(6), max_new_tokens=10), Request(prompt(6, 50), max_new_tokens=10)
    scheduler = make([a, b], num_blocks=4)
    step = scheduler.next_step()
    [(first, _, _)] = step.rows
    assert first.index == 0 and scheduler.allocator.free_blocks == 0
    blocks_of_a = list(first.blocks.blocks)
    assert sorted(blocks_of_a) == [0, 1, 2, 3]
    assert [i for i, _ in scheduler.waiting] == [1]
    scheduler.complete(step, sampled(step))
    while 0 not in scheduler.results:
        step = scheduler.next_step()
        assert [s.index for s, _, _ in step.rows] == [0]  # b is not admitted while a runs
        assert [s.index for s in scheduler.running] == [0]
        scheduler.complete(step, sampled(step))
    assert scheduler.allocator.free_blocks == 4
    step = scheduler.next_step()
    [(second, run, _)] = step.rows
    assert second.index == 1 and run == b.prompt
    assert second.blocks.blocks == blocks_of_a
    scheduler.complete(step, sampled(step))
    run_to_end(scheduler)
    assert scheduler.allocator.free_blocks == 4


def test_admission_is_fifo_even_when_a_later_request_would_fit():
    big, small = Request(prompt(6), max_new_tokens=10), Request(prompt(2), max_new_tokens=2)
    scheduler = make([big, big, small], num_blocks=5)  # one big (4 blocks) at a time; small needs 1
    step = scheduler.next_step()
    assert [s.index for s in scheduler.running] == [0]
    assert [i for i, _ in scheduler.waiting] == [1, 2]
    scheduler.complete(step, sampled(step))
    run_to_end(scheduler)
    assert [scheduler.results[i].finish_reason for i in range(3)] == ["length"] * 3


def test_all_blocks_return_results_are_keyed_by_request_index_and_done_is_set():
    requests = [Request(prompt(n), max_new_tokens=m) for n, m in [(3, 5), (30, 2), (1, 1), (17, 8)]]
    scheduler = make(requests, num_blocks=40)
    assert not scheduler.done
    run_to_end(scheduler)
    assert scheduler.done
    assert scheduler.allocator.free_blocks == 40
    assert sorted(scheduler.results) == [0, 1, 2, 3]
    for i, request in enumerate(requests):
        assert scheduler.results[i].request is request
        assert scheduler.results[i].output_ids == [100 + i] * request.max_new_tokens


# --- random mixes -------------------------------------------------------------------------------


# --- prompt-as-decode -----------------------------------------------------------------------------


def test_a_short_prompt_joins_the_running_decodes_in_one_step():
    scheduler = make([Request(prompt(10), max_new_tokens=5), Request(prompt(3, 50), max_new_tokens=5)],
                     prompt_as_decode=4)
    first = scheduler.next_step()
    assert first.bucket.name == "prefill-16" and first.rows[0][0].index == 0  # 10 > P: a prefill chunk
    scheduler.complete(first, sampled(first))
    step = scheduler.next_step()
    assert step.bucket == Bucket("decode", 2, 4) and step.bucket.name == "decode-2x4"
    assert [(s.index, run, start) for s, run, start in step.rows] == [(1, prompt(3, 50), 0), (0, [100], 10)]
    scheduler.complete(step, sampled(step))
    assert scheduler.next_step().bucket == Bucket("decode", 2)  # both decode now: plain decode
    run_to_end(scheduler)
    assert [len(scheduler.results[i].output_ids) for i in (0, 1)] == [5, 5]


def test_a_long_prompts_tail_runs_as_decode():
    scheduler = make([Request(prompt(37), max_new_tokens=2)], prompt_as_decode=8)
    steps = run_to_end(scheduler)
    assert [s.bucket.name for s in steps] == ["prefill-16", "prefill-16", "decode-1x8", "decode-1"]
    assert steps[2].rows[0][1:] == (prompt(37)[32:], 32)


def test_prompt_as_decode_1_runs_one_token_prompts_in_plain_decode_graphs():
    scheduler = make([Request(prompt(1), max_new_tokens=2)], prompt_as_decode=1)
    assert [s.bucket for s in run_to_end(scheduler)] == [Bucket("decode", 1), Bucket("decode", 1)]


@settings(max_examples=150, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 10), st.booleans()), min_size=1, max_size=8),
    prefill=st.lists(st.sampled_from([2, 4, 8, 16, 32]), min_size=1, max_size=3, unique=True),
    decode=st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=3, unique=True),
    block_size=st.sampled_from([1, 4, 16]),
    context_limit=st.integers(8, 72),
    pool_fraction=st.floats(0.2, 1.2),
    budget=st.integers(1, 40),
    eos_rate=st.sampled_from([0.0, 0.1, 0.5]),
    prompt_as_decode=st.sampled_from([0, 1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_random_request_mixes_terminate_and_keep_every_invariant(shapes, prefill, decode, block_size, context_limit,
                                                                pool_fraction, budget, eos_rate, prompt_as_decode,
                                                                seed):
    rng = random.Random(seed)
    requests = [Request([rng.randrange(3, 99) for _ in range(n)], max_new_tokens=m, stop_at_eos=stop)
                for n, m, stop in shapes]
    lifetimes = [-(-(min(n + m, context_limit) - 1) // block_size) for n, m, _ in shapes]
    num_blocks = max(1, round(sum(lifetimes) * pool_fraction))
    eos_ids = [EOS, 1]
    scheduler = Scheduler(requests, prefill=prefill, decode=decode, context_limit=context_limit,
                          block_size=block_size, num_blocks=num_blocks, max_num_prefilling_tokens=budget,
                          eos_token_ids=eos_ids, prompt_as_decode=prompt_as_decode)
    prefill, decode = sorted(prefill), sorted(decode)
    max_chunk = max_prefill_chunk(prefill, budget)
    bound = sum(-(-n // max_chunk) + m for n, m, _ in shapes)  # each step makes at least one unit of progress
    fed: dict[int, list[int]] = {}
    steps = 0
    while not scheduler.done:
        assert steps < bound, "scheduler did not terminate within the step bound"
        steps += 1
        step = scheduler.next_step()
        live = scheduler.running
        owned = [b for s in live for b in s.blocks.blocks]
        assert len(owned) == len(set(owned)), "a block is owned by two live sequences"
        assert all(0 <= b < num_blocks for b in owned)
        assert len(owned) + scheduler.allocator.free_blocks == num_blocks
        assert 1 <= len(step.rows) <= step.bucket.rows
        assert len({s.index for s, _, _ in step.rows}) == len(step.rows)
        if step.bucket.kind == "prefill":
            [(seq, run, first)] = step.rows
            assert 1 <= len(run) <= min(step.bucket.width, max_chunk)
            assert step.bucket.size == smallest_fitting(prefill, len(run))
            assert first == seq.prefilled and run == seq.request.prompt[first:first + len(run)]
        else:
            assert step.bucket.size == smallest_fitting(decode, len(step.rows))
            assert len(step.rows) <= decode[-1]
            prompt_rows = [seq for seq, _, _ in step.rows if seq.prefilling]
            assert step.bucket.tokens_per_row == (prompt_as_decode if prompt_rows else 1)
            assert all(s.remaining_prompt > prompt_as_decode for s in live if s.prefilling and s not in prompt_rows) or \
                len(step.rows) == decode[-1], "a short prompt was left out of a step with room for it"
            for seq, run, first in step.rows:
                if seq.prefilling:  # a prompt (or its tail) of at most P tokens, whole
                    assert first == seq.prefilled and run == seq.request.prompt[first:]
                    assert 1 <= len(run) <= prompt_as_decode
                else:
                    assert run == [seq.output[-1]] and first == len(seq.request.prompt) + len(seq.output) - 1
        for seq, run, first in step.rows:
            assert seq in live
            assert first + len(run) <= min(context_limit, len(seq.blocks.blocks) * block_size)
        tokens = [EOS if rng.random() < eos_rate else rng.randrange(3, 99) for _ in step.rows]
        for (seq, run, first), token in zip(step.rows, tokens):
            if step.bucket.kind == "decode" or first + len(run) == len(seq.request.prompt):
                fed.setdefault(seq.index, []).append(token)
        scheduler.complete(step, tokens)

    assert scheduler.allocator.free_blocks == num_blocks
    assert sorted(scheduler.results) == list(range(len(requests)))
    for i, (request, (n, m, stop)) in enumerate(zip(requests, shapes)):
        result = scheduler.results[i]
        assert result.request is request
        assert (result.finish_reason == "error") == (n >= context_limit or lifetimes[i] > num_blocks)
        if result.finish_reason == "error":
            assert result.output_ids == [] and result.error
            continue
        assert result.error is None
        out = result.output_ids
        assert out == fed[i]
        assert 1 <= len(out) <= m and n + len(out) <= context_limit
        if stop:
            assert all(t not in eos_ids for t in out[:-1])
        reason = {"eos": stop and out[-1] in eos_ids, "length": len(out) == m,
                  "context_limit": n + len(out) == context_limit}
        assert reason[result.finish_reason]
        assert next(r for r in ("eos", "length", "context_limit") if reason[r]) == result.finish_reason


# --- sampler inputs -----------------------------------------------------------------------------


def test_sampler_inputs_pad_with_greedy_rows_and_mix_seeds_with_the_step():
    params = [Sampling(temperature=0.7, top_k=5, top_p=0.9, seed=3), Sampling(temperature=1.0, seed=2**31)]
    inputs = sampler_inputs(params, [4, 17], rows=4)
    assert set(inputs) == {"temperature", "top_k", "top_p", "seed"}
    assert inputs["temperature"].dtype == inputs["top_p"].dtype == torch.float32
    assert inputs["top_k"].dtype == inputs["seed"].dtype == torch.int64
    assert all(t.shape == (4,) for t in inputs.values())
    assert inputs["temperature"].tolist() == pytest.approx([0.7, 1.0, 0.0, 0.0])
    assert inputs["top_k"].tolist() == [5, 0, 0, 0]
    assert inputs["top_p"].tolist() == pytest.approx([0.9, 1.0, 1.0, 1.0])
    assert inputs["seed"].tolist() == [3 * SEED_STRIDE + 4, 2**31 * SEED_STRIDE + 17, 0, 0]


def test_sampler_inputs_without_padding_and_distinct_seeds_per_step():
    inputs = sampler_inputs([Sampling(seed=5)] * 3, [0, 1, 2], rows=3)
    assert inputs["temperature"].tolist() == [0.0, 0.0, 0.0]  # the default is greedy
    assert inputs["seed"].tolist() == [5 * SEED_STRIDE, 5 * SEED_STRIDE + 1, 5 * SEED_STRIDE + 2]
    assert sampler_inputs([], [], rows=2)["seed"].tolist() == [0, 0]


@given(seed=st.integers(0, 2**20), steps=st.lists(st.integers(0, 4096), min_size=1, max_size=8), pad=st.integers(0, 4))
def test_sampler_inputs_seed_mixing(seed, steps, pad):
    inputs = sampler_inputs([Sampling(temperature=0.5, seed=seed)] * len(steps), steps, rows=len(steps) + pad)
    assert inputs["seed"].tolist() == [seed * SEED_STRIDE + s for s in steps] + [0] * pad
    assert inputs["temperature"].tolist() == [0.5] * len(steps) + [0.0] * pad


def test_time_to_first_token_is_recorded_in_the_order_first_tokens_came():
    scheduler = make([Request(prompt(20), 3), Request(prompt(5), 3), Request(prompt(70), 3)])
    came = []  # request indices in the order their first token was sampled
    while not scheduler.done:
        step = scheduler.next_step()
        scheduler.complete(step, sampled(step))
        came += [s.index for s, _, _ in step.rows if s.output and s.index not in came]
    results = [scheduler.results[i] for i in range(3)]
    assert results[2].finish_reason == "error" and results[2].first_token_seconds is None  # 70 >= context 64
    assert came == [0, 1]
    assert 0 <= results[0].first_token_seconds <= results[1].first_token_seconds


# --- arrivals, cancellation, min_new_tokens -----------------------------------------------------


def test_a_request_submitted_between_steps_joins_the_running_decodes():
    scheduler = make([Request(prompt(3), max_new_tokens=8)])
    scheduler.complete(scheduler.next_step(), [100])  # the first request's prefill
    late = scheduler.submit(Request(prompt(2, start=40), max_new_tokens=2))
    assert late == 1
    steps = run_to_end(scheduler)
    # The arrival is prefilled (alternating with the running decode) and then decodes beside it.
    assert any(len(step.rows) == 2 and step.bucket.kind == "decode" for step in steps)
    assert [len(scheduler.results[i].output_ids) for i in (0, 1)] == [8, 2]


def test_submitting_one_by_one_equals_the_batch():
    requests = [Request(prompt(n, start=10 * n), max_new_tokens=n) for n in (3, 17, 1, 9)]
    batch = make(requests)
    one_by_one = make([])
    assert [one_by_one.submit(r) for r in requests] == [0, 1, 2, 3]
    batch_steps, single_steps = run_to_end(batch), run_to_end(one_by_one)
    assert [s.bucket for s in batch_steps] == [s.bucket for s in single_steps]
    assert [(r.output_ids, r.finish_reason) for r in batch.results.values()] == [
        (r.output_ids, r.finish_reason) for r in one_by_one.results.values()]


def test_a_cancelled_request_frees_its_blocks_at_once_and_keeps_its_tokens():
    scheduler = make([Request(prompt(5), max_new_tokens=20), Request(prompt(4, start=30), max_new_tokens=20)],
                     num_blocks=16)
    while sum(bool(s.output) for s in scheduler.running) < 2:
        step = scheduler.next_step()
        scheduler.complete(step, sampled(step))
    held = scheduler.blocks_in_use
    assert held > 0
    result = scheduler.cancel(0)
    assert result.finish_reason == "cancelled" and result.output_ids and set(result.output_ids) == {100}
    assert scheduler.blocks_in_use < held and [s.index for s in scheduler.running] == [1]
    assert scheduler.cancel(0) is None  # already ended
    run_to_end(scheduler)
    assert scheduler.blocks_in_use == 0 and scheduler.results[1].finish_reason == "length"


def test_a_waiting_request_can_be_cancelled_before_admission():
    scheduler = make([Request(prompt(30), max_new_tokens=30), Request(prompt(30, start=50), max_new_tokens=30)],
                     num_blocks=16)  # 15 blocks each: the second waits
    scheduler.complete(scheduler.next_step(), [100])
    assert [i for i, _ in scheduler.waiting] == [1]
    assert scheduler.cancel(1).finish_reason == "cancelled"
    assert not scheduler.waiting and scheduler.results[1].output_ids == []


def test_eos_before_min_new_tokens_does_not_end_the_request():
    scheduler = make([Request(prompt(3), max_new_tokens=6, min_new_tokens=3)])
    run_to_end(scheduler, token=lambda step: [EOS] * len(step.rows))
    assert scheduler.results[0].output_ids == [EOS, EOS, EOS] and scheduler.results[0].finish_reason == "eos"


def test_complete_reports_each_generated_token_and_the_results_it_ended():
    scheduler = make([Request(prompt(3), max_new_tokens=2)])
    first = scheduler.complete(scheduler.next_step(), [7])
    second = scheduler.complete(scheduler.next_step(), [8])
    assert [(e.index, e.token, e.result) for e in first] == [(0, 7, None)]
    assert [(e.index, e.token) for e in second] == [(0, 8)] and second[0].result.output_ids == [7, 8]
