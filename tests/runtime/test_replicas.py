"""The leader's scheduler over data-parallel replicas, driven directly with made-up tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphc.runtime.replicas import ReplicatedScheduler
from graphc.runtime.scheduler import Request, Scheduler

DEFAULTS = dict(prefill=[4, 8], decode=[2, 4], context_limit=48, block_size=4, num_blocks=24,
                max_num_prefilling_tokens=8, eos_token_ids=[2], prompt_as_decode=3)


def replicated(dp: int, **overrides) -> ReplicatedScheduler:
    return ReplicatedScheduler([Scheduler([], **{**DEFAULTS, **overrides}) for _ in range(dp)])


def test_requests_go_to_the_replica_with_the_most_free_blocks():
    scheduler = replicated(2)
    big = scheduler.submit(Request(list(range(10, 20)), 30, stop_at_eos=False))  # 39 positions: 10 blocks
    small = [scheduler.submit(Request([5, 6, 7], 2, stop_at_eos=False)) for _ in range(4)]  # 1 block each
    assert [[i for i, _ in r.waiting] for r in scheduler.replicas] == [[big], small]


def test_a_prefill_step_runs_every_replicas_long_chunk_and_leaves_the_others_padding():
    scheduler = replicated(3)
    for prompt in ([1] * 10, [3] * 6, [4]):  # long, long, short: one per replica
        scheduler.submit(Request(prompt, 4, stop_at_eos=False))
    step = scheduler.next_step()
    assert step.bucket.kind == "prefill" and step.bucket.size == 8  # holds the longest chunk (8 of 10)
    assert [len(rows) for rows in step.by_replica()] == [1, 1, 0]
    assert [len(tokens) for _, tokens, _ in step.rows] == [8, 6]
    scheduler.complete(step, [100, 101])
    step = scheduler.next_step()  # alternation: a decode step next, P tokens per row for the short ones
    assert (step.bucket.kind, step.bucket.tokens_per_row) == ("decode", 3)
    # replica 0's prompt tail (2 tokens), replica 1's first decode, replica 2's short prompt
    assert [tokens for _, tokens, _ in step.rows] == [[1, 1], [101], [4]]


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 4), arrivals=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 30), st.integers(1, 12)),
                                               min_size=1, max_size=14),
       eos_every=st.integers(3, 9))
def test_every_step_is_one_bucket_every_replica_fits_and_every_request_finishes(dp, arrivals, eos_every):
    """Requests arrive between steps (arrival step, prompt length, new tokens); sampled tokens hit
    EOS now and then. Every step one bucket, each replica's rows in it; steps stop only when
    every replica is idle, never while one has work; every request ends."""
    scheduler = replicated(dp)
    submitted, steps = [], 0
    pending = sorted(arrivals)
    while pending or not scheduler.done:
        while pending and pending[0][0] <= steps:
            _, length, new = pending.pop(0)
            submitted.append(scheduler.submit(Request([(7 * length + i) % 50 + 3 for i in range(length)], new)))
        if scheduler.done:  # all idle: the leader runs nothing until a request comes
            steps = pending[0][0]
            continue
        step = scheduler.next_step()
        replicas = step.by_replica()
        assert len(replicas) == dp and sum(map(len, replicas)) == len(step.rows) > 0
        for rows in replicas:
            assert len(rows) <= step.bucket.rows
            assert all(0 < len(tokens) <= step.bucket.width for _, tokens, _ in rows)
            assert len({s.index for s, _, _ in rows}) == len(rows)
        assert step.bucket.size in (DEFAULTS["prefill"] if step.bucket.kind == "prefill" else DEFAULTS["decode"])
        scheduler.complete(step, [2 if (steps + i) % eos_every == 0 else 40 for i in range(len(step.rows))])
        steps += 1
        assert steps < 2000, "the scheduler did not terminate"
    assert sorted(scheduler.results) == sorted(submitted)
    assert all(r.finish_reason in ("eos", "length", "context_limit") for r in scheduler.results.values())
    assert scheduler.blocks_in_use == 0
