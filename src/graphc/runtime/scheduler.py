"""The leader's scheduler: admission, KV blocks, and which bucket each step runs.

Policy, step by step:
1. **Admission** (FIFO). A request is admitted once the pool has free blocks for its whole life:
   min(prompt + max_new_tokens, context_limit) - 1 positions (the last token is never cached). Reserving up front means a running
   sequence never runs out of blocks (no preemption needed). With prefix caching
   (`graphc.runtime.prefix_cache`) the blocks of the prompt's longest cached prefix are shared
   instead, and its prefill starts after them; cached blocks nobody holds count as free. A request that could never fit (a
   prompt of context_limit tokens or more, or more blocks than the pool holds) fails at once with
   a per-request error; the others are still served.
2. **Which step.** Prompts are split into chunks of at most `max_prefill_chunk` tokens (the
   largest prefill bucket within `max_num_prefilling_tokens`). With a prompt-as-decode size P,
   a sequence whose remaining prompt is at most P tokens (a short prompt, or a long prompt's
   tail) is *short*; other prefilling sequences are *long*. Each step is the first that applies:
   a. a **prefill** step, if a long sequence waits and either nothing else can run or the
      previous step was not a prefill: one chunk of the oldest long sequence, in the smallest
      prefill bucket that holds it;
   b. a **prompt-as-decode** step, if a short sequence waits: every short sequence (oldest
      first), then decoding sequences (rotating), up to the largest decode bucket's rows, in the
      smallest decode bucket that holds them, P tokens per row. Short prompts so join the
      running decodes instead of taking a prefill step of their own (which would also delay the
      decodes by a step);
   c. a **decode** step: up to the largest decode bucket's rows of decoding sequences (rotating,
      so every sequence advances when there are more), in the smallest decode bucket that
      holds them.
   Alternating a/b-c keeps long prompts from stalling running decodes. A prompt whose request
   asks for its log-probabilities (`Request.prompt_logprobs`) is long whatever its length: its
   chunks run in the prefill buckets' score twins, which return every position's.
3. **Speculative decoding** (k drafts: `graphc.models.speculation`). A decoding row runs its
   last token and up to k drafts its previous step made, as many as could still be emitted (under
   max_new_tokens and context_limit); its step returns how many were accepted, the tokens to
   append (those accepted, then the model's own) and the next drafts. Positions past the accepted
   ones are rolled back by not counting them: the next step writes them again. A sequence
   reserves k positions more than its life (the drafts ahead of its last token write their KV
   there), and a prompt chunk that is not the prompt's last ends one token early: that token runs
   again as the first of the next chunk, once its successor is known to the MTP layer. For the
   same reason a cached block is reused only by a request whose token after it is the writer's
   (`graphc.runtime.prefix_cache`).
4. **Finishing.** A sequence ends at one of its model's EOS ids (once it has `min_new_tokens`),
   at max_new_tokens, when prompt + generated reaches context_limit, or when it is cancelled;
   its blocks return to the pool at once (its full blocks stay cached with prefix caching).

Requests arrive at any time (`submit`, between steps) and are admitted by the same rules; a batch
given to the constructor is the same as submitting it in order.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from graphc.artifacts.manifest import Manifest
from graphc.backends import backend
from graphc.buckets.selection import Bucket, decode_widths, max_prefill_chunk, smallest_fitting
from graphc.runtime.constraints import TokenConstraint
from graphc.runtime.leader_sampling import leader_token
from graphc.runtime.logprobs import TokenLogprobs, chunk_logprobs, token_logprobs
from graphc.runtime.paged import BlockAllocator, SequenceBlocks
from graphc.runtime.penalties import Penalties
from graphc.runtime.prefix_cache import PrefixCache, prefix_caching_enabled, root_key
from graphc.sampling import Sampling
from graphc.step import ceil_div


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_at_eos: bool = True
    """False generates through EOS tokens (benchmarks, reference comparisons)."""
    min_new_tokens: int = 0
    """EOS does not end the request before this many tokens."""
    cache_salt: str | None = None
    """Prefix caching: the request shares cached blocks only with requests of the same salt
    (`graphc.runtime.prefix_cache`); None shares with every unsalted request."""
    logprobs: int | None = None
    """Each generated token's log-probability and its position's `logprobs` most likely tokens'
    (`graphc.runtime.logprobs`); None: none."""
    prompt_logprobs: int | None = None
    """Each prompt token's log-probability (but the first's) and its position's `prompt_logprobs`
    most likely tokens' (OpenAI's `echo`); None: none. Such a request reads nothing from the
    prefix cache (its prompt's every position is computed), and with it `max_new_tokens` may be
    0: the prompt is scored and nothing generated."""
    penalties: Penalties | None = None
    """Penalties and logit bias (`graphc.runtime.penalties`); None: none."""
    constraint: TokenConstraint | None = None
    """Its grammar's state (`graphc.runtime.constraints`): one request's, never shared."""

    @property
    def samples_on_the_leader(self) -> bool:
        """Whether the leader draws its tokens (`graphc.runtime.leader_sampling`)."""
        return self.penalties is not None or self.constraint is not None

    @property
    def needs_logits(self) -> bool:
        """Whether its tokens need the step's logits on the leader (it then never drafts)."""
        return self.logprobs is not None or self.prompt_logprobs is not None or self.samples_on_the_leader


@dataclass
class Result:
    request: Request
    output_ids: list[int]
    finish_reason: str
    """"eos", "length", "context_limit", "cancelled", "error" or (a server past its grace period:
    `OnlineEngine.abort`) "aborted"."""
    error: str | None = None
    first_token_seconds: float | None = None
    """Time to first token: from the scheduler's start (the `generate` call) to this request's
    first generated token."""
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of computed."""
    last_token_seconds: float | None = None
    """From the scheduler's start to this request's last generated token."""
    logprobs: list[TokenLogprobs] | None = None
    """Of each output token, where the request asked for them."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Of each prompt token (None for the first), where the request asked for them."""

    @property
    def time_per_output_token(self) -> float | None:
        """Seconds between generated tokens after the first (None with fewer than two)."""
        if self.first_token_seconds is None or self.last_token_seconds is None or len(self.output_ids) < 2:
            return None
        return (self.last_token_seconds - self.first_token_seconds) / (len(self.output_ids) - 1)


@dataclass
class Sequence:
    index: int
    request: Request
    blocks: SequenceBlocks
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    first_token_seconds: float | None = None
    last_token_seconds: float | None = None
    cached_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    """The prefix cache's keys of its first full blocks (with prefix caching)."""
    drafts: list[int] = field(default_factory=list)
    """Speculative decoding: the tokens its last step drafted after its last output token."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)

    @property
    def remaining_prompt(self) -> int:
        return len(self.request.prompt) - self.prefilled


@dataclass
class DraftStats:
    """Speculative decoding's drafts so far: proposed (verified) and accepted, in all and per draft
    position (position j: the (j + 1)-th token after a row's last one)."""

    proposed: list[int]
    accepted: list[int]

    def add(self, proposed: int, accepted: int) -> None:
        for j in range(proposed):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted


@dataclass(frozen=True)
class Emitted:
    """What one step produced for one request: a generated token, and its result if it ended."""

    index: int
    token: int | None
    """None where the request ended without generating (a prompt scored with max_new_tokens 0)."""
    result: Result | None
    cached_tokens: int = 0
    """Prompt tokens the request read from the prefix cache."""
    logprobs: TokenLogprobs | None = None
    """The token's, where its request asked for them."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On a request's first event, its prompt's, where it asked for them."""


Row = tuple[Sequence, list[int], int]
"""One row of a step: (sequence, tokens to run, position of the first)."""


@dataclass(frozen=True)
class Step:
    bucket: Bucket
    rows: list[Row]
    """Every replica's rows, replica by replica."""
    replica_rows: tuple[int, ...] = ()
    """With data-parallel replicas, how many of `rows` each has (`graphc.runtime.replicas`);
    empty: one replica, all of them."""

    def by_replica(self) -> list[list[Row]]:
        """The rows of each replica, in replica order."""
        if not self.replica_rows:
            return [self.rows]
        rows = iter(self.rows)
        return [list(itertools.islice(rows, count)) for count in self.replica_rows]

    @property
    def wants_logits(self) -> bool:
        """Whether a row's request needs the logits (`Request.needs_logits`; `Scheduler.complete`)."""
        return any(sequence.request.needs_logits for sequence, _, _ in self.rows)


class Scheduler:
    @classmethod
    def for_manifest(cls, requests: list[Request], manifest: Manifest, num_blocks: int) -> Scheduler:
        """The scheduler of compiled artifacts: their bucket table, KV layout (a pool of
        `num_blocks` per rank, the manifest's or GRAPHC_NUM_KV_BLOCKS') and runtime section."""
        buckets, kv = manifest.buckets, manifest.kv_cache
        scratch = int(backend(manifest.backend).fixed_pool)  # the scratch block is never allocated
        caching = prefix_caching_enabled(manifest.runtime.prefix_caching)
        return cls(requests, prefill=buckets.prefill, decode=buckets.decode, context_limit=buckets.context_limit,
                   block_size=kv.block_size, num_blocks=num_blocks - scratch,
                   max_num_prefilling_tokens=manifest.runtime.max_num_prefilling_tokens,
                   eos_token_ids=manifest.model.eos_token_id, kv_shards=manifest.topology.cp,
                   prompt_as_decode=buckets.prompt_as_decode, draft_tokens=buckets.draft_tokens,
                   prefix_cache_salt=(manifest.model_fingerprint, manifest.model.dtype) if caching else None,
                   prompt_scores=buckets.prompt_logprobs)

    def __init__(self, requests: list[Request], *, prefill: list[int], decode: list[int], context_limit: int,
                 block_size: int, num_blocks: int, max_num_prefilling_tokens: int, eos_token_ids: list[int],
                 kv_shards: int = 1, prompt_as_decode: int = 0, prefix_cache_salt: tuple[str, ...] | None = None,
                 draft_tokens: int = 0, prompt_scores: bool = False):
        """`num_blocks` is each rank's pool; with `kv_shards` context-parallel ranks, a sequence's
        block j lives on rank j % kv_shards and is allocated from that rank's pool. With
        `prefix_cache_salt` (what decides a block's contents besides its tokens) full blocks
        are cached and reused. `draft_tokens`: speculative decoding's k (rule 3; 0: off).
        `prompt_scores`: the prefill buckets have score twins (requests may ask for prompt logprobs)."""
        self.prefill, self.decode = sorted(prefill), sorted(decode)
        self.context_limit, self.block_size = context_limit, block_size
        self.eos = set(eos_token_ids)
        self.max_chunk = max_prefill_chunk(self.prefill, max_num_prefilling_tokens)
        self.prompt_as_decode = prompt_as_decode
        self.draft_tokens, self.prompt_scores = draft_tokens, prompt_scores
        self.decode_widths = decode_widths(prompt_as_decode, draft_tokens)
        self.drafts = DraftStats([0] * draft_tokens, [0] * draft_tokens)
        self.kv_shards = kv_shards
        self.allocators = [BlockAllocator(num_blocks) for _ in range(kv_shards)]
        self.allocator = self.allocators[0]
        self.prefix_cache = (None if prefix_cache_salt is None else
                             PrefixCache(self.allocators, block_size, root_key(*prefix_cache_salt, str(block_size)),
                                         next_token=draft_tokens > 0))
        self.results: dict[int, Result] = {}
        self.waiting: deque[tuple[int, Request]] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False
        self._submitted = 0
        self.started = time.perf_counter()
        for request in requests:
            self.submit(request)

    def submit(self, request: Request, index: int | None = None) -> int:
        """Queue `request` (at any time between steps); returns its index (the next one, unless a
        caller that numbers requests itself gives it). A request that can never be served has its
        error result at once."""
        if index is None:
            index, self._submitted = self._submitted, self._submitted + 1
        problem = self.refusal(request)
        if problem:
            self.results[index] = Result(request, [], "error", problem)
        else:
            self.waiting.append((index, request))
        return index

    def cancel(self, index: int) -> Result | None:
        """End request `index` now, waiting or running: its blocks return to the pool at once and
        its result keeps what it generated. None if it had already ended."""
        for position, (waiting, request) in enumerate(self.waiting):
            if waiting == index:
                del self.waiting[position]
                self.results[index] = Result(request, [], "cancelled")
                return self.results[index]
        for sequence in self.running:
            if sequence.index == index:
                self._finish(sequence, "cancelled")
                return self.results[index]
        return None

    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by admitted requests, over every shard's pool."""
        return sum(a.num_blocks - a.free_blocks for a in self.allocators)

    @property
    def cached_blocks(self) -> int:
        """Full blocks the prefix cache holds (in use or idle), over every shard's pool."""
        return sum(a.cached_blocks for a in self.allocators)

    @property
    def prefix_cache_tokens(self) -> tuple[int, int]:
        """Prompt tokens of admitted requests looked up in the prefix cache, and found there."""
        cache = self.prefix_cache
        return (cache.queried_tokens, cache.hit_tokens) if cache else (0, 0)

    def _lifetime(self, request: Request) -> int:
        """KV positions the request can ever write: every prompt token and every generated token
        but the last (which is returned, never fed back); with drafts, k more (rule 3), within
        the block table."""
        kept = min(len(request.prompt) + max(request.max_new_tokens, 1), self.context_limit) - 1
        if not self.draft_tokens:
            return kept
        return min(kept + self.draft_tokens, ceil_div(self.context_limit, self.block_size) * self.block_size)

    def refusal(self, request: Request) -> str | None:
        """Why `request` can never be served by these buckets and this pool, or None."""
        if not request.prompt:
            return "empty prompt: a request needs at least one token"
        if request.prompt_logprobs is not None and not self.prompt_scores:
            return ("prompt logprobs need artifacts compiled with runtime.prompt_logprobs: true; these were compiled "
                    "without")
        if request.max_new_tokens < (0 if request.prompt_logprobs is not None else 1):
            return f"max_new_tokens is {request.max_new_tokens}; it must be at least 1 (0 only to score a prompt)"
        if len(request.prompt) >= self.context_limit:
            return (f"prompt of {len(request.prompt)} tokens leaves no room under context_limit "
                    f"{self.context_limit}; shorten it or compile with a larger context_limit")
        blocks = max(self.blocks_needed(request))
        if blocks > self.allocator.num_blocks:
            return (f"needs {blocks} KV blocks but the pool has {self.allocator.num_blocks}; "
                    "raise kv_cache.num_blocks or GRAPHC_NUM_KV_BLOCKS")
        return None

    def blocks_needed(self, request: Request) -> list[int]:
        """The KV blocks `request` reserves on admission, per context-parallel shard."""
        blocks = ceil_div(self._lifetime(request), self.block_size)
        return [len(range(shard, blocks, self.kv_shards)) for shard in range(self.kv_shards)]

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> None:
        """Admit waiting requests in order while the pool holds their whole lives (rule 1)."""
        while self.waiting:
            index, request = self.waiting[0]
            looks_up = self.prefix_cache is not None and request.prompt_logprobs is None
            hits, keys = self.prefix_cache.match(request.prompt, request.cache_salt) if looks_up else ([], [])
            needed = self.blocks_needed(request)
            if hits:
                needed = self.prefix_cache.fresh_needed(needed, hits)
            if any(n > allocator.free_blocks for n, allocator in zip(needed, self.allocators)):
                return
            self.waiting.popleft()
            if looks_up:
                self.prefix_cache.hold(len(request.prompt), hits)
            cached = len(hits) * self.block_size
            sequence = Sequence(index, request, SequenceBlocks(self.block_size, list(hits), self.kv_shards),
                                prefilled=cached, cached_tokens=cached, block_keys=keys)
            sequence.blocks.reserve(self._lifetime(request), self.allocators)
            self.running.append(sequence)

    def cached_prefix(self, request: Request) -> int:
        """Prompt tokens of `request` the prefix cache holds now (0 without caching)."""
        if self.prefix_cache is None:
            return 0
        return len(self.prefix_cache.match(request.prompt, request.cache_salt)[0]) * self.block_size

    def next_step(self) -> Step:
        self.admit()
        long, others = self.pending()
        if long and (not others or not self._last_was_prefill):
            self._last_was_prefill = True
            row = self.prefill_row()
            kind = "prefill" if row[0].request.prompt_logprobs is None else "score"
            return Step(Bucket(kind, smallest_fitting(self.prefill, len(row[1]))), [row])
        self._last_was_prefill = False
        rows, short = self.decode_rows()
        return Step(Bucket("decode", smallest_fitting(self.decode, len(rows)), self.decode_widths[-1 if short else 0]),
                    rows)

    def pending(self) -> tuple[bool, bool]:
        """Whether a long prompt waits for a prefill step, and whether anything can run in a
        decode step (a short prompt or a decoding sequence)."""
        return any(map(self._long, self.running)), not all(map(self._long, self.running))

    def _long(self, sequence: Sequence) -> bool:
        """Whether its prompt's next tokens wait for a prefill step (rule 2)."""
        return sequence.remaining_prompt > self.prompt_as_decode or (
            sequence.prefilling and sequence.request.prompt_logprobs is not None)

    def prefill_row(self) -> Row | None:
        """The next chunk of the oldest long prompt, or None if none waits."""
        sequence = next(filter(self._long, self.running), None)
        if sequence is None:
            return None
        return sequence, sequence.request.prompt[sequence.prefilled: sequence.prefilled + self.max_chunk], sequence.prefilled

    def decode_rows(self) -> tuple[list[Row], bool]:
        """A decode step's rows (rule 2b or 2c), and whether short prompts are among them."""
        short = [s for s in self.running if s.prefilling and not self._long(s)][: self.decode[-1]]
        decoding = [s for s in self.running if not s.prefilling]
        batch = short + self._rotate(decoding[: self.decode[-1] - len(short)])
        rows = [(s, s.request.prompt[s.prefilled:], s.prefilled) if s.prefilling
                else (s, [s.output[-1], *s.drafts[: self._draft_room(s)]], len(s.request.prompt) + len(s.output) - 1)
                for s in batch]
        return rows, bool(short)

    def _draft_room(self, sequence: Sequence) -> int:
        """How many of its drafts a decoding row runs: no more than it could still emit, one
        token beyond them included (rule 3)."""
        request = sequence.request
        return max(0, min(len(sequence.drafts), request.max_new_tokens - len(sequence.output) - 1,
                          self.context_limit - len(request.prompt) - len(sequence.output) - 1))

    def _rotate(self, batch: list[Sequence]) -> list[Sequence]:
        """Move the sequences of this step to the back: with more decoding sequences than a step
        holds, every one advances in turn."""
        for sequence in batch:
            self.running.remove(sequence)
            self.running.append(sequence)
        return batch

    def complete(self, step: Step, tokens: list[int] | list[list[int]], logits=None, scores=()) -> list[Emitted]:
        """Record the step's sampled tokens (one per row; padding rows already dropped; with drafts,
        each row's packed verdict, `graphc.models.speculation`); returns the generated tokens,
        with the results of the requests they ended. `logits` [rows, V]: the step's, where a
        row's request needs them (`Step.wants_logits`); `scores`: a score step's prompt scores
        (`graphc.step.SCORE_OUTPUTS`)."""
        emitted = []
        for row, ((sequence, run, start), sampled) in enumerate(zip(step.rows, tokens)):
            new_tokens = self._new_tokens(sequence, run, sampled)
            if step.bucket.kind == "score":
                self._score(sequence, run, start, logits[row], [output[row] for output in scores])
            if sequence.prefilling:
                end = start + len(run)
                # With drafts a middle chunk's last token runs again with the next chunk (rule 3).
                sequence.prefilled = end - 1 if self.draft_tokens and end < len(sequence.request.prompt) else end
                if sequence.prefilling:
                    self._publish(sequence)
                    continue  # a middle chunk: its sample is not a generated token
            reason, request = None, sequence.request
            prompt_logprobs = sequence.prompt_logprobs if request.prompt_logprobs is not None else None
            if request.max_new_tokens == 0:  # a prompt scored, nothing generated
                self._publish(sequence)
                self._finish(sequence, "length")
                emitted.append(Emitted(sequence.index, None, self.results[sequence.index], sequence.cached_tokens,
                                       prompt_logprobs=prompt_logprobs))
                continue
            # A row that needs the logits never drafts: one new token, and the row's logits are its own.
            if request.samples_on_the_leader:
                new_tokens = [leader_token(logits[row], request, sequence.output)]
            if request.logprobs is not None:
                sequence.logprobs.append(token_logprobs(logits[row], new_tokens[0], request.logprobs))
            for count, token in enumerate(new_tokens, start=1):
                sequence.output.append(token)
                sequence.last_token_seconds = time.perf_counter() - self.started
                if len(sequence.output) == 1:
                    sequence.first_token_seconds = sequence.last_token_seconds
                reason = self._finish_reason(sequence)
                if reason:
                    break
            self._publish(sequence)
            if reason:
                self._finish(sequence, reason)
            logprobs = sequence.logprobs[-1] if request.logprobs is not None else None
            emitted += [Emitted(sequence.index, token, self.results.get(sequence.index) if reason and i == count else None,
                                sequence.cached_tokens, logprobs,
                                prompt_logprobs if len(sequence.output) - count + i == 1 else None)
                        for i, token in enumerate(new_tokens[:count], start=1)]
        return emitted

    def _score(self, sequence: Sequence, run: list[int], start: int, logits, scores: list) -> None:
        """Add a score step's row to its sequence's prompt logprobs: each position's of the token
        after it; the chunk's last position's from the step's logits, where a chunk follows."""
        prompt, top = sequence.request.prompt, sequence.request.prompt_logprobs
        if start == 0:
            sequence.prompt_logprobs.append(None)  # the first token follows nothing
        sequence.prompt_logprobs += chunk_logprobs(*scores, len(run) - 1, top)
        end = start + len(run)
        if end < len(prompt):
            sequence.prompt_logprobs.append(token_logprobs(logits, prompt[end], top))

    def _new_tokens(self, sequence: Sequence, run: list[int], sampled: int | list[int]) -> list[int]:
        """A row's new tokens from its step's output; with drafts, keeping its next drafts and
        counting the ones it verified."""
        if not self.draft_tokens:
            return [sampled]
        accepted, k = sampled[0], self.draft_tokens
        if not sequence.prefilling:
            self.drafts.add(len(run) - 1, accepted)
        # A row that needs the logits does not draft: the step returns its first token's logits only.
        sequence.drafts = [] if sequence.request.needs_logits else sampled[2 + k:]
        return sampled[1: 2 + accepted]

    def _publish(self, sequence: Sequence) -> None:
        """Offer the prefix cache the sequence's blocks whose every position is now written."""
        if self.prefix_cache is None:
            return
        prompt = sequence.request.prompt
        written = sequence.prefilled if sequence.prefilling else len(prompt) + len(sequence.output) - 1
        if written // self.block_size > len(sequence.block_keys):
            self.prefix_cache.publish(sequence.blocks.blocks, sequence.block_keys, prompt + sequence.output, written,
                                      sequence.request.cache_salt)

    def _finish(self, sequence: Sequence, reason: str) -> None:
        self.running.remove(sequence)
        for shard, allocator in enumerate(self.allocators):
            allocator.release(sequence.blocks.shard_blocks(shard))
        self.results[sequence.index] = Result(sequence.request, sequence.output, reason,
                                              first_token_seconds=sequence.first_token_seconds,
                                              cached_tokens=sequence.cached_tokens,
                                              last_token_seconds=sequence.last_token_seconds,
                                              logprobs=sequence.logprobs if sequence.request.logprobs is not None else None,
                                              prompt_logprobs=(sequence.prompt_logprobs
                                                               if sequence.request.prompt_logprobs is not None else None))

    def _finish_reason(self, sequence: Sequence) -> str | None:
        request = sequence.request
        if request.stop_at_eos and sequence.output[-1] in self.eos and len(sequence.output) >= request.min_new_tokens:
            return "eos"
        if len(sequence.output) >= sequence.request.max_new_tokens:
            return "length"
        if len(sequence.request.prompt) + len(sequence.output) >= self.context_limit:
            return "context_limit"
        return None
