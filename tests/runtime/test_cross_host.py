"""The step channel across hosts, on real gloo ranks: two hosts of two ranks, each host its own
segment (here: its own name on one /dev/shm). Every rank gets every step intact, however many
hosts lie between it and the leader, and unpickles nothing; a replica leader's tokens come back
from either host."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.runtime.channel import StepChannel
from graphc.runtime.cross_host import CrossHostChannel, cross_host_groups
from graphc.runtime.hosts import HostLayout
from graphc.topology import Topology
from multirank import run_ranks

pytestmark = pytest.mark.multirank

LAYOUT = HostLayout(hosts=2, ranks_per_host=2)
WORLD, ROWS, WIDTH, BLOCKS = 4, 4, 8, 3
BUCKETS = [Bucket("prefill", 8), Bucket("decode", 4), Bucket("decode", 2, 3), Bucket("prefill", 5),
           Bucket("decode", 4), Bucket("decode", 1)]
SAMPLERS = (1, 2)
"""Ranks that return tokens: one on the leader's host, one on the other."""


def _fields(bucket: Bucket, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    rows, width = bucket.rows, bucket.width
    ints = lambda high, *shape: torch.randint(0, high, (WORLD, *shape), generator=g)  # noqa: E731
    return {"input_ids": ints(100, rows, width), "positions": ints(100, rows, width),
            "logits_index": ints(width, rows), "block_table": ints(9, rows, BLOCKS),
            "slot_mapping": ints(50, rows, width), "temperature": torch.rand(WORLD, rows, generator=g),
            "top_k": ints(50, rows), "top_p": torch.rand(WORLD, rows, generator=g), "seed": ints(2**40, rows)}


def _tokens(rank: int, step: int, rows: int) -> torch.Tensor:
    return torch.arange(rows) + 1000 * rank + 10 * step


def _counting_sends(rank: int) -> dict[str, int]:
    """Count what this rank sends between hosts (broadcasts it roots, point-to-point sends): the
    channel calls torch.distributed's, patched here, in this rank's own process."""
    import torch.distributed as dist

    counts = {"broadcast": 0, "send": 0}
    broadcast, send = dist.broadcast, dist.send

    def counted_broadcast(tensor, src, group=None):
        counts["broadcast"] += src == rank
        return broadcast(tensor, src=src, group=group)

    def counted_send(tensor, dst, group=None):
        counts["send"] += 1
        return send(tensor, dst=dst, group=group)

    dist.broadcast, dist.send = counted_broadcast, counted_send
    return counts


def _refusing_to_unpickle() -> None:
    """Make any unpickling of what a rank receives fail: the channel sends JSON, never pickles."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args, **kwargs):
        raise AssertionError("a rank unpickled what it received")

    dist.broadcast_object_list = c10d.broadcast_object_list = c10d._tensor_to_object = refuse


def _on_rank(rank, topology, names):
    groups = cross_host_groups(LAYOUT, timeout=30.0)
    _refusing_to_unpickle()
    sent = _counting_sends(rank)
    host_ranks = LAYOUT.ranks(LAYOUT.host_of(rank))
    local = StepChannel(names[LAYOUT.host_of(rank)], WORLD, ROWS, WIDTH, BLOCKS, rank, timeout=30.0,
                        publisher=host_ranks[0], readers=tuple(host_ranks[1:]))
    channel = CrossHostChannel(local, LAYOUT, groups)
    try:
        if rank == 0:
            channel.publish_startup({"kv_blocks": 64})
            returned = []
            for step, bucket in enumerate(BUCKETS):
                channel.publish(step, bucket, _fields(bucket, step))
                returned.append([channel.returned_tokens(step, r, bucket.rows).tolist() for r in SAMPLERS])
            channel.stop(len(BUCKETS))
            return returned, sent
        startup, step, intact = channel.receive_startup(), 0, []
        while (message := channel.receive(step)) is not None:
            bucket, fields = message
            expected = _fields(BUCKETS[step], step)
            intact.append(bucket == BUCKETS[step] and all(torch.equal(fields[k], expected[k]) for k in expected))
            if rank in SAMPLERS:
                channel.return_tokens(step, _tokens(rank, step, bucket.rows))
            step += 1
        return startup, intact, sent
    finally:
        channel.close()


def test_every_rank_on_either_host_gets_every_step_and_the_leader_every_replicas_tokens():
    names = [f"graphc-test-{uuid.uuid4().hex[:8]}-host{h}" for h in range(LAYOUT.hosts)]
    (returned, leader_sent), *followers = run_ranks(Topology(cp=WORLD), _on_rank, names)
    assert [(startup, intact) for startup, intact, _ in followers] == [({"kv_blocks": 64}, [True] * len(BUCKETS))] * 3
    assert returned == [[_tokens(r, step, b.rows).tolist() for r in SAMPLERS] for step, b in enumerate(BUCKETS)]
    # The record leaves the leader once a step (one broadcast to the other host's relay) and once to
    # stop, the start-up metadata twice (its size, then its JSON bytes); only the sampler on the other
    # host sends anything back, once a step.
    assert leader_sent == {"broadcast": 2 + len(BUCKETS) + 1, "send": 0}
    assert [sent for _, _, sent in followers] == [{"broadcast": 0, "send": 0}, {"broadcast": 0, "send": len(BUCKETS)},
                                                  {"broadcast": 0, "send": 0}]
    assert not any(Path("/dev/shm", name).exists() for name in names)
