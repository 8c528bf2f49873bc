"""Serving several ranks: one process per rank under torchrun's machinery (torch.distributed.launcher).

`serve` starts the job (the same elastic agent `torchrun --standalone` uses, so multi-node
launches take the same path) and returns the leader's results. Each worker:
1. claims its device from its local rank (`GRAPHC_LOCAL_DEVICE`; on CPU nothing is pinned,
   which would serialise host work), then presents itself to libraries as a one-device local
   world (LOCAL_RANK=0, LOCAL_WORLD_SIZE=1);
2. joins the gloo process group, agrees with the leader on the artifacts (`serving_identity`: a
   rank of another topology would hang in the next step), and registers its groups under fixed names;
3. opens the job's shared-memory channel (the leader creates it), agrees on the start-up
   metadata (ranks whose KV pool differs refuse to start), and serves: the leader schedules,
   samples and publishes each step, followers follow.
If any rank dies, the agent stops the others and `serve` raises naming the lost rank; the
launcher removes the channel's segment whatever happened, and sweeps at start what killed
launchers left (segments and semaphores named after a launcher that is gone).

A job that spans hosts (`HostOptions`: one command per host) runs the same way on each host under
`HostRendezvous`, every host's launcher verifying the artifacts before it joins; each host has
its own segment and the leader's steps reach the other hosts through `CrossHostChannel`. A lost
host (or one that never joins) is named by every host that remains, within `LOST_SECONDS`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from graphc.artifacts.directory import read_manifest

from graphc.artifacts.manifest import Manifest
from graphc.errors import GraphcError, Interrupted
from graphc.runtime.channel import StepChannel, remove_segment, sweep_stale
from graphc.runtime.cross_host import CrossHostChannel, broadcast_json, cross_host_groups
from graphc.runtime.engine import BucketStats, Engine
from graphc.runtime.hosts import HostLayout, HostOptions
from graphc.runtime.loader import check_servable, kv_pool_blocks
from graphc.runtime.rendezvous import RUN_ID, HostRendezvous
from graphc.runtime.scheduler import DraftStats, Request, Result

FAULT_ENV = "GRAPHC_FAULT_INJECTION"
"""Testing hook, "RANK:STEP": that rank kills itself (SIGKILL) when it reaches that step."""


@dataclass
class BatchOutcome:
    """One batch's results, and what its steps ran in each bucket."""

    results: list[Result]
    stats: dict[str, BucketStats]
    drafts: DraftStats


def generate_batch(engine: Engine, requests: list[Request]) -> BatchOutcome:
    """`engine.generate`, with the bucket statistics (and drafts) of this batch alone."""
    engine.stats = {}
    return BatchOutcome(engine.generate(requests), engine.stats, engine.drafts)


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


def _worker(artifacts: str, job, channel_name: str, trusted_key: str | None, layout: HostLayout):
    import torch
    import torch.distributed as dist

    from graphc.ops.distributed import register_groups

    for signum in (signal.SIGINT, signal.SIGTERM):
        # An interrupt reaches every rank (the terminal signals the whole process group): exit
        # quietly, the launcher reports it once and removes the channel's segment. A job that ends
        # on a signal (a server) ignores it here: its leader drains, then stops the followers.
        signal.signal(signum, signal.SIG_IGN if job.ends_on_signal else lambda signum, frame: os._exit(128 + signum))
    # The launcher prints the job's results; a rank's standard output is only what native
    # libraries write there (XLA's gloo names its peers on it), which would interleave with them.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    os.environ.update(GRAPHC_LOCAL_DEVICE=str(local_rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    _arm_fault_injection(rank)
    dist.init_process_group("gloo")
    engine = None
    try:
        manifest = read_manifest(Path(artifacts), trusted_key)  # every rank verifies what it loads
        agree_on_artifacts(manifest, rank)  # before the groups: ranks of other topologies would hang there
        register_groups(manifest.topology, rank)
        groups = cross_host_groups(layout, job.follower_timeout) if layout.hosts > 1 else None
        engine = open_engine(artifacts, manifest, rank, channel_name, job.follower_timeout, layout, groups)
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
    if job.ends_on_signal and layout.host_of(rank) == 0:
        # The agent, stopping on the signal, never reads a return value, and a worker that
        # returns waits for it to be read: it would sit there until the agent kills it. Other
        # hosts' agents got no signal: they read it, and see their ranks succeed. os._exit skips
        # the exit handlers, which release what the rank holds (a device runtime's nrt_close):
        # they run first, as at a normal exit.
        atexit._run_exitfuncs()
        os._exit(0)
    return outcomes if rank == 0 else None


def serving_identity(manifest: Manifest) -> dict[str, object]:
    """What every rank's artifacts must agree on to serve as one job, as flat `section.field`
    values (JSON's): the whole manifest (versions, backend, fingerprint, model, topology, buckets
    with draft tokens, KV pool, tokenizer) but for compile-time notes (`extra`) and the leader's
    own request defaults (`runtime`); the chat template and the per-rank tables (their coordinates,
    weight names, each graph's inputs and MoE exchange; not file names or hashes, which another
    compile of the same config may not reproduce) as digests, so the whole stays a few KB."""
    data = dataclasses.asdict(manifest)
    del data["extra"], data["runtime"]
    data["model"]["chat_template"] = _digest(data["model"]["chat_template"])
    data["ranks"] = _digest([{**{k: v for k, v in rank.items() if k not in ("weights", "weights_sha256")},
                              "graphs": [{k: v for k, v in graph.items() if k not in ("file", "sha256")}
                                         for graph in rank["graphs"]]} for rank in data["ranks"]])
    return _flat(json.loads(json.dumps(data)))


def _digest(value) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_agreement(rank: int, leader: dict[str, object], ours: dict[str, object], hint: str) -> None:
    """Refuse (naming the fields, then `hint`) a rank whose start-up metadata is not the leader's.

    Raises:
        GraphcError: one line naming each differing field with both values.
    """
    differ = [key for key in [*ours, *(k for k in leader if k not in ours)] if leader.get(key) != ours.get(key)]
    if not differ:
        return
    named = "; ".join(f"{key}: {ours.get(key)!r} here, {leader.get(key)!r} on the leader" for key in differ[:3])
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    raise GraphcError(f"rank {rank} disagrees with the leader on the serving parameters: {named}{more}; {hint}")


def agree_on_artifacts(manifest: Manifest, rank: int) -> None:
    """The leader's `serving_identity`, sent to every rank (over the default group: no collective
    that depends on the topology has run yet); a rank whose artifacts differ refuses.

    Raises:
        GraphcError: this rank's artifacts differ from the leader's (the fields named).
    """
    ours = serving_identity(manifest)
    leader = broadcast_json(rank, ours if rank == 0 else None)
    check_agreement(rank, leader, ours, "every host must serve the same compile's artifacts")


def open_engine(artifacts: str, manifest: Manifest, rank: int, channel_name: str,
                timeout: float | None = 120.0, layout: HostLayout | None = None, groups=None) -> Engine:
    """This rank's engine on the job's step channel, once it agrees with the leader on the
    start-up metadata (bucket table, KV pool as sized at run time; the artifacts themselves were
    agreed on by `agree_on_artifacts`). `layout`: the job's hosts (default: one); `groups`:
    `cross_host_groups` where there are several.

    Raises:
        GraphcError: this follower's serving parameters differ from the leader's (named).
    """
    world = manifest.topology.world
    layout = layout or HostLayout(1, world)
    buckets = manifest.buckets
    host_ranks = layout.ranks(layout.host_of(rank))
    channel = StepChannel(channel_name, world, max_rows=max(buckets.decode),
                          max_width=buckets.widest,
                          blocks_per_row=manifest.kv_cache.blocks_per_row, rank=rank, timeout=timeout,
                          publisher=host_ranks[0], readers=tuple(host_ranks[1:]),
                          returned_width=buckets.returned_width)
    if layout.hosts > 1:
        channel = CrossHostChannel(channel, layout, groups)
    try:
        engine = Engine(artifacts, rank=rank, channel=channel, manifest=manifest)  # manifest verified by the caller
        info = _flat(json.loads(json.dumps(engine.startup_info())))
        if rank == 0:
            channel.publish_startup(info)
        else:
            check_agreement(rank, channel.receive_startup(), info,
                            "GRAPHC_NUM_KV_BLOCKS must be set alike for every rank")
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
          trusted_key: Path | None = None, verbose: bool = False, monitor_interval: float = 0.5,
          hosts: HostOptions = HostOptions()) -> list[BatchOutcome] | None:
    """Run each batch of requests in turn (one `generate` each) and return the leader's results
    and bucket statistics per batch: `graphc run`'s and `graphc sweep`'s one way to serve.

    Artifacts for one rank run in this process; for several, one process per rank is started
    once for all the batches (torchrun's agent). `manifest`: already read (and verified) by the
    caller; otherwise read here, refusing with `trusted_key` artifacts that key did not sign.
    `verbose` lets the elastic agent's own log lines through (by default only graphc's one-line
    errors show). `hosts`: this host's part of a job that spans hosts; on any host but the
    leader's (host 0) the result is None.

    Raises:
        GraphcError: a rank failed, or a host was lost (named), after every other rank was stopped.
    """
    return run_job(artifacts, BatchesJob(batches), manifest, trusted_key, verbose, monitor_interval, hosts)


def run_job(artifacts: Path, job: Job, manifest: Manifest | None = None, trusted_key: Path | None = None,
            verbose: bool = False, monitor_interval: float = 0.5, hosts: HostOptions = HostOptions()):
    """`job.lead(engine)`'s result: in this process for one rank, under `launch_ranks` for several
    (the arguments as `serve`'s)."""
    manifest = manifest or read_manifest(artifacts, trusted_key)
    check_servable(Path(artifacts), manifest)  # before any rank starts (on every host, before it joins)
    world = manifest.topology.world
    hosts.layout(world)  # host options that do not fit the artifacts: refused before anything starts
    if world == 1:
        return job.lead(Engine(artifacts, manifest=manifest))
    kv_pool_blocks(manifest)  # GRAPHC_NUM_KV_BLOCKS checked here, not once per rank after start-up
    return launch_ranks(Path(artifacts), job, world, monitor_interval, trusted_key, verbose, hosts)


def launch_ranks(artifacts: Path, job, world: int, monitor_interval: float = 0.5, trusted_key: Path | None = None,
                 verbose: bool = False, hosts: HostOptions = HostOptions()):
    """One process per rank under torchrun's agent (this host's ranks, with `hosts`): rank 0
    runs `job.lead(engine)` (its return is this function's, None on other hosts), the others
    follow its steps.

    Raises:
        GraphcError: a rank failed, or a host was lost or never joined (named), after every other
            rank was stopped.
        Interrupted: SIGINT / SIGTERM stopped the job (unless `job.ends_on_signal`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    layout = hosts.layout(world)
    run_id = uuid.uuid4().hex[:16]
    sweep_stale()
    # Job-unique (two jobs on one host never collide), and after this launcher, for `sweep_stale`.
    channel_name = f"graphc-{os.getpid()}-{run_id}"
    config, rendezvous = _launch_config(layout, hosts, run_id, monitor_interval, job.shutdown_seconds)
    try:
        with _agent_logs(verbose), named_semaphores():
            outputs = elastic_launch(config, _worker)(str(artifacts), job, channel_name,
                                                      None if trusted_key is None else str(trusted_key), layout)
    except SignalException as e:  # the agent stopped every rank before raising
        _leave(rendezvous, "ok" if job.ends_on_signal else f"stopped by {signal.Signals(e.sigval).name}")
        if job.ends_on_signal:
            return None
        raise Interrupted(e.sigval) from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        reason = f"exit code {failure.exitcode}" + (f" (signal {-failure.exitcode})" if failure.exitcode < 0 else "")
        message = (failure.message or {}).get("message", "") if isinstance(failure.message, dict) else ""
        detail = f": {message.splitlines()[-1]}" if message else ""
        failed = f"rank {rank} failed with {reason}{detail}"
        lost = rendezvous.watch.verdict() if rendezvous is not None and rendezvous.watch else None
        _leave(rendezvous, lost or failed)
        raise GraphcError(f"{lost or failed}; the other ranks were stopped") from None
    except BaseException as e:
        _leave(rendezvous, str(e) or type(e).__name__)
        raise
    finally:
        remove_segment(channel_name)  # the leader unlinks it; if it died first, nobody did
    _leave(rendezvous, "ok", agent_exited_normally=True)
    return outputs.get(0)


def _launch_config(layout: HostLayout, hosts: HostOptions, run_id: str, monitor_interval: float,
                   shutdown_seconds: int):
    """torchrun's agent configuration for this host, and the hosts' rendezvous (None on one host)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig

    common = dict(nproc_per_node=layout.ranks_per_host, max_restarts=0, monitor_interval=monitor_interval,
                  start_method="spawn", shutdown_timeout=shutdown_seconds)
    if layout.hosts == 1:
        return LaunchConfig(min_nodes=1, max_nodes=1, run_id=run_id, rdzv_backend="c10d",
                            rdzv_endpoint="localhost:0", **common), None
    backend = f"graphc-{run_id}"  # the agent builds its handler by name: this one, ours
    rendezvous = HostRendezvous(hosts, layout, backend, on_lost=lambda _: _stop_local_ranks())
    rendezvous_handler_registry.register(backend, lambda params: rendezvous)
    return LaunchConfig(min_nodes=layout.hosts, max_nodes=layout.hosts, run_id=RUN_ID, rdzv_backend=backend,
                        rdzv_endpoint=hosts.endpoint, **common), rendezvous


def _stop_local_ranks() -> None:
    """Another host is lost: kill this host's ranks (the agent then reports them failed, and the
    launcher names the lost host). A rank may be idle, waiting for a step that will never come."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if "resource_tracker" in " ".join(child.cmdline()):
                continue  # multiprocessing's, this process's own: it unlinks what the ranks leave
            for process in [*child.children(recursive=True), child]:
                process.kill()


def _leave(rendezvous: HostRendezvous | None, reason: str, agent_exited_normally: bool = False) -> None:
    if rendezvous is not None:
        rendezvous.leave(reason, agent_exited_normally)


@contextlib.contextmanager
def named_semaphores():
    """Name the semaphores multiprocessing makes meanwhile (the agent's, for its workers' queues
    and events) after this process, so that a later launcher's `sweep_stale` can remove them
    should this one be killed; multiprocessing's own names are random."""
    config = multiprocessing.current_process()._config
    before = config["semprefix"]
    config["semprefix"] = f"/mp-graphc-{os.getpid()}"
    try:
        yield
    finally:
        config["semprefix"] = before


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
