"""The bucket planner (`graphc.buckets`): exact, and never worse than the hard-coded ladder."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc.buckets.selection import smallest_fitting

from graphc.buckets.planner import chunk_histogram, optimal_buckets, padding_waste, plan_buckets, power_of_two_ladder, read_workload


@st.composite
def workloads(draw, max_limit=64):
    limit = draw(st.integers(1, max_limit))
    lengths = draw(st.dictionaries(st.integers(1, limit), st.integers(1, 50), min_size=1, max_size=12))
    return lengths, limit


def total(histogram, buckets):
    return sum(padding_waste(histogram, buckets).values())


def brute_force(histogram, count, limit):
    candidates = sorted(set(histogram) - {limit})
    return min(total(histogram, sorted({*combo, limit}))
               for c in range(count) for combo in itertools.combinations(candidates, c))


@settings(max_examples=300, deadline=None)
@given(workloads(), st.integers(1, 6))
def test_buckets_are_sorted_unique_within_count_and_the_largest_covers_the_limit(workload, count):
    histogram, limit = workload
    buckets = optimal_buckets(histogram, count, limit)
    assert buckets == sorted(set(buckets)) and 1 <= len(buckets) <= count
    assert buckets[-1] == limit and buckets[0] >= 1


@settings(max_examples=300, deadline=None)
@given(workloads(), st.integers(1, 6))
def test_every_length_maps_to_the_smallest_bucket_that_holds_it(workload, count):
    histogram, limit = workload
    buckets = optimal_buckets(histogram, count, limit)
    for length in range(1, limit + 1):
        bucket = smallest_fitting(buckets, length)
        assert bucket >= length and all(b < length for b in buckets if b < bucket)


@settings(max_examples=300, deadline=None)
@given(workloads(max_limit=40), st.integers(1, 4))
def test_the_dynamic_programme_matches_brute_force(workload, count):
    histogram, limit = workload
    assert total(histogram, optimal_buckets(histogram, count, limit)) == brute_force(histogram, count, limit)


@settings(max_examples=300, deadline=None)
@given(workloads(max_limit=512), st.integers(1, 8))
def test_never_worse_than_the_power_of_two_ladder_with_as_many_graphs(workload, count):
    histogram, limit = workload
    ladder = power_of_two_ladder(count, limit)
    assert total(histogram, optimal_buckets(histogram, len(ladder), limit)) <= total(histogram, ladder)


def test_padding_waste_is_counted_per_bucket():
    assert padding_waste({3: 2, 8: 1, 5: 4}, [4, 8]) == {4: 2, 8: 12}


def test_power_of_two_ladder_halves_down_from_the_limit():
    assert power_of_two_ladder(4, 256) == [32, 64, 128, 256]
    assert power_of_two_ladder(3, 100) == [25, 50, 100]
    assert power_of_two_ladder(5, 4) == [1, 2, 4]


def test_chunks_of_long_prompts_count_as_full_chunks_and_a_tail():
    assert chunk_histogram({70: 2, 10: 1}, 32) == {32: 4, 6: 2, 10: 1}


def test_lengths_outside_the_limit_are_refused():
    with pytest.raises(ValueError, match="lengths must lie in 1..16"):
        optimal_buckets({17: 1}, 2, 16)


def test_plan_stays_within_the_budget_and_counts_prompt_as_decode_graphs():
    lengths = {n: 1 + n % 7 for n in range(1, 400)}
    for graphs in range(2, 16):
        plan = plan_buckets(lengths, graphs, 512, 256, 8)
        assert plan.graphs <= graphs and plan.prefill[-1] == 256 and plan.decode[-1] == 8
        # P: a full [B, P] step computes no more tokens than the smallest prefill bucket, when
        # the budget has room for the [B, P] graphs; else 1 (which needs no graph)
        wanted = plan.prefill[0] // 8
        fits = graphs - 2 * len(plan.decode) >= 1
        assert plan.prompt_as_decode == (wanted if wanted > 1 and fits else 1)
        assert plan.graphs == len(plan.prefill) + len(plan.decode) * (2 if plan.prompt_as_decode > 1 else 1)


def test_plan_reports_waste_per_request_and_the_ladder_it_beats():
    lengths = {10: 50, 100: 30, 250: 20}
    plan = plan_buckets(lengths, 5, 512, 256, 4)
    chunks = chunk_histogram(lengths, 256)
    assert plan.prefill_waste == {b: w / 100 for b, w in padding_waste(chunks, plan.prefill).items()}
    assert plan.ladder == power_of_two_ladder(len(plan.prefill), 256)
    assert sum(plan.prefill_waste.values()) <= sum(plan.ladder_waste.values())
    assert plan.ladder_match <= len(plan.prefill)


def test_read_workload_takes_lengths_or_a_histogram(tmp_path):
    path = tmp_path / "w.txt"
    path.write_text("# lengths\n5\n5\n7 3\n\n")
    assert read_workload(path) == {5: 2, 7: 3}
    path.write_text("5\n0\n")
    with pytest.raises(ValueError, match=r"w\.txt:2: expected a prompt length"):
        read_workload(path)
