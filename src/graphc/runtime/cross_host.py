"""The step channel of a job whose ranks span hosts (`StepChannel`'s interface, so the engine
does not know how many hosts there are).

Within a host the ranks share one shared-memory segment as on one host. Between hosts the
leader sends each step's record once per host, to that host's relay (its first rank), with one
gloo broadcast over the group {leader, relays}; the relay republishes it on its host's segment
and runs it like any follower. A broadcast rather than a connection of graphc's own: gloo is
already every rank's transport, it carries the fixed-size record without serialising it, and a
peer that dies fails it at once (its socket closes). Tokens sampled by a replica leader on
another host come back to the leader point to point, over a group of every rank (never the
groups the graphs' collectives run on). Start-up metadata goes the same way as a step, once, as
JSON bytes: nothing a relay receives is unpickled (`broadcast_object_list` would unpickle it).
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.runtime.channel import STARTUP_BYTES, StepChannel, rows_of
from graphc.runtime.hosts import HostLayout

STEP, STOP = 0, 1
"""A record's first word: a step follows, or no step `step` or later will come."""
IDLE_FOREVER = timedelta(days=365)
"""A server's relays wait for the next step as long as it takes (gloo needs some timeout)."""


def cross_host_groups(layout: HostLayout, timeout: float | None):
    """(the leader and each host's relay, every rank): the channel's groups. Every rank must call
    it, in the same order (new_group is collective)."""
    wait = IDLE_FOREVER if timeout is None else timedelta(seconds=timeout)
    relays = dist.new_group([layout.first_rank(h) for h in range(layout.hosts)], timeout=wait)
    everyone = dist.new_group(list(range(layout.hosts * layout.ranks_per_host)), timeout=wait)
    return relays, everyone


def broadcast_json(rank: int, info: dict | None, group=None) -> dict:
    """Rank 0's `info` (of at most STARTUP_BYTES as JSON) on every rank of `group`: sent as its size,
    then its bytes; never pickled, as `broadcast_object_list` would."""
    if rank == 0:
        data = torch.frombuffer(bytearray(json.dumps(info).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()]), src=0, group=group)
        dist.broadcast(data, src=0, group=group)
        return info
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if not 0 < int(size) <= STARTUP_BYTES:  # sized before anything is allocated for it
        raise GraphcError(f"rank {rank}: the leader's start-up metadata is {int(size)} bytes; "
                          f"at most {STARTUP_BYTES} are expected")
    data = torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return json.loads(data.numpy().tobytes())


class CrossHostChannel:
    """`local`: this host's segment (its publisher the leader on host 0, the relay elsewhere)."""

    def __init__(self, local: StepChannel, layout: HostLayout, groups):
        self.local, self.layout = local, layout
        self.rank = local.rank
        self.relays, self.everyone = groups
        self.host = layout.host_of(self.rank)
        self.is_relay = self.rank == layout.first_rank(self.host) and self.host != 0
        self._record = torch.zeros(2 + local.slot_words, dtype=torch.int64)
        self._tokens = torch.zeros(local.max_rows * local.returned_width, dtype=torch.int64)

    # -- start-up ---------------------------------------------------------------------------

    def publish_startup(self, info: dict) -> None:
        self.local.publish_startup(info)  # refuses metadata larger than STARTUP_BYTES
        broadcast_json(0, info, self.relays)

    def receive_startup(self) -> dict:
        if not self.is_relay:
            return self.local.receive_startup()
        info = broadcast_json(self.rank, None, self.relays)
        self.local.publish_startup(info)
        return info

    # -- steps ------------------------------------------------------------------------------

    def publish(self, step: int, bucket: Bucket, fields: dict[str, torch.Tensor]) -> None:
        self.local.publish(step, bucket, fields)
        self._record[:2] = torch.tensor([STEP, step])
        self._record[2:] = torch.from_numpy(self.local.published_words(step))
        dist.broadcast(self._record, src=0, group=self.relays)

    def receive(self, step: int) -> tuple[Bucket, dict[str, torch.Tensor]] | None:
        if self.is_relay:
            dist.broadcast(self._record, src=0, group=self.relays)
            kind, sent = (int(v) for v in self._record[:2])
            if kind == STOP:
                self.local.stop(sent)
            else:
                if sent != step:  # the record's order is the channel's contract: never skip or repeat one
                    raise RuntimeError(f"rank {self.rank}: the leader sent step {sent}, step {step} was due")
                self.local.republish(step, self._record[2:].numpy())
        return self.local.receive(step)

    def stop(self, step: int) -> None:
        self.local.stop(step)
        self._record[:2] = torch.tensor([STOP, step])
        dist.broadcast(self._record, src=0, group=self.relays)

    # -- tokens of other replicas -----------------------------------------------------------

    def return_tokens(self, step: int, tokens: torch.Tensor) -> None:
        if self.host == 0:
            self.local.return_tokens(step, tokens)
            return
        self._tokens[: tokens.numel()] = tokens.flatten()
        dist.send(self._tokens, dst=0, group=self.everyone)

    def returned_tokens(self, step: int, rank: int, rows: int) -> torch.Tensor:
        if self.layout.host_of(rank) == 0:
            return self.local.returned_tokens(step, rank, rows)
        dist.recv(self._tokens, src=rank, group=self.everyone)  # in step order: one message a step
        return rows_of(self._tokens[: rows * self.local.returned_width].clone(), self.local.returned_width)

    def close(self) -> None:
        self.local.close()
