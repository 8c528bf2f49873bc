"""The leader's scheduler: admission, KV blocks, and which bucket each step runs.

Policy, step by step:
1. **Admission** (FIFO). A request is admitted once the pool has free blocks for its whole life:
   min(prompt + max_new_tokens, context_limit) - 1 positions (the last token is never cached). Reserving up front means a running
   sequence never runs out of blocks (no preemption needed). A request that could never fit (a
   prompt of context_limit tokens or more, or more blocks than the pool holds) fails at once with
   a per-request error; the others are still served.
2. **Prefill or decode.** If an admitted sequence still has prompt to prefill, and either nothing
   is decoding or the previous step was a decode, the step prefills the oldest such sequence:
   one chunk of at most `max_prefill_chunk` tokens (the largest prefill bucket within
   `max_num_prefilling_tokens`), run in the smallest prefill bucket that holds it. Otherwise the
   step decodes: up to the largest decode bucket's rows of decoding sequences (rotating, so every
   sequence advances when there are more), in the smallest decode bucket that holds them.
   Alternating keeps long prompts from stalling running decodes.
3. **Finishing.** A sequence ends at one of its model's EOS ids, at max_new_tokens, or when
   prompt + generated reaches context_limit; its blocks return to the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from graphc.buckets import Bucket, max_prefill_chunk, smallest_fitting
from graphc.paged import BlockAllocator, SequenceBlocks
from graphc.sampling import Sampling


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_at_eos: bool = True
    """False generates through EOS tokens (benchmarks, reference comparisons)."""


@dataclass
class Result:
    request: Request
    output_ids: list[int]
    finish_reason: str
    """"eos", "length", "context_limit", or "error"."""
    error: str | None = None


@dataclass
class Sequence:
    index: int
    request: Request
    blocks: SequenceBlocks
    prefilled: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)


@dataclass(frozen=True)
class Step:
    bucket: Bucket
    rows: list[tuple[Sequence, list[int], int]]
    """(sequence, tokens to run, position of the first)."""


class Scheduler:
    def __init__(self, requests: list[Request], *, prefill: list[int], decode: list[int], context_limit: int,
                 block_size: int, num_blocks: int, max_num_prefilling_tokens: int, eos_token_ids: list[int],
                 kv_shards: int = 1):
        """`num_blocks` is each rank's pool; with `kv_shards` context-parallel ranks, a sequence's
        block j lives on rank j % kv_shards and is allocated from that rank's pool."""
        self.prefill, self.decode = sorted(prefill), sorted(decode)
        self.context_limit, self.block_size = context_limit, block_size
        self.eos = set(eos_token_ids)
        self.max_chunk = max_prefill_chunk(self.prefill, max_num_prefilling_tokens)
        self.kv_shards = kv_shards
        self.allocators = [BlockAllocator(num_blocks) for _ in range(kv_shards)]
        self.allocator = self.allocators[0]
        self.results: dict[int, Result] = {}
        self.waiting: deque[tuple[int, Request]] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False
        for index, request in enumerate(requests):
            problem = self._never_fits(request)
            if problem:
                self.results[index] = Result(request, [], "error", problem)
            else:
                self.waiting.append((index, request))

    def _lifetime(self, request: Request) -> int:
        """KV positions the request can ever write: every prompt token and every generated token
        but the last (which is returned, never fed back)."""
        return min(len(request.prompt) + request.max_new_tokens, self.context_limit) - 1

    def _never_fits(self, request: Request) -> str | None:
        if not request.prompt:
            return "empty prompt: a request needs at least one token"
        if request.max_new_tokens < 1:
            return f"max_new_tokens is {request.max_new_tokens}; it must be at least 1"
        if len(request.prompt) >= self.context_limit:
            return (f"prompt of {len(request.prompt)} tokens leaves no room under context_limit "
                    f"{self.context_limit}; shorten it or compile with a larger context_limit")
        blocks = max(self._blocks_per_shard(request))
        if blocks > self.allocator.num_blocks:
            return (f"needs {blocks} KV blocks but the pool has {self.allocator.num_blocks}; "
                    "raise kv_cache.num_blocks or GRAPHC_NUM_KV_BLOCKS")
        return None

    def _blocks_per_shard(self, request: Request) -> list[int]:
        blocks = -(-self._lifetime(request) // self.block_size)
        return [len(range(shard, blocks, self.kv_shards)) for shard in range(self.kv_shards)]

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> None:
        while self.waiting:
            index, request = self.waiting[0]
            needed = self._blocks_per_shard(request)
            if any(n > allocator.free_blocks for n, allocator in zip(needed, self.allocators)):
                return
            self.waiting.popleft()
            sequence = Sequence(index, request, SequenceBlocks(self.block_size, num_shards=self.kv_shards))
            sequence.blocks.reserve(self._lifetime(request), self.allocators)
            self.running.append(sequence)

    def next_step(self) -> Step:
        self._admit()
        prefilling = [s for s in self.running if s.prefilling]
        decoding = [s for s in self.running if not s.prefilling]
        if prefilling and (not decoding or not self._last_was_prefill):
            self._last_was_prefill = True
            sequence = prefilling[0]
            chunk = sequence.request.prompt[sequence.prefilled: sequence.prefilled + self.max_chunk]
            bucket = Bucket("prefill", smallest_fitting(self.prefill, len(chunk)))
            return Step(bucket, [(sequence, chunk, sequence.prefilled)])
        self._last_was_prefill = False
        batch = decoding[: self.decode[-1]]
        # Rotate so that, with more sequences than the largest bucket, every one advances in turn.
        for sequence in batch:
            self.running.remove(sequence)
            self.running.append(sequence)
        bucket = Bucket("decode", smallest_fitting(self.decode, len(batch)))
        rows = [(s, [s.output[-1]], len(s.request.prompt) + len(s.output) - 1) for s in batch]
        return Step(bucket, rows)

    def complete(self, step: Step, tokens: list[int]) -> None:
        """Record the step's sampled tokens (one per row; padding rows already dropped)."""
        for (sequence, run, start), token in zip(step.rows, tokens):
            if step.bucket.kind == "prefill":
                sequence.prefilled = start + len(run)
                if sequence.prefilling:
                    continue  # a middle chunk: its sample is not a generated token
            sequence.output.append(token)
            reason = self._finish_reason(sequence)
            if reason:
                self.running.remove(sequence)
                for shard, allocator in enumerate(self.allocators):
                    allocator.release(sequence.blocks.shard_blocks(shard))
                self.results[sequence.index] = Result(sequence.request, sequence.output, reason)

    def _finish_reason(self, sequence: Sequence) -> str | None:
        if sequence.request.stop_at_eos and sequence.output[-1] in self.eos:
            return "eos"
        if len(sequence.output) >= sequence.request.max_new_tokens:
            return "length"
        if len(sequence.request.prompt) + len(sequence.output) >= self.context_limit:
            return "context_limit"
        return None
