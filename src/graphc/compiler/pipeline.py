"""`compile()`: the ordered stages from model.yaml to an artifacts directory, nothing else."""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from graphc.artifacts.directory import atomic_directory, check_replaceable
from graphc.artifacts.manifest import Manifest, TensorSpec
from graphc.artifacts.signing import private_key
from graphc.artifacts.writer import CompiledGraph, write_manifest, write_weight_shapes, write_weights
from graphc.backends import backend as backend_named
from graphc.compiler.capture import capture_bucket, model_weights
from graphc.compiler import rewrite_cache
from graphc.compiler.emit import CompileJob, cache_dir, compile_all, program_key
from graphc.compiler.rewrite_cache import rewrite_key, weight_specs
from graphc.config import GraphcConfig
from graphc.weights.abstract import abstract_shard
from graphc.weights.checkpoint import (QUANTIZED_WEIGHTS, check_checkpoint, default_sparse_probabilities, holds_weights,
                                      load_rank_shard)
from graphc.models.moe_forms import step_moe_form
from graphc.models.step_model import Parallelism
from graphc.passes.collective_schedule import check_collective_schedule, program_collectives
from graphc.passes.graph import step_placeholders
from graphc.passes.manager import PassContext, PassManager, op_counts
from graphc.passes.registry import backend_passes, check_pass_names
from graphc.passes.verifier import verify
from graphc.step import POOL_BLOCKS_DIM, STEP_INPUTS, blocks_per_row


@dataclass(frozen=True)
class CompileOptions:
    backend: str | None = None
    """Overrides model.yaml's backend."""
    disabled_passes: frozenset[str] = frozenset()
    dump_graphs: Path | None = None
    verify_passes: bool = False
    workers: int = max(1, min(4, os.cpu_count() or 1))
    force: bool = False
    show_progress: bool = True
    sign_key: Path | None = None
    """An Ed25519 private key (PEM): sign the manifest (`manifest.sig`), which covers every file."""
    shapes_only: bool = False
    """Compile with abstract weights (no weight bytes read or held) even where the checkpoint has
    them; a checkpoint of config.json alone always compiles so."""


def check_options(config: GraphcConfig, out: Path, options: CompileOptions) -> None:
    """Fail fast, before any work, on options that cannot succeed."""
    check_pass_names(options.disabled_passes)
    check_backend_topology(options.backend or config.backend, config, "static_moe" not in options.disabled_passes)
    check_replaceable(Path(out), options.force)
    if options.sign_key is not None:
        private_key(options.sign_key)  # a key that cannot sign fails before any work
    cache_dir()  # a GRAPHC_CACHE_DIR that cannot be a cache fails here, not after the capture


def compile(config: GraphcConfig, out: Path, options: CompileOptions = CompileOptions(),
            on_checked: Callable[[], None] = lambda: None) -> Manifest:
    """Compile `config` into the artifacts directory `out` (written atomically); `on_checked` is
    called once the options pass `check_options`, before any work (the CLI echoes the resolved
    config there). One function on purpose: its numbered stages read top to bottom as the
    pipeline; each is a call elsewhere."""
    check_options(config, out, options)
    on_checked()
    backend = options.backend or config.backend
    topology = config.topology
    exchange, stand_in_note = backend_named(backend).exchange(config.model.moe_lowering, topology,
                                                              "static_moe" not in options.disabled_passes)
    b, kv = config.buckets, config.kv_cache
    table_width = blocks_per_row(b.context_limit, kv.block_size)
    dtype = getattr(torch, config.model.dtype)
    as_stored = config.model.weights == "as-stored"
    draft_tokens = config.draft_tokens
    draft_layers = config.model_args.draft_layers  # the draft layers it serves (`config.model.speculative`)
    shapes_only = options.shapes_only or not holds_weights(config.model.checkpoint)
    with atomic_directory(out, options.force) as staging:
        # 1. Model: rank 0's module (its routed experts and tensor-parallel slice; every rank's
        # when ep = tp = 1); the other weight shards are loaded one at a time when their weights
        # are written (step 5). Shapes-only: the module on the meta device, its weights fake tensors.
        if shapes_only:
            model, weights = abstract_shard(config.model_args, config.model.checkpoint, dtype, as_stored, topology.ep,
                                            config.model.sparse_probabilities or default_sparse_probabilities(dtype),
                                            topology.tp)
        else:
            checked = check_checkpoint(config.model.checkpoint, draft_layers)  # read once, for every shard
            model = load_rank_shard(config.model.checkpoint, topology, 0, dtype, config.model.sparse_probabilities,
                                    as_stored, draft_layers, checked)
            weights = model_weights(model)
        args = model.args
        sparse_probabilities = model.sparse_probabilities if args.sparse_attention else None
        # 2-3. Capture one rank-agnostic program per bucket, with what changes shapes fixed, and
        # rewrite it (passes/registry.py): one whatever the world, the rank's coordinates being an
        # input (`graphc.backends`); then check that no rank's collectives can wait forever on
        # another's. Both skipped for a program the cache holds (`rewrite_cache`), unless the
        # passes' graphs are to be dumped.
        parallel = Parallelism(cp=topology.cp, ep=topology.ep, moe_exchange=exchange)
        buckets = config.compiled_buckets
        fuses_gather = backend_named(backend).fuses_gather
        moe_forms = {bucket: step_moe_form(config.model.moe_form, bucket.rows * bucket.width, args.num_experts_per_tok,
                                           args.n_routed_experts, topology.ep, exchange, fuses_gather)
                     for bucket in buckets}
        passes = backend_passes(backend)
        manager = PassManager(passes, verify, verify=options.verify_passes,
                              disabled=options.disabled_passes & {name for name, _ in passes},
                              dump_dir=options.dump_graphs)
        model_key = {"args": args, "dtype": dtype, "weights": weight_specs(weights),
                     "kept_as_stored": getattr(model, QUANTIZED_WEIGHTS, {}),
                     "sparse_probabilities": getattr(model, "sparse_probabilities", None), "draft_tokens": draft_tokens}
        rewritten = {}
        for bucket in buckets:
            key = rewrite_key(**model_key, bucket=bucket, table_width=table_width, kv_cache=kv, parallel=parallel,
                              moe_form=moe_forms[bucket], topology=topology, backend=backend,
                              passes=[name for name, _ in passes if name not in manager.disabled])
            entry = None if options.dump_graphs else rewrite_cache.cached(key)
            if entry is None:
                program = capture_bucket(model, bucket, table_width, kv.num_blocks, kv.block_size, parallel,
                                         moe_forms[bucket], weights, draft_tokens)
                log = manager.run(program.graph_module, PassContext(topology, bucket, table_width)).changes()
                _sync_output_signature(program)
                issued = program_collectives(program.graph_module)
                check_collective_schedule(topology, bucket.name, dict.fromkeys(range(topology.world), issued))
                entry = rewrite_cache.store(key, program, log, op_counts(program.graph_module), _step_specs(program))
                del program
            rewritten[bucket] = entry
        # 4. Emit: compile each distinct program once (cached); every rank's entry points at its
        # bucket's file.
        keys = {bucket: program_key(entry.digest, backend, topology) for bucket, entry in rewritten.items()}
        compiled = compile_all([CompileJob(bucket.name, keys[bucket], entry.program) for bucket, entry in rewritten.items()],
                               backend, topology, options.workers, options.show_progress)
        graphs = {rank: [CompiledGraph(bucket, compiled[keys[bucket]], rewritten[bucket].inputs,
                                       moe_forms[bucket], exchange)
                         for bucket in buckets]
                  for rank in range(topology.world)}
        extra = {"op_counts": {bucket.name: entry.op_counts for bucket, entry in rewritten.items()},
                 "passes": {bucket.name: entry.passes for bucket, entry in rewritten.items()},
                 **backend_named(backend).extras(),
                 **({"notes": [stand_in_note]} if stand_in_note else {})}
        # 5. Weights, one shard (`Topology.weight_shard`: routed experts, tensor-parallel slice) in
        # memory at a time: rank 0's, then each other's, loaded, written and dropped (the captured
        # programs hold no weights). Shapes-only: their shapes, which every shard shares.
        shard_of = {rank: (0, 0) if shapes_only else topology.weight_shard(rank) for rank in range(topology.world)}
        shards = {shard_of[0]: (write_weight_shapes if shapes_only else write_weights)(weights, staging)}
        del model, weights
        for rank, shard_key in shard_of.items():
            if shard_key not in shards:
                shard = load_rank_shard(config.model.checkpoint, topology, rank, dtype,
                                        config.model.sparse_probabilities, as_stored, draft_layers, checked)
                shards[shard_key] = write_weights(model_weights(shard), staging)
                del shard
        # 6. Manifest: graphs, weights and tokenizer by hash, signed on request.
        return write_manifest(staging, config, backend, args, sparse_probabilities, topology, graphs,
                              {rank: shards[shard_of[rank]] for rank in range(topology.world)},
                              extra, options.sign_key, shapes_only)


def check_backend_topology(backend: str, config: GraphcConfig, static_enabled: bool) -> None:
    """Refuse what is not built yet: what the model family does not take (`Family.check_compile`:
    its backends, data-parallel attention, MoE exchanges) with the exchange the backend compiles
    (`Backend.exchange`: every backend compiles every lowering, some through a stand-in)."""
    topology = config.topology
    exchange, _ = backend_named(backend).exchange(config.model.moe_lowering, topology, static_enabled)
    config.family.check_compile(config.model_args, topology, exchange, backend)


def copy_program(capture: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A deep copy for passes to edit (each program's, `graphc probe`'s) without touching `capture`."""
    with warnings.catch_warnings():
        # torch 2.13's own pytree specs warn about themselves when deep-copied; nothing to act on.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        return copy.deepcopy(capture)


def _sync_output_signature(program) -> None:
    """Point the program's output specs at the graph's output nodes (a pass may replace them)."""
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    for spec, node in zip(program.graph_signature.output_specs, outputs):
        spec.arg.name = node.name


def _step_specs(program) -> dict[str, TensorSpec]:
    specs = {}
    for name, node in step_placeholders(program.graph_module).items():
        value = node.meta["val"]
        shape = [-1 if (name == "kv_pool" and d == POOL_BLOCKS_DIM) else int(s) for d, s in enumerate(value.shape)]
        specs[name] = TensorSpec(shape, str(value.dtype).removeprefix("torch."))
    assert list(specs) == list(STEP_INPUTS)
    return specs
