"""The leader -> followers shared-memory step channel, in one process (two endpoints)."""

from __future__ import annotations

import _posixshmem
import os
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.runtime.channel import READY, ChannelTimeout, StepChannel

WORLD, ROWS, WIDTH, BLOCKS = 2, 4, 8, 3
PREFILL_8 = Bucket("prefill", 8)


@pytest.fixture
def endpoints():
    name = f"graphc-test-{uuid.uuid4().hex[:12]}"
    leader = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=0, timeout=2.0)
    follower = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=1, timeout=2.0)
    yield leader, follower
    follower.close()
    leader.close()
    assert not Path(f"/dev/shm/{name}").exists(), "the leader must unlink its segment"


def _fields(rows, width, seed):
    """Every rank's inputs (they differ, as replicas' do), fp32 sampling parameters included."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (WORLD, rows, width), generator=g),
        "positions": torch.randint(0, 100, (WORLD, rows, width), generator=g),
        "logits_index": torch.randint(0, width, (WORLD, rows), generator=g),
        "block_table": torch.randint(0, 9, (WORLD, rows, BLOCKS), generator=g),
        "slot_mapping": torch.randint(-2, 50, (WORLD, rows, width), generator=g),
        "temperature": torch.rand(WORLD, rows, generator=g) * 2,
        "top_k": torch.randint(0, 50, (WORLD, rows), generator=g),
        "top_p": torch.rand(WORLD, rows, generator=g),
        "seed": torch.randint(0, 2**40, (WORLD, rows), generator=g),
    }


def test_startup_metadata_round_trips(endpoints):
    leader, follower = endpoints
    leader.publish_startup({"kv_blocks": 64, "buckets": {"prefill": [8, 32]}})
    assert follower.receive_startup() == {"kv_blocks": 64, "buckets": {"prefill": [8, 32]}}


def test_steps_of_every_shape_arrive_intact_then_stop(endpoints):
    leader, follower = endpoints
    buckets = [Bucket("prefill", 8), Bucket("decode", 4), Bucket("decode", 2, 3), Bucket("prefill", 5)]
    for step, bucket in enumerate(buckets):
        fields = _fields(bucket.rows, bucket.width, step)
        leader.publish(step, bucket, fields)
        got_bucket, got = follower.receive(step)
        assert got_bucket == bucket
        for name, tensor in fields.items():
            assert torch.equal(got[name], tensor), name
    leader.stop(len(buckets))
    assert follower.receive(len(buckets)) is None


def test_the_leader_never_overwrites_a_slot_a_follower_has_not_read(endpoints):
    leader, follower = endpoints
    leader.publish(0, PREFILL_8, _fields(1, 8, 0))
    leader.publish(1, PREFILL_8, _fields(1, 8, 1))  # the other slot: fine
    with pytest.raises(ChannelTimeout, match=r"rank 0: timed out .* waiting for followers to read step 0"):
        leader.publish(2, PREFILL_8, _fields(1, 8, 2))  # would overwrite step 0's slot
    follower.receive(0)
    leader.publish(2, PREFILL_8, _fields(1, 8, 2))


def test_a_replica_leaders_tokens_reach_the_leader_and_it_waits_for_them(endpoints):
    leader, follower = endpoints
    with pytest.raises(ChannelTimeout, match=r"rank 0: timed out .* waiting for rank 1's tokens of step 0"):
        leader.returned_tokens(0, rank=1, rows=3)
    follower.return_tokens(0, torch.tensor([7, 8, 9, 10]))
    assert leader.returned_tokens(0, rank=1, rows=3).tolist() == [7, 8, 9]
    follower.return_tokens(1, torch.tensor([4]))
    assert leader.returned_tokens(1, rank=1, rows=1).tolist() == [4]


def test_a_follower_waiting_for_a_dead_leader_times_out_naming_itself(endpoints):
    _, follower = endpoints
    with pytest.raises(ChannelTimeout, match=r"rank 1: timed out after 2 s waiting for step 0 from the leader"):
        follower.receive(0)


def _mark_ready(descriptor: int) -> None:
    """Do what the leader does last once its header is set: write READY in the header's last word."""
    os.pwrite(descriptor, READY.to_bytes(8, sys.byteorder, signed=True), 8 * (3 + 2 * WORLD))


def test_a_follower_attaching_before_the_leader_sized_the_segment_waits_for_it():
    """The leader's segment exists empty between its shm_open and its ftruncate: a follower that
    maps it then must wait, not fail (seen in CI: "cannot mmap an empty file")."""
    name = f"graphc-test-{uuid.uuid4().hex[:12]}"
    descriptor = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    sized = threading.Timer(0.2, lambda: (os.ftruncate(descriptor, 1 << 20), _mark_ready(descriptor)))
    sized.start()
    try:
        follower = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=1, timeout=5.0)
        assert follower.segment.size >= 1 << 20
        follower.segment.close()
    finally:
        sized.join()
        os.close(descriptor)
        _posixshmem.shm_unlink("/" + name)


def test_a_follower_never_attaches_before_the_leader_has_set_the_header():
    """A new segment is all zeros until the leader sets its header, and zeros read as "step 0
    published, start-up metadata of 0 bytes": a follower that attached then ran garbage and the
    leader timed out waiting for it (seen in CI, as a 30 s gloo timeout in the cross-host test)."""
    name = f"graphc-test-{uuid.uuid4().hex[:12]}"
    descriptor = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(descriptor, 1 << 20)
        with pytest.raises(ChannelTimeout, match="never appeared"):
            StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=1, timeout=0.3)
        _mark_ready(descriptor)
        follower = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=1, timeout=0.3)
        follower.segment.close()
    finally:
        os.close(descriptor)
        _posixshmem.shm_unlink("/" + name)


def test_a_stale_segment_of_the_same_name_is_replaced():
    name = f"graphc-test-{uuid.uuid4().hex[:12]}"
    first = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=0)
    first.publish_startup({"run": 1})
    second = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=0)  # a crashed run's leftover
    follower = StepChannel(name, WORLD, ROWS, WIDTH, BLOCKS, rank=1, timeout=0.5)
    with pytest.raises(ChannelTimeout):
        follower.receive_startup()  # the new segment has no start-up yet: the old one is gone
    for channel in (follower, second):
        channel.close()
    first.segment.close()


KILLED_LAUNCHER = """
import multiprocessing, os, sys
from multiprocessing import shared_memory
from graphc.runtime.launch import named_semaphores

with named_semaphores():  # as the agent's queues and events are made
    lock = multiprocessing.get_context("spawn").Lock()
segment = shared_memory.SharedMemory(name=f"graphc-{os.getpid()}-{sys.argv[1]}", create=True, size=64)
print(os.getpid(), flush=True)
sys.stdin.read()
"""


def test_what_a_killed_launcher_left_is_swept_and_what_a_live_one_holds_is_not():
    """A launcher killed with its whole process group (its resource tracker too) leaves its
    segment and semaphores, named after it: the next sweep removes them; a live launcher's stay."""
    import signal
    import subprocess
    import sys

    from graphc.runtime.channel import SHM, sweep_stale

    run = uuid.uuid4().hex[:16]
    launcher = subprocess.Popen([sys.executable, "-c", KILLED_LAUNCHER, run], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid = int(launcher.stdout.readline())
    left = sorted(p.name for p in SHM.glob(f"*graphc-{pid}-*"))
    assert f"graphc-{pid}-{run}" in left and any(name.startswith(f"sem.mp-graphc-{pid}-") for name in left), left
    assert not set(left) & set(sweep_stale())  # still alive: nothing of it is touched
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    live = StepChannel(f"graphc-{os.getpid()}-{run}", WORLD, ROWS, WIDTH, BLOCKS, rank=0, timeout=2.0)
    try:
        assert set(left) <= set(sweep_stale())
        assert not list(SHM.glob(f"*graphc-{pid}-*"))
        assert Path(f"/dev/shm/graphc-{os.getpid()}-{run}").exists()  # this process is alive: its segment stays
    finally:
        live.close()
