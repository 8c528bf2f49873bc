"""Host-side paged-KV bookkeeping: block allocation and step metadata."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphc.runtime.paged import BlockAllocator, OutOfBlocks, SequenceBlocks, step_metadata
from graphc.step import PADDING_SLOT


def test_allocator_hands_out_distinct_blocks_and_refuses_beyond_the_pool():
    allocator = BlockAllocator(5)
    first, second = allocator.allocate(2), allocator.allocate(3)
    assert sorted(first + second) == [0, 1, 2, 3, 4]
    with pytest.raises(OutOfBlocks, match=r"need 1 more block\(s\), 0 free of 5"):
        allocator.allocate(1)
    allocator.release(first)
    assert sorted(allocator.allocate(2)) == sorted(first)


@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6), block_size=st.sampled_from([1, 4, 16]))
def test_slots_of_all_sequences_are_distinct_and_inside_their_blocks(lengths, block_size):
    allocator = BlockAllocator(sum(-(-n // block_size) for n in lengths))
    sequences = [SequenceBlocks(block_size) for _ in lengths]
    for seq, n in zip(sequences, lengths):
        seq.reserve(n, allocator)
    slots = [seq.slot(p) for seq, n in zip(sequences, lengths) for p in range(n)]
    assert len(set(slots)) == len(slots)
    for seq, n in zip(sequences, lengths):
        assert all(seq.slot(p) // block_size == seq.blocks[p // block_size] for p in range(n))


def test_step_metadata_pads_rows_and_points_logits_at_the_last_real_token():
    allocator = BlockAllocator(8)
    a, b = SequenceBlocks(4), SequenceBlocks(4)
    a.reserve(7, allocator)
    b.reserve(2, allocator)
    ids, positions, table, slots, last = step_metadata([(a, [10, 11, 12], 4), (b, [20], 1)], width=3, blocks_per_row=3)
    assert ids.tolist() == [[10, 11, 12], [20, 0, 0]]
    assert positions.tolist() == [[4, 5, 6], [1, 1, 1]]  # padding repeats the last real position
    assert slots.tolist() == [[a.slot(4), a.slot(5), a.slot(6)], [b.slot(1), PADDING_SLOT, PADDING_SLOT]]
    assert table.tolist() == [a.blocks + [0], b.blocks + [0, 0]]
    assert last.tolist() == [2, 0]
    assert ids.dtype == positions.dtype == slots.dtype == table.dtype == torch.int64


def test_step_metadata_rejects_a_row_wider_than_the_step():
    seq = SequenceBlocks(4)
    seq.reserve(4, BlockAllocator(1))
    with pytest.raises(ValueError, match="row 0 has 4 tokens; a step row holds 1..3"):
        step_metadata([(seq, [1, 2, 3, 4], 0)], width=3, blocks_per_row=1)
