"""Serving several ranks: one process per rank under torchrun's machinery (torch.distributed.launcher).

`serve` starts the job (the same elastic agent `torchrun --standalone` uses, so multi-node
launches take the same path) and returns the leader's results. Each worker:
1. claims its device from its local rank (`GRAPHC_LOCAL_DEVICE`; on CPU nothing is pinned,
   which would serialise host work), then presents itself to libraries as a one-device local
   world (LOCAL_RANK=0, LOCAL_WORLD_SIZE=1);
2. joins the gloo process group and registers its groups under fixed names;
3. opens the job's shared-memory channel (the leader creates it), agrees on the start-up
   metadata (ranks whose KV pool differs refuse to start), and serves: the leader schedules,
   samples and publishes each step, followers follow.
If any rank dies, the agent stops the others and `serve` raises naming the lost rank; the
launcher removes the channel's segment whatever happened.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

from graphc.artifacts.directory import read_manifest

from graphc.artifacts.manifest import Manifest
from graphc.errors import GraphcError, Interrupted
from graphc.runtime.channel import StepChannel, remove_segment
from graphc.runtime.engine import BucketStats, Engine
from graphc.runtime.loader import check_servable, kv_pool_blocks
from graphc.runtime.scheduler import Request, Result

FAULT_ENV = "GRAPHC_FAULT_INJECTION"
"""Testing hook, "RANK:STEP": that rank kills itself (SIGKILL) when it reaches that step."""


@dataclass
class BatchOutcome:
    """One batch's results, and what its steps ran in each bucket."""

    results: list[Result]
    stats: dict[str, BucketStats]


def generate_batch(engine: Engine, requests: list[Request]) -> BatchOutcome:
    """`engine.generate`, with the bucket statistics of this batch alone."""
    engine.stats = {}
    return BatchOutcome(engine.generate(requests), engine.stats)


@dataclass(frozen=True, kw_only=True)
class Job:
    """What the leader does with its engine (`lead`, returning the job's result) while the
    followers follow; picklable: with several ranks it travels to the leader's process."""

    follower_timeout: float | None = 120.0
    """How long a follower waits for the leader's next step (`StepChannel`)."""
    ends_on_signal: bool = False
    """Whether SIGTERM / SIGINT is the job's normal end (a server's) rather than an interruption."""
    shutdown_seconds: int = 30
    """How long the agent waits for the ranks to exit after a signal before killing them."""

    def lead(self, engine: Engine):
        raise NotImplementedError


@dataclass(frozen=True)
class BatchesJob(Job):
    """What the leader of a `graphc run` job does: run each batch in turn."""

    batches: list[list[Request]]

    def lead(self, engine: Engine) -> list[BatchOutcome]:
        return [generate_batch(engine, batch) for batch in self.batches]


def _worker(artifacts: str, job, channel_name: str, trusted_key: str | None):
    import torch
    import torch.distributed as dist

    from graphc.ops.distributed import register_groups

    for signum in (signal.SIGINT, signal.SIGTERM):
        # An interrupt reaches every rank (the terminal signals the whole process group): exit
        # quietly, the launcher reports it once and removes the channel's segment. A job that ends
        # on a signal (a server) ignores it here: its leader drains, then stops the followers.
        signal.signal(signum, signal.SIG_IGN if job.ends_on_signal else lambda signum, frame: os._exit(128 + signum))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    os.environ.update(GRAPHC_LOCAL_DEVICE=str(local_rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    _arm_fault_injection(rank)
    dist.init_process_group("gloo")
    engine = None
    try:
        manifest = read_manifest(Path(artifacts), trusted_key)  # every rank verifies what it loads
        register_groups(manifest.topology.topology(), rank)
        engine = open_engine(artifacts, manifest, rank, channel_name, job.follower_timeout)
        dist.barrier()
        if rank == 0:
            try:
                outcomes = job.lead(engine)
            finally:
                engine.stop_followers()
        else:
            engine.follow()
        dist.barrier()  # before teardown: gloo can abort at exit otherwise (docs/platform.md)
    finally:
        if engine is not None:
            engine.channel.close()
        dist.destroy_process_group()
    if job.ends_on_signal:
        # The agent, stopping on the signal, never reads a return value, and a worker that
        # returns waits for it to be read: it would sit there until the agent kills it.
        os._exit(0)
    return outcomes if rank == 0 else None


def open_engine(artifacts: str, manifest: Manifest, rank: int, channel_name: str,
                timeout: float | None = 120.0) -> Engine:
    """This rank's engine on the job's step channel, once it agrees with the leader on the
    start-up metadata (bucket table, prompt-as-decode size, context limit, KV pool).

    Raises:
        GraphcError: this follower's serving parameters differ from the leader's.
    """
    world = manifest.topology.world
    buckets = manifest.buckets
    channel = StepChannel(channel_name, world, max_rows=max(buckets.decode),
                          max_width=max(*buckets.prefill, buckets.prompt_as_decode),
                          blocks_per_row=manifest.kv_cache.blocks_per_row, rank=rank, timeout=timeout)
    try:
        engine = Engine(artifacts, rank=rank, channel=channel, manifest=manifest)  # manifest verified by the caller
        if rank == 0:
            channel.publish_startup(engine.startup_info())
        elif (leader := channel.receive_startup()) != engine.startup_info():
            raise GraphcError(f"rank {rank} disagrees with the leader on the serving parameters: leader {leader}, "
                              f"this rank {engine.startup_info()} (is GRAPHC_NUM_KV_BLOCKS set the same for every rank?)")
    except BaseException:
        channel.close()
        raise
    return engine


def _arm_fault_injection(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    target, step = (int(v) for v in spec.split(":"))
    if target != rank:
        return
    original = Engine._run

    calls = itertools.count(1)

    def run_then_die(self, bucket, inputs):
        if next(calls) > step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, bucket, inputs)

    Engine._run = run_then_die


def serve(artifacts: Path, batches: list[list[Request]], manifest: Manifest | None = None,
          trusted_key: Path | None = None, verbose: bool = False, monitor_interval: float = 0.5) -> list[BatchOutcome]:
    """Run each batch of requests in turn (one `generate` each) and return the leader's results
    and bucket statistics per batch: `graphc run`'s and `graphc sweep`'s one way to serve.

    Artifacts for one rank run in this process; for several, one process per rank is started
    once for all the batches (torchrun's agent). `manifest`: already read (and verified) by the
    caller; otherwise read here, refusing with `trusted_key` artifacts that key did not sign.
    `verbose` lets the elastic agent's own log lines through (by default only graphc's one-line
    errors show).

    Raises:
        GraphcError: a rank failed (named), after every other rank was stopped.
    """
    return run_job(artifacts, BatchesJob(batches), manifest, trusted_key, verbose, monitor_interval)


def run_job(artifacts: Path, job: Job, manifest: Manifest | None = None, trusted_key: Path | None = None,
            verbose: bool = False, monitor_interval: float = 0.5):
    """`job.lead(engine)`'s result: in this process for one rank, under `launch_ranks` for several
    (the arguments as `serve`'s)."""
    manifest = manifest or read_manifest(artifacts, trusted_key)
    check_servable(Path(artifacts), manifest)  # before any rank starts
    if manifest.topology.world == 1:
        return job.lead(Engine(artifacts, manifest=manifest))
    kv_pool_blocks(manifest)  # GRAPHC_NUM_KV_BLOCKS checked here, not once per rank after start-up
    return launch_ranks(Path(artifacts), job, manifest.topology.world, monitor_interval, trusted_key, verbose)


def launch_ranks(artifacts: Path, job, world: int, monitor_interval: float = 0.5, trusted_key: Path | None = None,
                 verbose: bool = False):
    """One process per rank under torchrun's agent: rank 0 runs `job.lead(engine)` (its return is
    this function's), the others follow its steps.

    Raises:
        GraphcError: a rank failed (named), after every other rank was stopped.
        Interrupted: SIGINT / SIGTERM stopped the job (unless `job.ends_on_signal`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = uuid.uuid4().hex[:16]
    channel_name = f"graphc-{run_id}"  # job-unique: two jobs on one host never collide
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=run_id, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=monitor_interval,
                          start_method="spawn", shutdown_timeout=job.shutdown_seconds)
    try:
        with _agent_logs(verbose):
            outputs = elastic_launch(config, _worker)(str(artifacts), job, channel_name,
                                                      None if trusted_key is None else str(trusted_key))
    except SignalException as e:  # the agent stopped every rank before raising
        if job.ends_on_signal:
            return None
        raise Interrupted(e.sigval) from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        reason = f"exit code {failure.exitcode}" + (f" (signal {-failure.exitcode})" if failure.exitcode < 0 else "")
        message = (failure.message or {}).get("message", "") if isinstance(failure.message, dict) else ""
        detail = f": {message.splitlines()[-1]}" if message else ""
        raise GraphcError(f"rank {rank} failed with {reason}{detail}; the other ranks were stopped") from None
    finally:
        remove_segment(channel_name)  # the leader unlinks it; if it died first, nobody did
    return outputs[0]


@contextlib.contextmanager
def _agent_logs(verbose: bool):
    """Keep the elastic agent's warnings and errors (worker start, signals, failures with their
    tracebacks) off the terminal unless `verbose`: `serve` reports a failure in one line."""
    prefix = "torch.distributed.elastic"
    # Its modules' loggers carry levels of their own: quieten each, not only their parent.
    loggers = [logging.getLogger(name) for name in [prefix, *logging.root.manager.loggerDict] if name.startswith(prefix)]
    levels = [logger.level for logger in loggers]
    if not verbose:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
