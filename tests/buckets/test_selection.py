"""Bucket selection: the pure functions that pick a precompiled shape for each piece of work."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphc.buckets.selection import Bucket, all_buckets, chunk_lengths, max_prefill_chunk, smallest_fitting

# Sorted, distinct bucket sizes, as the compiler and the scheduler hold them.
sizes_st = st.lists(st.integers(1, 4096), min_size=1, max_size=8, unique=True).map(sorted)


@given(data=st.data(), sizes=sizes_st)
def test_smallest_fitting_is_the_smallest_size_that_holds_n(data, sizes):
    n = data.draw(st.integers(1, sizes[-1]))
    size = smallest_fitting(sizes, n)
    assert size in sizes
    assert size >= n
    assert not any(n <= s < size for s in sizes)


@given(sizes=sizes_st)
def test_smallest_fitting_of_an_exact_size_is_that_size(sizes):
    for s in sizes:
        assert smallest_fitting(sizes, s) == s


@given(sizes=sizes_st, n=st.integers(-100, 0))
def test_smallest_fitting_rejects_non_positive_counts(sizes, n):
    with pytest.raises(ValueError, match=re.escape(f"cannot fit {n} items; need at least 1")):
        smallest_fitting(sizes, n)


@given(data=st.data(), sizes=sizes_st)
def test_smallest_fitting_rejects_more_than_the_largest_bucket_and_names_it(data, sizes):
    n = data.draw(st.integers(sizes[-1] + 1, sizes[-1] + 10_000))
    with pytest.raises(ValueError, match=re.escape(f"{n} is larger than the largest bucket ({sizes[-1]})")):
        smallest_fitting(sizes, n)


@given(length=st.integers(1, 5000), max_chunk=st.integers(1, 600))
def test_chunk_lengths_cover_the_prompt_with_full_chunks_then_a_shorter_tail(length, max_chunk):
    chunks = chunk_lengths(length, max_chunk)
    assert sum(chunks) == length
    assert all(1 <= c <= max_chunk for c in chunks)
    assert all(c == max_chunk for c in chunks[:-1])
    assert len(chunks) == -(-length // max_chunk)


def test_chunk_lengths_examples():
    assert chunk_lengths(10, 4) == [4, 4, 2]
    assert chunk_lengths(8, 4) == [4, 4]
    assert chunk_lengths(3, 4) == [3]
    assert chunk_lengths(1, 1) == [1]


@pytest.mark.parametrize("length,max_chunk", [(0, 4), (-3, 4), (5, 0), (5, -1), (0, 0)])
def test_chunk_lengths_rejects_non_positive_inputs(length, max_chunk):
    with pytest.raises(ValueError, match=re.escape(f"length ({length}) and max_chunk ({max_chunk}) must be positive")):
        chunk_lengths(length, max_chunk)


@given(prefill=sizes_st, budget=st.integers(1, 5000))
def test_max_prefill_chunk_is_the_largest_bucket_within_budget_else_the_budget(prefill, budget):
    chunk = max_prefill_chunk(prefill, budget)
    within = [s for s in prefill if s <= budget]
    if within:
        assert chunk == max(within)
        assert chunk in prefill
    else:
        assert chunk == budget
    assert 1 <= chunk <= budget


@given(prefill=sizes_st, budget=st.integers(1, 5000), length=st.integers(1, 5000))
def test_every_chunk_max_prefill_chunk_implies_fits_some_bucket(prefill, budget, length):
    chunk = max_prefill_chunk(prefill, budget)
    for c in chunk_lengths(length, chunk):
        bucket = smallest_fitting(prefill, c)  # never raises
        assert c <= bucket


def test_max_prefill_chunk_examples():
    assert max_prefill_chunk([16, 64, 256], 1000) == 256
    assert max_prefill_chunk([16, 64, 256], 100) == 64
    assert max_prefill_chunk([16, 64, 256], 64) == 64
    assert max_prefill_chunk([16, 64, 256], 10) == 10  # below every bucket: padded into prefill-16


def test_prefill_bucket_is_one_row_of_size_tokens():
    bucket = Bucket("prefill", 64)
    assert (bucket.rows, bucket.width, bucket.name) == (1, 64, "prefill-64")


def test_decode_bucket_is_size_rows_of_one_token():
    bucket = Bucket("decode", 8)
    assert (bucket.rows, bucket.width, bucket.name) == (8, 1, "decode-8")


def test_all_buckets_lists_sorted_prefill_then_sorted_decode():
    buckets = all_buckets([64, 16], [4, 1, 2])
    assert [b.name for b in buckets] == ["prefill-16", "prefill-64", "decode-1", "decode-2", "decode-4"]
    assert [(b.rows, b.width) for b in buckets] == [(1, 16), (1, 64), (1, 1), (2, 1), (4, 1)]


@given(prefill=sizes_st, decode=sizes_st)
def test_all_buckets_properties(prefill, decode):
    buckets = all_buckets(prefill, decode)
    assert len(buckets) == len(prefill) + len(decode) == len(set(buckets))
    assert [b.size for b in buckets if b.kind == "prefill"] == sorted(prefill)
    assert [b.size for b in buckets if b.kind == "decode"] == sorted(decode)
    assert all(b.rows == 1 and b.width == b.size for b in buckets if b.kind == "prefill")
    assert all(b.width == 1 and b.rows == b.size for b in buckets if b.kind == "decode")
    assert len({b.name for b in buckets}) == len(buckets)
    # Buckets are hashable (they key the runtime's graph table) and equal by value.
    assert Bucket("decode", decode[0]) in set(buckets)


def test_prompt_scores_add_a_score_twin_of_each_prefill_bucket_whose_head_takes_every_position():
    plain = all_buckets([8, 16], [2], prompt_as_decode=4)
    scored = all_buckets([8, 16], [2], prompt_as_decode=4, prompt_logprobs=True)
    assert sorted(set(scored) - set(plain)) == [Bucket("score", 8), Bucket("score", 16)]
    twin = Bucket("score", 16)
    assert (twin.rows, twin.width, twin.name, twin.head_rows()) == (1, 16, "score-16", 16)
    assert (Bucket("prefill", 16).head_rows(), Bucket("decode", 4, 4).head_rows(), Bucket("decode", 4, 3).head_rows(2)) \
        == (1, 4, 12)
