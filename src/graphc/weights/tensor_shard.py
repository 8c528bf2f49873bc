"""One tensor-parallel rank's slice of a split weight, and of its FP8 block scales.

Every weight tensor parallelism splits is split evenly along one dim into contiguous parts (a
family's `Family.tensor_parallel.dims` name the dim: rows for column-parallel projections and the
LM head, columns for row-parallel ones and the embedding), so rank t of tp holds
[t * n / tp, (t + 1) * n / tp) of it. The loader reads only that slice of a stored tensor; an FP8
weight kept as stored keeps the scales of its slice: whole scale blocks where every part is whole
blocks, else its block's scale repeated per row or column of the split dim (block 1
there), which stays exact and costs 4 bytes per block of the other dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size` tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    def bounds(self, length: int) -> tuple[int, int]:
        """[start, stop) of this rank's part of a dim of `length` (which `size` divides)."""
        part = length // self.size
        return self.rank * part, (self.rank + 1) * part

    def index(self, dim: int, length: int) -> tuple[slice, ...]:
        """The index of this rank's part of dim `dim` (for a tensor or a safetensors slice)."""
        start, stop = self.bounds(length)
        return (slice(None),) * dim + (slice(start, stop),)

    def covering_blocks(self, dim: int, length: int, block: int) -> tuple[slice, ...]:
        """The index of the whole scale blocks of dim `dim` that this rank's part lies in."""
        start, stop = self.bounds(length)
        return (slice(None),) * dim + (slice(start // block, -(-stop // block)),)

    def within_blocks(self, dim: int, length: int, block: int) -> tuple[slice, ...]:
        """This rank's part, indexed within the rows (or columns) `covering_blocks` covers."""
        start, stop = self.bounds(length)
        first = start // block * block
        return (slice(None),) * dim + (slice(start - first, stop - first),)

    def scales(self, grid: Tensor, block: tuple[int, int], dim: int, length: int) -> tuple[Tensor, tuple[int, int]]:
        """The scale grid and block of this rank's part of an FP8 weight of dim `dim` of `length`
        whose scales are `grid` in `block` blocks."""
        if (length // self.size) % block[dim] == 0:  # every rank's part is whole blocks: the same grid shape
            return grid[self.covering_blocks(dim, length, block[dim])], block
        per_element = grid.repeat_interleave(block[dim], dim=dim).narrow(dim, 0, length)
        return per_element[self.index(dim, length)], tuple(1 if d == dim else b for d, b in enumerate(block))
