"""`compile()`: the ordered stages from model.yaml to an artifacts directory, nothing else."""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import struct
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphc import __version__
from graphc.artifact import (MANIFEST, GraphEntry, Manifest, RankEntry, TensorSpec, atomic_directory, check_replaceable,
                             sha256_file)
from graphc.buckets import all_buckets
from graphc.capture import POOL_BLOCKS_DIM, STEP_INPUTS, capture_bucket, model_weights
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.emit import CompileJob, cache_dir, compile_all, program_key
from graphc.models.checkpoint import load_model, load_model_args
from graphc.models.deepseek_v3 import DeepseekV3, Parallelism
from graphc.moe_forms import step_moe_form
from graphc.passes.dead_code_elimination import dead_code_elimination
from graphc.passes.inline_reference_kernels import inline_reference_kernels
from graphc.passes.lower_matvecs import lower_matvecs
from graphc.passes.lower_trivial_collectives import lower_trivial_collectives
from graphc.passes.manager import PassContext, PassManager, op_counts
from graphc.passes.specialise_rank import specialise_rank
from graphc.passes.strip_follower_sampling import strip_follower_sampling
from graphc.passes.verifier import collective_sequence, step_placeholders, verify
from graphc.passes.verify_bucket_shapes import verify_bucket_shapes
from graphc.signing import SIGNATURE, private_key, sign
from graphc.topology import Topology

SPECIALISE = [
    # First: nothing should build on a graph captured with the wrong shapes.
    ("verify_bucket_shapes", verify_bucket_shapes),
    # The rank's own KV shard and experts (captures carry rank 0's).
    ("specialise_rank", specialise_rank),
    # Followers take the leader's tokens instead of sampling.
    ("strip_follower_sampling", strip_follower_sampling),
    # Groups of one rank move no data: backends never see a no-op collective.
    ("lower_trivial_collectives", lower_trivial_collectives),
    # CPU backends: KV write and attention as compiled ATen ops, not Python kernels per layer.
    ("inline_reference_kernels", inline_reference_kernels),
    # Inductor: one-row linear layers (decode at batch 1, the LM head) as reductions that stream
    # the weight near the memory bandwidth; after inlining, so it sees every linear of the step.
    ("lower_matvecs", lower_matvecs),
    # Last: sweep what the rewrites above left unused.
    ("dead_code_elimination", dead_code_elimination),
]
"""Per-rank, per-bucket specialisation, in order (see passes/README.md)."""

BACKEND_SPECIFIC = {"inline_reference_kernels": ("export", "inductor"), "lower_matvecs": ("inductor",)}
"""Passes that only some backends run; the others keep the op for their own lowering."""

CAPTURE_CHOICES = {
    "static_moe": "with ep > 1, capture the static MoE form (no token dispatch, an all-reduce over the EP "
                  "group) since every rank holds the same tokens; disabled, the generic all-gather / "
                  "reduce-scatter form",
}
"""Rewrites decided at capture because they change shapes (capture.py says why); `--disable-pass`
takes their names like a pass's."""


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


def check_options(out: Path, options: CompileOptions) -> None:
    """Fail fast, before any work, on options that cannot succeed."""
    names = [*CAPTURE_CHOICES, *(n for n, _ in SPECIALISE)]
    unknown = sorted(options.disabled_passes - set(names))
    if unknown:
        raise GraphcError(f"--disable-pass {unknown[0]}: no such pass; passes: {', '.join(names)}")
    check_replaceable(Path(out), options.force)
    if options.sign_key is not None:
        private_key(options.sign_key)  # a key that cannot sign fails before any work
    cache_dir()  # a GRAPHC_CACHE_DIR that cannot be a cache fails here, not after the capture


def compile(config: GraphcConfig, out: Path, options: CompileOptions = CompileOptions()) -> Manifest:
    check_options(out, options)
    backend = options.backend or config.backend
    topology = Topology(config.topology.cp, config.topology.ep)
    b, kv = config.buckets, config.kv_cache
    blocks_per_row = -(-b.context_limit // kv.block_size)
    with atomic_directory(out, options.force) as staging:
        # 1. Model: expert-parallel rank 0's module (every rank's when ep = 1); the other shards
        # are loaded one at a time when their weights are written (step 4).
        model = _expert_shard(config, topology, 0)
        # 2. Capture: one rank-agnostic program per bucket, with what changes shapes fixed.
        parallel = Parallelism(cp=topology.cp, ep=topology.ep,
                               tokens_replicated=topology.ep > 1 and "static_moe" not in options.disabled_passes)
        buckets = all_buckets(b.prefill, b.decode, b.prompt_as_decode)
        args, sparse_probabilities = model.args, model.sparse_probabilities
        moe_forms = {bucket: step_moe_form(config.model.moe_form, bucket.rows * bucket.width, args.num_experts_per_tok,
                                           args.n_routed_experts, topology.ep, parallel.tokens_replicated)
                     for bucket in buckets}
        captured = {bucket: capture_bucket(model, bucket, blocks_per_row, kv.num_blocks, kv.block_size, parallel,
                                           moe_forms[bucket])
                    for bucket in buckets}
        # 3. Specialise each program for each rank.
        passes = backend_passes(backend)
        manager = PassManager(passes, verify, verify=options.verify_passes,
                              disabled=options.disabled_passes & {name for name, _ in passes},
                              dump_dir=options.dump_graphs)
        jobs, entries, pass_logs, programs = [], {}, {}, {}
        for rank in range(topology.world):
            for bucket, capture in captured.items():
                # Every rank specialises its own copy; the capture stays rank-agnostic.
                program = copy_program(capture) if topology.world > 1 else capture
                ctx = PassContext(topology, rank, bucket, blocks_per_row)
                log = manager.run(program.graph_module, ctx)
                _sync_output_signature(program)
                key = program_key(program, backend)
                jobs.append(CompileJob(f"{bucket.name} rank {rank}", key, program))
                entries[rank, bucket] = (key, _step_specs(program), op_counts(program.graph_module))
                programs[rank, bucket] = program
                pass_logs[f"{bucket.name} rank {rank}"] = log.changes()
        _check_rank_agreement(programs, buckets, topology)
        # 4. Emit: compile each distinct program once (cached), then lay out the artifacts.
        compiled = compile_all(jobs, backend, options.workers, options.show_progress)
        (staging / "graphs").mkdir()
        (staging / "weights").mkdir()
        # One shard's weights in memory at a time: write rank 0's, drop it, then load, write and
        # drop each other's (the captured programs hold no weights).
        weights = {0: _write_weights(model, staging / "weights")}
        del model
        for ep_rank in range(1, topology.ep):
            weights[ep_rank] = _write_weights(_expert_shard(config, topology, ep_rank), staging / "weights")
        ranks = []
        for rank in range(topology.world):
            graphs = []
            for bucket in buckets:
                key, inputs, _ = entries[rank, bucket]
                name = f"graphs/{compiled[key].name}"
                if not (staging / name).exists():
                    shutil.copyfile(compiled[key], staging / name)
                graphs.append(GraphEntry(bucket.kind, bucket.size, bucket.tokens_per_row, name, sha256_file(staging / name),
                                         inputs, moe_forms[bucket]))
            weights_file, weights_sha, weight_names = weights[topology.ep_rank(rank)]
            ranks.append(RankEntry(rank, weights_file, weights_sha, weight_names, graphs, samples=rank == 0))
        tokenizer = config.model.checkpoint / "tokenizer.json"
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
        manifest = Manifest(
            graphc_version=__version__,
            torch_version=str(torch.__version__),
            backend=backend,
            model_fingerprint=model_fingerprint(config.model.checkpoint),
            model={"vocab_size": args.vocab_size, "eos_token_id": list(args.eos_token_id),
                   "num_hidden_layers": args.num_hidden_layers, "kv_cache_dim": args.kv_cache_dim,
                   "dtype": config.model.dtype,
                   **({"sparse_probabilities": sparse_probabilities} if args.sparse_attention else {})},
            topology={"cp": topology.cp, "ep": topology.ep, "world": topology.world},
            buckets={"prefill": list(b.prefill), "decode": list(b.decode),
                     "prompt_as_decode": b.prompt_as_decode, "context_limit": b.context_limit},
            kv_cache={"block_size": kv.block_size, "num_blocks": kv.num_blocks, "blocks_per_row": blocks_per_row},
            runtime={"max_num_prefilling_tokens": config.runtime.max_num_prefilling_tokens,
                     "max_new_tokens": config.runtime.max_new_tokens,
                     "sampling": asdict(config.runtime.sampling)},
            ranks=ranks,
            tokenizer="tokenizer.json" if tokenizer.is_file() else None,
            tokenizer_sha256=sha256_file(staging / "tokenizer.json") if tokenizer.is_file() else None,
            extra={"op_counts": {f"{bucket.name} rank {rank}": counts
                                 for (rank, bucket), (_, _, counts) in entries.items()},
                   "passes": pass_logs},
        )
        (staging / MANIFEST).write_text(manifest.to_yaml())
        if options.sign_key is not None:
            (staging / SIGNATURE).write_bytes(sign((staging / MANIFEST).read_bytes(), options.sign_key))
    return manifest


def backend_passes(backend: str) -> list:
    """The SPECIALISE passes `backend` runs, in order."""
    return [(name, run) for name, run in SPECIALISE if backend in BACKEND_SPECIFIC.get(name, (backend,))]


def _check_rank_agreement(programs, buckets, topology: Topology) -> None:
    """Every rank of a bucket must issue the same collectives, in the same order, on the same
    groups with the same shapes, or the job hangs; refuse to emit graphs that would not."""
    for bucket in buckets:
        sequences = {rank: collective_sequence(programs[rank, bucket].graph_module) for rank in range(topology.world)}
        for rank, sequence in sequences.items():
            if sequence != sequences[0]:
                raise GraphcError(f"{bucket.name}: rank {rank} would issue collectives {sequence} but rank 0 "
                                  f"{sequences[0]}; the ranks would deadlock")


def _expert_shard(config: GraphcConfig, topology: Topology, ep_rank: int) -> DeepseekV3:
    """The model of one expert-parallel rank: the module holding its experts (all when ep = 1)."""
    experts = load_model_args(config.model.checkpoint).n_routed_experts
    return load_model(config.model.checkpoint, dtype=getattr(torch, config.model.dtype),
                      experts=topology.experts(ep_rank, experts), sparse_probabilities=config.model.sparse_probabilities)


def copy_program(capture: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A deep copy for passes to edit (each rank's, `graphc probe`'s) without touching `capture`."""
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


def _write_weights(model, folder: Path) -> tuple[str, str, list[str]]:
    """Write the rank's weights once, named by content; returns (relative path, sha256, order)."""
    tensors = {name: t.detach().contiguous() for name, t in model_weights(model).items()}
    partial = folder / "weights.partial"
    save_file(tensors, partial, metadata={"format": "pt"})
    digest = sha256_file(partial)
    final = folder / f"{digest}.safetensors"
    partial.rename(final)
    return f"weights/{final.name}", digest, list(tensors)


def model_fingerprint(checkpoint: Path) -> str:
    """sha256 of config.json and every safetensors file's header and size.

    Headers hold every tensor's name, dtype, shape and offsets; hashing them (not the data) keeps
    fingerprinting fast on multi-hundred-GB checkpoints.
    """
    digest = hashlib.sha256((checkpoint / "config.json").read_bytes())
    for path in sorted(checkpoint.glob("*.safetensors")):
        with open(path, "rb") as f:
            header_length = struct.unpack("<Q", f.read(8))[0]
            digest.update(path.name.encode())
            digest.update(f.read(header_length))
        digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()
