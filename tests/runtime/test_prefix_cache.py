"""Prefix caching in the scheduler, against a simulated pool (no model, no graphs).

The simulated pool stores, at each slot a step writes, what decides a real model's KV there: the
sequence's tokens up to and including that position. Before each row runs, every position before
its first token must hold exactly that, whichever request wrote it; the fake sampler's token is a
function of the same, so a wrong reuse also changes the tokens.
"""

from __future__ import annotations

import functools
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc.errors import GraphcError
from graphc.runtime.paged import BlockAllocator
from graphc.runtime.prefix_cache import block_key, prefix_caching_enabled, root_key
from graphc.runtime.replicas import ReplicatedScheduler
from graphc.runtime.scheduler import Request, Scheduler
from support import serve_arrivals

BLOCK = 4
SALT = ("fingerprint", "float32")
DEFAULTS = dict(prefill=[4, 8], decode=[1, 2, 4], context_limit=48, block_size=BLOCK, num_blocks=64,
                max_num_prefilling_tokens=8, eos_token_ids=[0], prefix_cache_salt=SALT)


def make(**overrides) -> Scheduler:
    return Scheduler([], **{**DEFAULTS, **overrides})


class SimulatedPool:
    """Every replica's and shard's slots, holding the token history that decides each one's KV."""

    def __init__(self):
        self.slots: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def run(self, step) -> list[int]:
        tokens = []
        for replica, rows in enumerate(step.by_replica()):
            for sequence, run, start in rows:
                history = [*sequence.request.prompt, *sequence.output][:start] + run
                blocks = sequence.blocks
                for position in range(start):  # what this row's attention reads
                    assert self.slots.get(self._slot(replica, blocks, position)) == tuple(history[:position + 1]), \
                        f"request {sequence.index} reads a wrong KV vector at position {position}"
                for position in range(start, start + len(run)):
                    self.slots[self._slot(replica, blocks, position)] = tuple(history[:position + 1])
                digest = hashlib.sha256(repr(history).encode()).digest()
                tokens.append(1 + digest[0] % 7)  # never EOS; few values, so generated blocks repeat too
        return tokens

    @staticmethod
    def _slot(replica: int, blocks, position: int) -> tuple[int, int, int]:
        shard = position // BLOCK % blocks.num_shards
        return replica, shard, blocks.slot(position, shard)


def serve(scheduler, arrivals: list[tuple[int, Request]], pool: SimulatedPool | None = None):
    """`arrivals` served on `pool` (pass one to keep the scheduler's across calls)."""
    return serve_arrivals(scheduler, arrivals, (pool or SimulatedPool()).run)


# --- keys ---------------------------------------------------------------------------------------


def test_a_blocks_key_depends_on_every_token_before_it_and_on_the_salt():
    root = root_key(*SALT, str(BLOCK))
    first = block_key(root, [1, 2, 3, 4])
    assert block_key(first, [5, 6, 7, 8]) != block_key(block_key(root, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert block_key(root_key("other fingerprint", "float32", "4"), [1, 2, 3, 4]) != first
    assert block_key(root_key(*SALT, "8"), [1, 2, 3, 4]) != first
    assert block_key(root, [1, 2, 3, 4]) == first


# --- reuse --------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, cached", [(5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (4, 0), (1, 0)])
def test_a_repeated_prompt_reuses_its_full_blocks_but_always_computes_its_last_token(length, cached):
    prompt = list(range(10, 10 + length))
    first, second = serve(make(), [(0, Request(prompt, 3)), (50, Request(prompt, 3))])
    assert (first.cached_tokens, second.cached_tokens) == (0, cached)
    assert second.output_ids == first.output_ids


def test_blocks_written_by_generated_tokens_are_reused_by_a_prompt_that_continues_the_conversation():
    scheduler, pool = make(), SimulatedPool()
    first, = serve(scheduler, [(0, Request([5, 6, 7, 8, 9, 10], 12))], pool)
    conversation = [5, 6, 7, 8, 9, 10, *first.output_ids, 3]  # 19 tokens: 4 full blocks written
    second, = serve(scheduler, [(0, Request(conversation, 2))], pool)
    assert second.cached_tokens == 16
    assert scheduler.prefix_cache_tokens == (6 + 19, 16)


def test_caching_off_reuses_nothing_and_gives_the_same_tokens():
    prompt = list(range(10, 30))
    off = serve(make(prefix_cache_salt=None), [(0, Request(prompt, 3)), (60, Request(prompt, 3))])
    on = serve(make(), [(0, Request(prompt, 3)), (60, Request(prompt, 3))])
    assert [r.cached_tokens for r in off] == [0, 0] and [r.cached_tokens for r in on] == [0, 16]
    assert [r.output_ids for r in off] == [r.output_ids for r in on]


def test_requests_share_cached_blocks_only_with_requests_of_the_same_salt():
    """Salts None, "a", "b": each computes the prompt once and then reuses only its own blocks,
    also those of generated tokens (a conversation's next turn)."""
    prompt, scheduler, pool = list(range(10, 27)), make(), SimulatedPool()  # 16 cached positions a salt
    first = serve(scheduler, [(0, Request(prompt, 5, cache_salt=salt)) for salt in (None, "a", "b")], pool)
    assert [r.cached_tokens for r in first] == [0, 0, 0]
    assert scheduler.cached_blocks == 3 * 5  # 21 written positions: 5 blocks, published once a salt
    again = serve(scheduler, [(0, Request(prompt + first[0].output_ids, 2, cache_salt=salt))
                              for salt in ("b", "a", None, "c")], pool)
    assert [r.output_ids for r in first] == [first[0].output_ids] * 3  # the same history: the same tokens
    assert [r.cached_tokens for r in again] == [20, 20, 20, 0]  # each salt its own 5 blocks; "c" none
    assert scheduler.cached_blocks == 3 * 5 + 5  # only the new salt "c" published its own copy


def test_a_salted_request_goes_to_the_replica_holding_its_own_salts_prefix():
    prompt = list(range(10, 30))
    scheduler, pool = ReplicatedScheduler([make(num_blocks=16), make(num_blocks=16)]), SimulatedPool()
    serve(scheduler, [(0, Request(list(range(60, 70)), 2)), (0, Request(prompt, 2, cache_salt="s"))], pool)
    other, same = serve(scheduler, [(0, Request(prompt + [3], 2, cache_salt="t")),
                                    (1, Request(prompt + [3], 2, cache_salt="s"))], pool)
    assert (other.cached_tokens, same.cached_tokens) == (0, 20)
    assert [r.prefix_cache_tokens[1] for r in scheduler.replicas] == [0, 20]


def test_a_request_admitted_while_its_prefix_is_computed_elsewhere_computes_it_too_and_caches_one_copy():
    prompt = list(range(10, 26))
    scheduler = make()
    results = serve(scheduler, [(0, Request(prompt, 2)), (0, Request(prompt, 2))])
    assert [r.cached_tokens for r in results] == [0, 0]
    assert results[0].output_ids == results[1].output_ids
    assert scheduler.cached_blocks == 4  # 17 written positions: blocks 0-3, published once each


def test_blocks_in_use_return_to_zero_and_stay_cached_after_every_request_ends():
    scheduler = make()
    serve(scheduler, [(0, Request(list(range(10, 31)), 4)), (2, Request(list(range(40, 50)), 4))])
    assert scheduler.blocks_in_use == 0
    assert scheduler.cached_blocks == 24 // BLOCK + 13 // BLOCK  # every full written block
    assert scheduler.allocator.free_blocks == scheduler.allocator.num_blocks  # idle cached blocks are free


# --- eviction -----------------------------------------------------------------------------------


def test_a_long_run_of_unique_prompts_on_a_pool_of_a_few_blocks_evicts_instead_of_failing():
    scheduler = make(num_blocks=6)
    arrivals = [(i, Request([100 + i, *range(10, 19)], 3)) for i in range(40)]  # 11 positions: 3 blocks each
    results = serve(scheduler, arrivals)
    assert {r.finish_reason for r in results} == {"length"}
    assert scheduler.blocks_in_use == 0 and scheduler.cached_blocks <= 6


def test_a_request_never_waits_while_idle_cached_blocks_could_be_evicted():
    scheduler = make(num_blocks=4)
    serve(scheduler, [(0, Request(list(range(10, 26)), 1))], SimulatedPool())  # 16 positions: 4 blocks cached
    assert scheduler.cached_blocks == 4 and scheduler.allocator.free_blocks == 4
    scheduler.submit(Request(list(range(50, 63)), 3))  # 15 positions: needs all 4 blocks, none shared
    step = scheduler.next_step()
    assert [s.index for s, _, _ in step.rows] == [1]
    assert scheduler.cached_blocks == 0  # evicted, least recently used first


def test_eviction_takes_the_least_recently_used_idle_block():
    allocator = BlockAllocator(3)
    a, b, c = allocator.allocate(3)
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        allocator.publish(block, key)
    allocator.release([b])
    allocator.release([a])
    allocator.release([c])
    allocator.hold(allocator.lookup(b"b"))  # b is in use again: not evictable
    assert allocator.allocate(1) == [a]
    assert allocator.lookup(b"a") is None and allocator.lookup(b"b") == b and allocator.free_blocks == 1


def test_a_shared_block_is_evictable_only_once_its_last_holder_ends():
    allocator = BlockAllocator(1)
    [block] = allocator.allocate(1)
    allocator.publish(block, b"k")
    allocator.hold(block)
    allocator.release([block])
    assert allocator.free_blocks == 0 and not allocator.is_idle(block)
    allocator.release([block])
    assert allocator.free_blocks == 1 and allocator.is_idle(block)


# --- every prefix structure and arrival order -----------------------------------------------------


@st.composite
def traffic(draw):
    """Prompts drawn from two base sequences (sharing 0 to all of a base, then a suffix), ending
    inside blocks and on their boundaries, arriving at drawn steps."""
    bases = [draw(st.lists(st.integers(1, 5), min_size=20, max_size=20)) for _ in range(2)]
    arrivals = []
    for _ in range(draw(st.integers(2, 7))):
        base, shared = draw(st.sampled_from(bases)), draw(st.integers(0, 20))
        suffix = draw(st.lists(st.integers(1, 5), min_size=0 if shared else 1, max_size=6))
        arrivals.append((draw(st.integers(0, 30)), Request(base[:shared] + suffix, draw(st.integers(1, 6)))))
    return arrivals


@settings(max_examples=60, deadline=None)
@given(traffic(), st.sampled_from([1, 2]), st.sampled_from([8, 14, 64]), st.sampled_from([0, 4]))
def test_every_read_is_of_the_right_tokens_and_the_tokens_equal_caching_off(arrivals, shards, blocks, as_decode):
    options = dict(kv_shards=shards, num_blocks=blocks, prompt_as_decode=as_decode)
    on, off = make(**options), make(**options, prefix_cache_salt=None)
    with_cache, without = serve(on, arrivals), serve(off, arrivals)
    assert [r.output_ids for r in with_cache] == [r.output_ids for r in without]
    assert all(r.cached_tokens < len(r.request.prompt) for r in with_cache)
    assert on.blocks_in_use == 0 and on.prefix_cache_tokens[1] == sum(r.cached_tokens for r in with_cache)


# --- speculative decoding -----------------------------------------------------------------------


def _model_token(history: list[int]) -> int:
    """The simulated model's token after `history`: never EOS; few values, so continuations collide."""
    return 1 + hashlib.sha256(repr(history).encode()).digest()[0] % 7


class DraftingPool(SimulatedPool):
    """Speculative steps of k drafts on the simulated pool. The MTP layer's KV at a position is
    decided by the tokens up to and including the next one (`graphc.models.speculation`), so
    its slots are a second layer; drafts are verified greedily, each one wrong by a hash."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.mtp = k, {}

    def run(self, step) -> list[list[int]]:
        verdicts = []
        for replica, rows in enumerate(step.by_replica()):
            for sequence, run, start in rows:
                history = [*sequence.request.prompt, *sequence.output][:start] + run
                slot = functools.partial(self._slot, replica, sequence.blocks)
                for position in range(start):  # what this row's MTP attention reads
                    assert self.mtp.get(slot(position)) == tuple(history[:position + 2]), \
                        f"request {sequence.index} reads a wrong MTP KV vector at position {position}"
                verdicts.append(self._verify_and_draft(history, start, 0 if sequence.prefilling else len(run) - 1,
                                                       slot))
        super().run(step)  # the main layers' reads and writes
        return verdicts

    def _verify_and_draft(self, history: list[int], start: int, drafts: int, slot) -> list[int]:
        """One row's verdict [n, t_0 .. t_k, k drafts], writing its MTP KV as the step graph does."""
        verified = len(history) - 1 - drafts  # the position whose logits come first
        right = [history[verified + 1 + j] == _model_token(history[:verified + 1 + j]) for j in range(drafts)]
        accepted = right.index(False) if False in right else drafts
        kept = verified + accepted
        picked = _model_token(history[:kept + 1])
        for position in range(start, kept + 1):  # with each position's next token, `picked` after the last
            self.mtp[slot(position)] = tuple([*history[:kept + 1], picked][:position + 2])
        ahead, new_drafts = [*history[:kept + 1], picked], []
        for j in range(self.k):  # the drafts ahead write positions the next step writes again
            if j:
                self.mtp[slot(kept + j)] = ("draft",)
            right = _model_token(ahead)
            new_drafts.append(right if hashlib.sha256(repr((ahead, j)).encode()).digest()[0] % 3 else right % 7 + 1)
            ahead.append(new_drafts[-1])
        tokens = [*history[verified + 1:kept + 1], picked]
        return [accepted, *tokens, *[0] * (self.k + 1 - len(tokens)), *new_drafts]


@settings(max_examples=60, deadline=None)
@given(traffic(), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([0, 4]))
def test_with_drafts_a_block_is_reused_only_where_the_mtp_kv_at_its_end_has_the_right_next_token(
        arrivals, k, shards, as_decode):
    """The MTP layer's KV at a block's last position was computed from the writer's next token:
    a request that continues otherwise must not read it (the tokens equal caching off anyway,
    drafts being verified; sampled ones would not)."""
    options = dict(kv_shards=shards, prompt_as_decode=as_decode, draft_tokens=k)
    on, off = make(**options), make(**options, prefix_cache_salt=None)
    with_cache = serve_arrivals(on, arrivals, DraftingPool(k).run)
    without = serve_arrivals(off, arrivals, DraftingPool(k).run)
    assert [r.output_ids for r in with_cache] == [r.output_ids for r in without]
    assert on.blocks_in_use == 0 and on.prefix_cache_tokens[1] == sum(r.cached_tokens for r in with_cache)


# --- data-parallel replicas ---------------------------------------------------------------------


def _replicas_after_one_prompt_each(prompt: list[int]):
    """Two replicas of 16 blocks; an unrelated request served on replica 0, `prompt` on replica 1."""
    scheduler, pool = ReplicatedScheduler([make(num_blocks=16), make(num_blocks=16)]), SimulatedPool()
    serve(scheduler, [(0, Request(list(range(60, 70)), 2)), (0, Request(prompt, 2))], pool)
    assert [r.cached_blocks for r in scheduler.replicas] == [2, 5]
    return scheduler, pool


def test_a_request_goes_to_the_replica_holding_its_longest_cached_prefix_when_it_has_room():
    prompt = list(range(10, 30))
    scheduler, pool = _replicas_after_one_prompt_each(prompt)
    hog = Request(prompt + list(range(80, 92)), 9)  # 40 positions: 10 blocks, 5 of them cached
    again = Request(prompt + [3], 2)  # 22 positions: 6 blocks, 5 cached; replica 1 has 6 free, replica 0 16
    results = serve(scheduler, [(0, hog), (1, again)], pool)
    assert [r.cached_tokens for r in results] == [20, 20]
    assert [r.prefix_cache_tokens for r in scheduler.replicas] == [(10, 0), (20 + 32 + 21, 40)]


def test_a_request_whose_cached_replica_lacks_room_goes_to_the_roomiest():
    prompt = list(range(10, 30))
    scheduler, pool = _replicas_after_one_prompt_each(prompt)
    hog = Request(prompt + list(range(80, 100)), 8)  # 47 positions: 12 blocks; replica 1 keeps 4 free
    elsewhere = Request(prompt + [3], 8)  # 28 positions: 7 blocks
    results = serve(scheduler, [(0, hog), (1, elsewhere)], pool)
    assert [r.cached_tokens for r in results] == [20, 0]
    assert scheduler.replicas[0].prefix_cache_tokens == (10 + 21, 0)


# --- surfaces -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, compiled, expected", [(None, True, True), (None, False, False),
                                                       ("0", True, False), ("1", False, True)])
def test_graphc_prefix_caching_overrides_the_compiled_setting(value, compiled, expected, monkeypatch):
    if value is not None:
        monkeypatch.setenv("GRAPHC_PREFIX_CACHING", value)
    assert prefix_caching_enabled(compiled) is expected


def test_a_graphc_prefix_caching_that_is_not_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("GRAPHC_PREFIX_CACHING", "yes")
    with pytest.raises(GraphcError, match=r"^GRAPHC_PREFIX_CACHING='yes'; expected 0 \(off\) or 1 \(on\)$"):
        prefix_caching_enabled(True)
