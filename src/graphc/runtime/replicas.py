"""The leader's scheduler over data-parallel attention replicas.

Each replica is a `Scheduler` of its own (queue, KV allocators, running sequences); this one
admits requests to replicas and decides the one bucket every replica runs in a step, because the
ranks' MoE exchanges tokens across replicas and every rank must run the same graph:
1. **Admission**: a request goes to the replica whose prefix cache holds the longest prefix of
   its prompt among those with room for it (free KV blocks net of what their queues will take);
   with no cached prefix anywhere, to the replica with the most room, the lowest-numbered on ties.
   It is served there to the end.
2. **Which step**: a prefill step if any replica has a long prompt waiting and either nothing
   else can run anywhere or the previous step was not a prefill (the one-replica alternation,
   over all replicas); each replica with a long prompt runs one chunk of its oldest, in the
   smallest prefill bucket holding the longest chunk. Otherwise a decode step: each replica's
   rows by the one-replica rules, in the smallest decode bucket holding the most rows of any
   replica, P tokens per row if any replica has a short prompt among them (with drafts, 1 + k
   unless P is wider).
3. Replicas with no rows in a step run all-padding rows (nothing written to their KV pools,
   nothing sent to the experts). Steps run only while some replica has work.
"""

from __future__ import annotations

from graphc.artifacts.manifest import Manifest
from graphc.buckets.selection import Bucket, smallest_fitting
from graphc.runtime.scheduler import DraftStats, Emitted, Request, Result, Scheduler, Step


class ReplicatedScheduler:
    """`Scheduler`'s interface over `replicas`, each one replica's scheduler."""

    def __init__(self, replicas: list[Scheduler]):
        self.replicas = replicas
        self.results: dict[int, Result] = {}
        for replica in replicas:
            replica.results = self.results  # one index space, one result table
        self._submitted = 0
        self._last_was_prefill = False

    @property
    def allocators(self):
        return [a for replica in self.replicas for a in replica.allocators]

    @property
    def waiting(self):
        return [w for replica in self.replicas for w in replica.waiting]

    @property
    def running(self):
        return [s for replica in self.replicas for s in replica.running]

    @property
    def blocks_in_use(self) -> int:
        return sum(replica.blocks_in_use for replica in self.replicas)

    @property
    def cached_blocks(self) -> int:
        return sum(replica.cached_blocks for replica in self.replicas)

    @property
    def prefix_cache_tokens(self) -> tuple[int, int]:
        counts = [replica.prefix_cache_tokens for replica in self.replicas]
        return sum(q for q, _ in counts), sum(h for _, h in counts)

    @property
    def done(self) -> bool:
        return all(replica.done for replica in self.replicas)

    def refusal(self, request: Request) -> str | None:
        if request.needs_logits:
            return ("logprobs, penalties, logit_bias and response formats are served by artifacts of one "
                    "data-parallel replica only (dp 1): another replica's logits stay on its ranks")
        return self.replicas[0].refusal(request)  # every replica has the same buckets and pool

    def submit(self, request: Request) -> int:
        index, self._submitted = self._submitted, self._submitted + 1
        self.replicas[self._route(request)].submit(request, index)
        return index

    def _route(self, request: Request) -> int:
        """Rule 1: the replica with the longest cached prefix among those with room, else the roomiest."""
        def room(replica: Scheduler) -> int:
            queued = sum(sum(replica.blocks_needed(waiting)) for _, waiting in replica.waiting)
            return sum(a.free_blocks for a in replica.allocators) - queued
        rooms = [room(replica) for replica in self.replicas]
        needed = sum(self.replicas[0].blocks_needed(request))
        cached = [replica.cached_prefix(request) if space >= needed else 0
                  for replica, space in zip(self.replicas, rooms)]
        if max(cached) > 0:
            return cached.index(max(cached))
        return rooms.index(max(rooms))

    def cancel(self, index: int) -> Result | None:
        for replica in self.replicas:
            result = replica.cancel(index)
            if result is not None:
                return result
        return None

    def next_step(self) -> Step:
        for replica in self.replicas:
            replica.admit()
        pending = [replica.pending() for replica in self.replicas]
        long, others = any(p[0] for p in pending), any(p[1] for p in pending)
        if long and (not others or not self._last_was_prefill):
            self._last_was_prefill = True
            per_replica = [[row] if (row := replica.prefill_row()) else [] for replica in self.replicas]
            longest = max(len(rows[0][1]) for rows in per_replica if rows)
            bucket = Bucket("prefill", smallest_fitting(self.replicas[0].prefill, longest))
        else:
            self._last_was_prefill = False
            per_replica, shorts = zip(*(replica.decode_rows() for replica in self.replicas))
            first = self.replicas[0]
            bucket = Bucket("decode", smallest_fitting(first.decode, max(map(len, per_replica))),
                            first.decode_widths[-1 if any(shorts) else 0])
        return Step(bucket, [row for rows in per_replica for row in rows], tuple(map(len, per_replica)))

    @property
    def drafts(self) -> DraftStats:
        """Every replica's drafts (speculative decoding), position by position."""
        stats = [replica.drafts for replica in self.replicas]
        return DraftStats([sum(column) for column in zip(*(s.proposed for s in stats))],
                          [sum(column) for column in zip(*(s.accepted for s in stats))])

    def complete(self, step: Step, tokens: list[int], logits=None) -> list[Emitted]:
        """As `Scheduler.complete`; no request here needs the logits (`refusal`)."""
        emitted, start = [], 0
        for replica, rows in zip(self.replicas, step.by_replica()):
            emitted += replica.complete(Step(step.bucket, rows), tokens[start: start + len(rows)])
            start += len(rows)
        return emitted


def scheduler_for(manifest: Manifest, num_blocks: int) -> Scheduler | ReplicatedScheduler:
    """The leader's scheduler for compiled artifacts: one replica's, or one over every replica
    (each rank's pool of `num_blocks` blocks holds only its own replica's sequences)."""
    dp = manifest.topology.dp
    if dp == 1:
        return Scheduler.for_manifest([], manifest, num_blocks)
    return ReplicatedScheduler([Scheduler.for_manifest([], manifest, num_blocks) for _ in range(dp)])
