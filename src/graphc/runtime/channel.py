"""The leader -> followers host-metadata channel, over one shared-memory segment per job.

The leader publishes, once at start-up, the serving parameters every rank must agree on (bucket
table, context limit, prompt-as-decode size, KV pool), and then every step: the bucket and each
rank's step inputs (token ids, positions, logits index, block table, slot mapping and sampling
parameters: ranks of one attention replica share all but their KV shard's table and slots, and
replicas differ). Followers copy a step out and acknowledge it; they never schedule or allocate.
With data-parallel replicas, the first rank of each other replica samples its replica's rows and
returns the tokens here; no graph broadcasts.

Layout (int64 words): a header [published step, stop step, start-up length, ack per rank,
returned step per rank], a start-up area (JSON bytes), the returned tokens [world, max rows], then
two step slots used alternately. The leader writes slot k % 2 only after every follower has
acknowledged step k - 2, so a slot is never overwritten while read; it publishes a step by
writing its number into the header after the slot (x86 keeps stores in order). A follower writes
step k's tokens, then k into its returned word; the leader reads them before it schedules step
k + 1, so they are never overwritten unread. The leader creates and alone unlinks the segment;
followers detach without unlinking (the launcher removes it too, should the leader die first).

A job that spans hosts has one segment per host: on the leader's host the leader publishes as
above; on each other host its first rank (the host's relay, `graphc.runtime.cross_host`) creates
the segment and republishes there each step it receives from the leader, so a follower reads its
own host's segment whichever host it is on. `publisher` and `readers` say who writes and who reads
one segment; acknowledgements are awaited from its readers only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.step import step_shapes

STARTUP_BYTES = 1 << 16
START_TIMEOUT_SECONDS = 120.0
"""How long a follower waits for the leader to create the channel, whatever its step timeout."""
KINDS = ("prefill", "decode", "score")
"""Bucket kinds by their number in a slot."""
HEADER_WORDS = 3
"""A slot starts with the step's bucket: kind, size, tokens per row."""
READY = 0x67726170686301
"""The segment header's last word once the publisher has set the rest: a follower attaches only
then (a new segment is all zeros, which read as "step 0 published, start-up metadata of 0 bytes")."""
STEP_FIELDS = ("input_ids", "positions", "logits_index", "block_table", "slot_mapping",
               "temperature", "top_k", "top_p", "seed")
"""The step inputs the leader sends, each as [world, ...]: every rank's own."""
FLOAT_FIELDS = frozenset({"temperature", "top_p"})
"""fp32 fields, sent as their bit patterns."""


SHM = Path("/dev/shm")
STALE = re.compile(r"(?:graphc|sem\.mp-graphc)-(\d+)-\w+")
"""What a launcher names after its PID: its jobs' segments (`graphc-PID-RUN`) and the semaphores
multiprocessing makes for its agent (`sem.mp-graphc-PID-...`, `graphc.runtime.launch`)."""


def sweep_stale(directory: Path = SHM) -> list[str]:
    """Remove the segments and semaphores whose launcher (the PID in their name) is gone: what a
    killed job left (its resource tracker, which would have removed them, died with it). Assumes
    the processes that share this /dev/shm share a PID namespace, as a host's do. Returns their names."""
    removed = []
    for path in sorted(directory.glob("*graphc-*")) if directory.is_dir() else []:
        match = STALE.fullmatch(path.name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError, PermissionError):  # another's sweep; another user's
                path.unlink()
                removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_segment(name: str) -> None:
    """Unlink the segment `name` if it exists."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()


def rows_of(words: torch.Tensor, width: int) -> torch.Tensor:
    """Returned words as rows: [rows] where each row returns one token, else [rows, width]."""
    return words if width == 1 else words.view(-1, width)


class ChannelTimeout(GraphcError):
    """The other side did not answer in time (a rank died or hangs)."""


class StepChannel:
    """Shared-memory channel for `world` ranks and steps of at most `max_rows` x `max_width`.

    Args:
        name: job-unique segment name (the launcher derives it from the run id).
        world: ranks in the job.
        max_rows, max_width, blocks_per_row: the largest step (from the bucket table).
        rank: the publisher creates the segment (removing a stale one of the same name); others attach.
        timeout: seconds to wait for the other side before `ChannelTimeout`; None waits as long as
            it takes (a server's followers, idle between requests, under an agent that stops them all
            if a rank dies).
        publisher: the rank that writes the steps (the leader; on another host, its relay).
        readers: the ranks that read this segment (default: every rank but the publisher).
        returned_width: words a sampling rank returns per row (`BucketTable.returned_width`).
    """

    def __init__(self, name: str, world: int, max_rows: int, max_width: int, blocks_per_row: int, rank: int,
                 timeout: float | None = 120.0, publisher: int = 0, readers: tuple[int, ...] | None = None,
                 returned_width: int = 1):
        self.name, self.world, self.rank, self.timeout = name, world, rank, timeout
        self.publisher = publisher
        self.readers = tuple(r for r in range(world) if r != publisher) if readers is None else readers
        self.max_rows, self.max_width, self.blocks_per_row = max_rows, max_width, blocks_per_row
        self.returned_width = returned_width
        header = 3 + 2 * world + 1  # the last word: READY
        largest = self._shapes(max_rows, max_width)
        self.capacity = {name: math.prod(largest[name]) for name in STEP_FIELDS}
        """Words of each field in a slot: room for the largest step (computed once, not per step)."""
        self.slot_words = HEADER_WORDS + sum(self.capacity.values())
        returned = world * max_rows * returned_width
        size = 8 * (header + returned + 2 * self.slot_words) + STARTUP_BYTES
        if rank == publisher:
            remove_segment(name)  # a crashed run's leftover of the same name
            self.segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        else:
            self.segment = self._attach(name, size)
        words = np.ndarray((header + returned + 2 * self.slot_words,), dtype=np.int64, buffer=self.segment.buf)
        self.header = words[:header]
        self.returned = words[header: header + returned].reshape(world, max_rows * returned_width)
        slots = header + returned
        self.slots = [words[slots + i * self.slot_words: slots + (i + 1) * self.slot_words] for i in range(2)]
        self.startup = np.ndarray((STARTUP_BYTES,), dtype=np.uint8, buffer=self.segment.buf, offset=8 * words.size)
        if rank == publisher:
            self.header[:-1] = -1
            self.header[-1] = READY  # last: what a follower waits for in `_attach`

    def _attach(self, name: str, size: int):
        deadline = time.monotonic() + (START_TIMEOUT_SECONDS if self.timeout is None else self.timeout)
        while True:
            try:
                # Ranks spawned by one launcher share its resource tracker, where the leader's
                # segment is registered once: a follower must not unregister it (the leader's
                # unlink would then fail in the tracker), and the tracker unlinks it only if
                # every rank is gone without the leader having done so.
                segment = shared_memory.SharedMemory(name=name)
                if segment.size >= size and self._ready(segment):
                    return segment
                segment.close()
            except (FileNotFoundError, ValueError):
                # Absent, or created but not yet sized: the leader's shm_open and ftruncate are two
                # calls, and mapping the segment between them fails ("cannot mmap an empty file").
                pass
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"rank {self.rank}: the leader's channel {name!r} never appeared (or never became ready)") from None
            time.sleep(0.01)

    def _ready(self, segment) -> bool:
        """Whether the publisher has set `segment`'s header (its last word is READY)."""
        offset = 8 * (3 + 2 * self.world)
        return int(np.frombuffer(segment.buf, dtype=np.int64, count=1, offset=offset)[0]) == READY

    def _wait(self, ready, what: str) -> None:
        deadline, pause = time.monotonic() + (float("inf") if self.timeout is None else self.timeout), 0.0
        while not ready():
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"rank {self.rank}: timed out after {self.timeout:.0f} s waiting for {what}")
            time.sleep(pause)
            pause = min(0.001, pause + 0.00005)  # spin briefly, then back off to 1 ms

    # -- start-up ---------------------------------------------------------------------------

    def publish_startup(self, info: dict) -> None:
        data = json.dumps(info).encode()
        if len(data) > STARTUP_BYTES:
            raise GraphcError(f"start-up metadata of {len(data)} bytes exceeds the channel's {STARTUP_BYTES}")
        self.startup[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.header[2] = len(data)

    def receive_startup(self) -> dict:
        self._wait(lambda: self.header[2] >= 0, "the leader's start-up metadata")
        return json.loads(bytes(self.startup[: int(self.header[2])]))

    # -- steps ------------------------------------------------------------------------------

    def publish(self, step: int, bucket: Bucket, fields: dict[str, torch.Tensor]) -> None:
        """Leader: write step `step`, run in `bucket` (every field [world, ...]: each rank's)."""
        slot = self._free_slot(step)
        slot[:3] = (KINDS.index(bucket.kind), bucket.size, bucket.tokens_per_row)
        offset = HEADER_WORDS
        for name in STEP_FIELDS:
            values = fields[name].reshape(-1)
            values = (values.view(torch.int32) if name in FLOAT_FIELDS else values).numpy()
            slot[offset: offset + values.size] = values
            offset += self.capacity[name]
        self.header[0] = step

    def published_words(self, step: int) -> np.ndarray:
        """Step `step`'s slot as published (what a relay sends to the other hosts)."""
        return self.slots[step % 2]

    def republish(self, step: int, words: np.ndarray) -> None:
        """A host's relay: publish step `step` from a slot the leader published on its own host."""
        self._free_slot(step)[:] = words
        self.header[0] = step

    def _free_slot(self, step: int) -> np.ndarray:
        self._wait(lambda: all(self.header[3 + r] >= step - 2 for r in self.readers),
                   f"followers to read step {step - 2}")
        return self.slots[step % 2]

    def receive(self, step: int) -> tuple[Bucket, dict[str, torch.Tensor]] | None:
        """Follower: wait for step `step`; None once the leader has stopped the job."""
        self._wait(lambda: self.header[0] >= step or 0 <= self.header[1] <= step, f"step {step} from the leader")
        if 0 <= self.header[1] <= step and self.header[0] < step:
            return None
        slot = self.slots[step % 2]
        kind, size, tokens_per_row = (int(v) for v in slot[:3])
        bucket = Bucket(KINDS[kind], size, tokens_per_row)
        shapes = self._shapes(bucket.rows, bucket.width)
        fields, offset = {}, HEADER_WORDS
        for name in STEP_FIELDS:
            count = int(np.prod(shapes[name]))
            values = torch.from_numpy(slot[offset: offset + count].copy()).view(shapes[name])
            fields[name] = values.to(torch.int32).view(torch.float32) if name in FLOAT_FIELDS else values
            offset += self.capacity[name]
        self.header[3 + self.rank] = step
        return bucket, fields

    def return_tokens(self, step: int, tokens: torch.Tensor) -> None:
        """A follower that samples (a replica's first rank): hand step `step`'s tokens to the leader."""
        self.returned[self.rank, : tokens.numel()] = tokens.flatten().numpy()
        self.header[3 + self.world + self.rank] = step

    def returned_tokens(self, step: int, rank: int, rows: int) -> torch.Tensor:
        """Leader: what `rank` sampled for its first `rows` rows in step `step` (waits for it):
        [rows], or [rows, returned_width] where each row returns more than its token."""
        self._wait(lambda: self.header[3 + self.world + rank] >= step, f"rank {rank}'s tokens of step {step}")
        return rows_of(torch.from_numpy(self.returned[rank, : rows * self.returned_width].copy()), self.returned_width)

    def stop(self, step: int) -> None:
        """Leader: no step `step` or later will come."""
        self.header[1] = step

    def _shapes(self, rows: int, width: int) -> dict[str, tuple[int, ...]]:
        shapes = step_shapes(rows, width, self.blocks_per_row)
        return {name: (self.world, *shapes[name]) for name in STEP_FIELDS}

    def close(self) -> None:
        self.header = self.returned = self.slots = self.startup = None  # views first: the buffer cannot close under them
        self.segment.close()
        if self.rank == self.publisher:
            try:
                self.segment.unlink()
            except FileNotFoundError:
                pass
