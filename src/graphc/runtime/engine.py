"""The generation loop of one rank: scheduler -> step metadata -> precompiled graph -> tokens.

On one rank, `Engine.generate` does everything. With several ranks the leader (rank 0) runs
`generate`, publishing each step's host metadata (every rank's inputs) on the channel before
running its own graph; followers run `Engine.follow`, which takes each step from the channel and
runs the same bucket's graph on their shard. Followers never schedule or allocate; with
data-parallel replicas the first rank of each other replica samples its replica's rows and
returns the tokens over the channel.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from graphc.artifacts.manifest import Manifest
from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.runtime.channel import StepChannel
from graphc.runtime.loader import LoadedRank, load_rank
from graphc.runtime.paged import METADATA_FIELDS, step_metadata
from graphc.runtime.replicas import ReplicatedScheduler, scheduler_for
from graphc.runtime.scheduler import DraftStats, Emitted, Request, Result, Scheduler, Step
from graphc.sampling import sampler_inputs
from graphc.step import kv_pool_shape

__all__ = ["BucketStats", "Engine", "Request", "Result", "Session"]


@dataclass
class BucketStats:
    """Steps run in one bucket: how many, their real and padded tokens, and their wall time."""

    steps: int = 0
    tokens: int = 0
    padding: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, capacity: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.padding += capacity - tokens
        self.seconds += seconds


class Engine:
    """Serves requests from an artifacts directory; never compiles.

    Args:
        artifacts: a `graphc compile` output directory (verified before anything loads).
        rank: which rank's graphs and weights this process serves.
        channel: the leader -> followers channel; required when the artifacts have several ranks.
        manifest: the directory's manifest if the caller has already verified it.
        trusted_key: an Ed25519 public key (PEM): refuse artifacts it did not sign.
    """

    def __init__(self, artifacts: str | Path, rank: int = 0, channel: StepChannel | None = None,
                 manifest: Manifest | None = None, trusted_key: Path | None = None):
        self.loaded: LoadedRank = load_rank(Path(artifacts), rank, manifest, trusted_key)
        manifest = self.manifest = self.loaded.manifest
        self.rank, self.channel = rank, channel
        self.topology = manifest.topology
        self.world = self.topology.world
        if self.world > 1 and channel is None:
            raise GraphcError(
                f"{artifacts}: compiled for {self.world} ranks (dp={self.topology.dp}, cp={self.topology.cp}, "
                f"tp={self.topology.tp}, ep={self.topology.ep}); "
                "serve it with `graphc run`, which launches one process per rank"
            )
        self.steps = 0
        """Steps run so far, across `generate` calls: the channel's step numbers."""
        self.stats: dict[str, BucketStats] = {}
        """Per bucket name, what the leader's steps ran there (across `generate` calls)."""
        self.drafts: DraftStats | None = None
        """Speculative decoding's drafts verified and accepted in the last `generate` call."""
        model = manifest.model
        self.kv_pool = torch.zeros(kv_pool_shape(model.cache_layers, self.loaded.num_blocks,
                                                 manifest.kv_cache.block_size, model.kv_cache_dim),
                                   dtype=getattr(torch, model.dtype))
        self.coordinates = torch.tensor(self.loaded.rank.coordinates, dtype=torch.int32)
        """The rank's place in its groups: the one input that tells the shared graphs which rank runs them."""

    def startup_info(self) -> dict:
        """What every rank must agree on before serving (published once by the leader): the model
        too, as a host's copy of the artifacts may not be the leader's."""
        m = self.manifest
        return {"model_fingerprint": m.model_fingerprint, "buckets": dataclasses.asdict(m.buckets),
                "kv_blocks": self.loaded.num_blocks, "block_size": m.kv_cache.block_size}

    def run_bucket(self, bucket: Bucket, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One step of `bucket`'s graph on this rank's pool: its sampled tokens [B] and logits [B, V]
        (`graphc compare` reads the logits; serving, the tokens), then a score step's prompt scores
        (`graphc.step.SCORE_OUTPUTS`)."""
        return self.loaded.runners[bucket](self.loaded.weights, {"kv_pool": self.kv_pool,
                                                                 "coordinates": self.coordinates, **inputs})

    def _run(self, bucket: Bucket, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.run_bucket(bucket, inputs)

    def generate(self, requests: list[Request]) -> list[Result]:
        """Leader (or single rank): run every request to completion; results in request order."""
        session = self.session()
        indices = [session.scheduler.submit(request) for request in requests]
        while not session.idle:
            session.step()
        self.drafts = session.scheduler.drafts
        return [session.scheduler.results[i] for i in indices]

    def session(self) -> Session:
        """A scheduler over this engine's pool, for requests submitted at any time (leader only)."""
        return Session(self, scheduler_for(self.manifest, self.loaded.num_blocks))

    def _rank_inputs(self, step: Step) -> list[dict[str, torch.Tensor]]:
        """Every rank's step inputs, in rank order: its replica's rows (all padding for a replica
        without any), as its KV shard sees them (the ranks of a tp group share their cp shard's)."""
        bucket, per_rank = step.bucket, []
        for rows in step.by_replica():
            sequences = [(s.blocks, tokens, start) for s, tokens, start in rows]
            drafts = [0 if s.prefilling else len(tokens) - 1 for s, tokens, _ in rows]  # a decoding row's drafts
            sampling = sampler_inputs([s.request.sampling for s, _, _ in rows], [len(s.output) for s, _, _ in rows],
                                      bucket.rows)
            for shard in range(self.topology.cp):
                fields = step_metadata(sequences, bucket.width, self.manifest.kv_cache.blocks_per_row,
                                       total_rows=bucket.rows, shard=shard, drafts=drafts)
                per_rank += [{**dict(zip(METADATA_FIELDS, fields)), **sampling}] * self.topology.tp
        return per_rank

    def run_step(self, step: Step) -> list[int]:
        """Run one scheduled step (publishing it to the followers first); its rows' tokens, replica
        by replica."""
        return self.lead_step(step)[0]

    def lead_step(self, step: Step) -> tuple[list[int], torch.Tensor, tuple[torch.Tensor, ...]]:
        """`run_step`, also returning the leader's logits [B, V] (its replica's rows first, then
        padding): what `graphc compare` reads, on any number of ranks; and a score step's prompt
        scores (empty for other steps)."""
        started = time.perf_counter()
        inputs = self._rank_inputs(step)
        if self.channel is not None:
            self.channel.publish(self.steps, step.bucket, {name: torch.stack([rank[name] for rank in inputs])
                                                           for name in inputs[0]})
        with torch.no_grad():
            tokens, logits, *scores = self._run(step.bucket, inputs[0])
        replicas = step.by_replica()
        replica_tokens = [tokens[: len(replicas[0])]] + [
            self.channel.returned_tokens(self.steps, self.topology.replica_leader(replica), len(rows))
            for replica, rows in enumerate(replicas[1:], start=1)]
        self.steps += 1
        self.stats.setdefault(step.bucket.name, BucketStats()).add(
            sum(len(run) for _, run, _ in step.rows), step.bucket.rows * step.bucket.width * len(replicas),
            time.perf_counter() - started)
        return torch.cat(replica_tokens).tolist(), logits, tuple(scores)

    def stop_followers(self) -> None:
        """Leader: tell the followers no more steps will come."""
        self.channel.stop(self.steps)

    def follow(self) -> int:
        """Follower: run the leader's steps on this rank's shard until it stops; returns the step count."""
        with torch.no_grad():
            while (message := self.channel.receive(self.steps)) is not None:
                bucket, fields = message
                tokens = self._run(bucket, {name: values[self.rank] for name, values in fields.items()})[0]
                if self.loaded.rank.samples:  # the first rank of another replica: its tokens go to the leader
                    self.channel.return_tokens(self.steps, tokens)
                self.steps += 1
        return self.steps


@dataclass
class Session:
    """Requests in flight on the leader's engine: submit or cancel between steps, one step at a
    time (`Engine.generate` drives one to completion; `graphc serve` drives one from a thread)."""

    engine: Engine
    scheduler: Scheduler | ReplicatedScheduler

    @property
    def idle(self) -> bool:
        return self.scheduler.done

    def step(self) -> list[Emitted]:
        """Run the next step; the tokens it generated (and the results of requests it ended)."""
        step = self.scheduler.next_step()
        if step.wants_logits:
            return self.scheduler.complete(step, *self.engine.lead_step(step))
        return self.scheduler.complete(step, self.engine.run_step(step))
