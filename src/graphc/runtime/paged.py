"""Host-side bookkeeping of the paged KV pool: block allocation and per-step slot metadata.

Pure Python plus small tensors, shared by the eager reference and the runtime.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from graphc.errors import GraphcError
from graphc.step import ELSEWHERE_SLOT, PADDING_SLOT, ceil_div


class OutOfBlocks(GraphcError):
    """The pool cannot hold a request; the message says how many blocks it needs and has."""


class BlockAllocator:
    """A free list over the pool's `num_blocks` blocks, and the full blocks kept for reuse.

    A block published under a key (`graphc.runtime.prefix_cache`: the hash chain of the tokens
    that decide its contents) stays cached after its last holder releases it: idle, evicted least
    recently used only when an allocation finds the free list empty. Idle blocks count as free, so
    caching never makes a request wait. Without published blocks this is a plain free list.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._holders: dict[int, int] = {}  # published block -> sequences holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # published, held by none; oldest first

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: never handed out, or cached and idle."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Published blocks, held or idle."""
        return len(self._key_of)

    def allocate(self, count: int) -> list[int]:
        if count > self.free_blocks:
            raise OutOfBlocks(f"KV pool exhausted: need {count} more block(s), {self.free_blocks} free "
                              f"of {self.num_blocks}; raise kv_cache.num_blocks or GRAPHC_NUM_KV_BLOCKS")
        return [self._free.pop() if self._free else self._evict() for _ in range(count)]

    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)], self._holders[block]
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if block in self._key_of:
                self._holders[block] -= 1
                if not self._holders[block]:
                    self._idle[block] = None  # the most recently used end
        self._free.extend(reversed([block for block in blocks if block not in self._key_of]))

    def lookup(self, key: bytes) -> int | None:
        """The cached block published under `key`, if it is still cached."""
        return self._block_of.get(key)

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def hold(self, block: int) -> None:
        """One more sequence reads the cached `block` (a hit): it is not evicted while held."""
        self._holders[block] += 1
        self._idle.pop(block, None)

    def publish(self, block: int, key: bytes) -> None:
        """Cache `block`, held by the one sequence that wrote it, under `key`, unless another block
        already holds that content (two requests computed it at once): then this one stays private
        and returns to the free list on release."""
        if key not in self._block_of:
            self._block_of[key], self._key_of[block], self._holders[block] = block, key, 1


@dataclass
class SequenceBlocks:
    """The blocks one sequence owns, grown on demand as it gets longer.

    With the cache sharded over `num_shards` context-parallel ranks, logical block j lives on
    shard j % num_shards, and `blocks[j]` is its id in that shard's pool.
    """

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_shards: int = 1

    def reserve(self, length: int, allocators: BlockAllocator | list[BlockAllocator]) -> None:
        """Make room for positions 0..length-1 (one allocator per shard when sharded)."""
        per_shard = [allocators] if isinstance(allocators, BlockAllocator) else allocators
        if len(per_shard) != self.num_shards:
            raise ValueError(f"{len(per_shard)} allocators for {self.num_shards} shards")
        needed = range(len(self.blocks), ceil_div(length, self.block_size))
        granted: list[list[int]] = []
        try:
            for shard, allocator in enumerate(per_shard):
                granted.append(allocator.allocate(sum(1 for j in needed if j % self.num_shards == shard)))
        except OutOfBlocks:
            for allocator, blocks in zip(per_shard, granted):
                allocator.release(blocks)  # all or nothing: no shard keeps a partial grant
            raise
        handed = [iter(blocks) for blocks in granted]
        self.blocks.extend(next(handed[j % self.num_shards]) for j in needed)

    def slot(self, position: int, shard: int = 0) -> int:
        """The position's flat slot in `shard`'s pool, or ELSEWHERE_SLOT if its block lives elsewhere."""
        block = position // self.block_size
        if block % self.num_shards != shard:
            return ELSEWHERE_SLOT
        return self.blocks[block] * self.block_size + position % self.block_size

    def shard_blocks(self, shard: int = 0) -> list[int]:
        """`shard`'s blocks of this sequence, in logical order (its block-table row)."""
        return self.blocks[shard::self.num_shards]


METADATA_FIELDS = ("input_ids", "positions", "block_table", "slot_mapping", "logits_index")
"""What `step_metadata` returns, in order."""


def step_metadata(
    rows: list[tuple[SequenceBlocks, list[int], int]],
    width: int,
    blocks_per_row: int,
    total_rows: int | None = None,
    shard: int = 0,
    drafts: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Pack one step's rows into the model's [B, Q] layout.

    Args:
        rows: per row (its blocks, the token ids to run, the position of the first of them).
            Blocks must already be reserved for those positions.
        width: Q, tokens per row; shorter rows are padded.
        blocks_per_row: M, width of the block table.
        total_rows: B, when the step's bucket has more rows than `rows`; the extra rows are all
            padding (position 0, nothing written, logits ignored).
        shard: which context-parallel shard's view to build: its own blocks in the block table,
            and slots only for the tokens whose block lives there.
        drafts: per row, how many of its tokens are drafts to verify (speculative decoding: they
            follow the row's last token); none by default.

    Returns:
        input_ids [B, Q], positions [B, Q], block_table [B, M], slot_mapping [B, Q] and
        logits_index [B] (each row's last real token before its drafts). Padding tokens repeat the row's last
        position, so they attend only to keys that exist, and their slot is `PADDING_SLOT`.
    """
    count = total_rows or len(rows)
    if count < len(rows):
        raise ValueError(f"{len(rows)} rows do not fit a step of {count} rows")
    # Built as Python lists and converted once per field: this runs on the host every step.
    input_ids = [[0] * width for _ in range(count)]
    positions = [[0] * width for _ in range(count)]
    block_table = [[0] * blocks_per_row for _ in range(count)]
    slot_mapping = [[PADDING_SLOT] * width for _ in range(count)]
    logits_index = [0] * count
    for b, (seq, tokens, start) in enumerate(rows):
        n = len(tokens)
        if not 0 < n <= width:
            raise ValueError(f"row {b} has {n} tokens; a step row holds 1..{width}")
        input_ids[b][:n] = tokens
        positions[b] = [*range(start, start + n), *[start + n - 1] * (width - n)]
        slot_mapping[b][:n] = [seq.slot(p, shard) for p in range(start, start + n)]
        if len(seq.blocks) > blocks_per_row:
            raise ValueError(f"row {b} owns {len(seq.blocks)} blocks; the block table holds {blocks_per_row}")
        own = seq.shard_blocks(shard)
        block_table[b][: len(own)] = own
        logits_index[b] = n - 1 - (drafts[b] if drafts else 0)
    fields = (input_ids, positions, block_table, slot_mapping, logits_index)
    return tuple(torch.tensor(field, dtype=torch.int64) for field in fields)
