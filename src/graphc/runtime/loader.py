"""Load a verified artifacts directory: weights and one shape-checked runner per bucket."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch
from safetensors.torch import load_file

from graphc.artifacts.directory import read_manifest
from graphc.artifacts.manifest import GraphContext, GraphEntry, Manifest, RankEntry
from graphc.backends import BACKENDS, backend
from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.runtime.prefix_cache import prefix_caching_enabled
import graphc.ops  # noqa: F401  (graphs call graphc:: ops: register them before loading)
from graphc.step import kv_pool_shape

NUM_KV_BLOCKS_ENV = "GRAPHC_NUM_KV_BLOCKS"


class GraphRunner:
    """One bucket's graph; checks every input against the compiled shapes before the call (a
    static AOTInductor package silently accepts a wrong shape and returns garbage)."""

    def __init__(self, entry: GraphEntry, call: Callable, num_blocks: int):
        self.bucket = entry.bucket
        self.call = call
        self.shapes = {name: tuple(num_blocks if s == -1 else s for s in spec.shape)
                       for name, spec in entry.inputs.items()}
        self.dtypes = {name: getattr(torch, spec.dtype) for name, spec in entry.inputs.items()}

    def __call__(self, weights: list[torch.Tensor], inputs: dict[str, torch.Tensor]):
        for name, shape in self.shapes.items():
            tensor = inputs[name]
            if tuple(tensor.shape) != shape or tensor.dtype != self.dtypes[name]:
                raise GraphcError(f"{self.bucket.name}: input {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"the graph was compiled for {shape} {self.dtypes[name]}")
        return self.call(weights, [inputs[name] for name in self.shapes])


@dataclass
class LoadedRank:
    manifest: Manifest
    rank: RankEntry
    weights: list[torch.Tensor]
    runners: dict[Bucket, GraphRunner]
    num_blocks: int


def check_servable(artifacts: Path, manifest: Manifest) -> None:
    """Refuse shapes-only artifacts (programs without weights), and a GRAPHC_PREFIX_CACHING that is
    neither 0 nor 1, before anything starts."""
    if manifest.shapes_only:
        raise GraphcError(f"{artifacts}: compiled shapes-only (from a config.json without weights): nothing to serve; "
                          "compile the checkpoint with its weights to run it")
    prefix_caching_enabled(manifest.runtime.prefix_caching)


def kv_pool_blocks(manifest: Manifest) -> int:
    """The pool size: the manifest's, unless GRAPHC_NUM_KV_BLOCKS overrides it."""
    override = os.environ.get(NUM_KV_BLOCKS_ENV)
    blocks = manifest.kv_cache.num_blocks
    fixed = backend(manifest.backend).fixed_pool
    if override is not None and fixed and override.strip() != str(blocks):
        raise GraphcError(f"{NUM_KV_BLOCKS_ENV}={override!r}: {manifest.backend} artifacts fix the pool at "
                          f"compile time (kv_cache.num_blocks {blocks}); unset it, or recompile with another "
                          "kv_cache.num_blocks")
    if override is not None:
        try:
            blocks = int(override)
        except ValueError:
            raise GraphcError(f"{NUM_KV_BLOCKS_ENV}={override!r} is not an integer") from None
    needed = manifest.kv_cache.blocks_per_row + int(fixed)  # and the scratch block, where there is one
    source = NUM_KV_BLOCKS_ENV if override is not None else "kv_cache.num_blocks"
    if blocks < max(needed, 2):
        raise GraphcError(
            f"{source}={blocks}: the pool must hold "
            f"one sequence of context_limit {manifest.buckets.context_limit} ({needed} blocks of "
            f"{manifest.kv_cache.block_size}, and at least 2)"
        )
    model = manifest.model
    pool_bytes = (math.prod(kv_pool_shape(model.cache_layers, blocks, manifest.kv_cache.block_size,
                                          model.kv_cache_dim)) * getattr(torch, model.dtype).itemsize)
    available = psutil.virtual_memory().available
    if pool_bytes > available:
        raise GraphcError(f"{source}={blocks}: a pool of {pool_bytes / 2**30:.1f} GiB exceeds this host's "
                          f"{available / 2**30:.1f} GiB of available memory; use fewer blocks")
    return blocks


def load_rank(artifacts: Path, rank: int = 0, manifest: Manifest | None = None,
              trusted_key: Path | None = None) -> LoadedRank:
    """Verify the whole directory (unless given its already verified `manifest`; its signature
    under `trusted_key` when given), then load one rank's weights and graphs."""
    artifacts = Path(artifacts)
    manifest = manifest or read_manifest(artifacts, trusted_key)
    check_servable(artifacts, manifest)
    if not backend(manifest.backend).serves_here:
        raise GraphcError(f"{artifacts}: backend {manifest.backend!r} cannot run on this host; "
                          f"runnable here: {', '.join(name for name, b in BACKENDS.items() if b.serves_here)}")
    entry = next((r for r in manifest.ranks if r.rank == rank), None)
    if entry is None:
        raise GraphcError(f"{artifacts}: no rank {rank} (world size {len(manifest.ranks)})")
    num_blocks = kv_pool_blocks(manifest)
    stored = load_file(artifacts / entry.weights)  # mapped, not read: pages load as the graphs touch them
    if sorted(entry.weight_names) != sorted(stored):
        # The graphs take exactly the file's tensors, in the manifest's order.
        differ = sorted(set(entry.weight_names) ^ set(stored)) or ["(a name listed twice)"]
        raise GraphcError(f"{artifacts}: rank {rank}'s weight_names are not the tensors of {entry.weights} "
                          f"({len(entry.weight_names)} listed, {len(stored)} stored; e.g. {differ[0]}); recompile")
    weights = [stored[name] for name in entry.weight_names]
    load = backend(manifest.backend).graph_loader()
    collectives = manifest.topology.world > 1
    runners = {}
    for graph in entry.graphs:
        call = load(artifacts / graph.file, collectives, GraphContext(manifest, entry, graph, weights))
        runner = GraphRunner(graph, call, num_blocks)
        runners[runner.bucket] = runner
    return LoadedRank(manifest, entry, weights, runners, num_blocks)
