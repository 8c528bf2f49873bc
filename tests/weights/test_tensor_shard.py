"""A tensor-parallel rank's slice of a weight and of its FP8 block scales: dequantising the
slice with its scales gives the slice of the dequantised weight, bit for bit."""

from __future__ import annotations

import pytest
import torch

from graphc.weights.fp8 import dequantize, quantize
from graphc.weights.tensor_shard import TensorShard


@pytest.mark.parametrize("shape, block, dim, tp", [
    ((64, 48), (16, 16), 0, 2),  # whole blocks per rank
    ((64, 48), (16, 16), 1, 3),
    ((48, 40), (32, 32), 0, 2),  # 24-row parts straddle 32-row blocks: per-row scales
    ((48, 40), (32, 32), 1, 4),  # 10-column parts: per-column scales
    ((40, 40), (16, 16), 0, 2),  # a ragged last block, and parts of 20 rows
])
def test_each_ranks_slice_dequantises_to_its_slice_of_the_weight(shape, block, dim, tp):
    weight, scales = quantize(torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3, block)
    whole = dequantize(weight, scales, block)
    for rank in range(tp):
        shard = TensorShard(rank, tp)
        part = weight[shard.index(dim, shape[dim])]
        grid, part_block = shard.scales(scales, block, dim, shape[dim])
        assert torch.equal(dequantize(part, grid, part_block), whole[shard.index(dim, shape[dim])]), rank
        whole_blocks = (shape[dim] // tp) % block[dim] == 0
        assert part_block == (block if whole_blocks else tuple(1 if d == dim else b for d, b in enumerate(block)))


def test_parts_are_contiguous_and_cover_the_dim():
    assert [TensorShard(r, 4).bounds(12) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
