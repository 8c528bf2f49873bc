"""The manifest's schema: every field typed and every value checked before the runtime uses one.

A manifest is input (artifacts travel between hosts), so `read_manifest` parses it strictly
(`graphc.typed.build`: unknown or missing keys and wrong types name their key path), then
checks what types cannot say: sizes positive, the topology and the rank list consistent, each
rank's graphs exactly the bucket table's, the KV layout derivable from the buckets, sampling
defaults in range, hashes well formed. Anything else is refused with a one-line ArtifactError
rather than failing later with a traceback. Torch-free.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from graphc.buckets.selection import all_buckets
from graphc.errors import GraphcError
from graphc.models.moe_forms import MOE_EXCHANGES, MOE_FORMS
from graphc.sampling import SAMPLING_RULES, sampling_error
from graphc.step import STEP_INPUTS, blocks_per_row
from graphc.typed import build

SHA256 = re.compile(r"[0-9a-f]{64}")
INPUT_DTYPES = {"float32", "bfloat16", "int64", "int32"}
"""The dtypes of a step's inputs (token ids, positions and tables int64; pool and sampler floats;
the rank's coordinates int32)."""


def parse_manifest(data: Any, manifest_type: type, error: type[GraphcError]):
    """`data` (the YAML) as a `manifest_type` (`graphc.artifacts.manifest.Manifest`), every value checked."""
    manifest = build(manifest_type, data, error)
    _check(manifest, error)
    return manifest


def _check(manifest, error: type[GraphcError]) -> None:
    model, topology, buckets, kv, runtime = (manifest.model, manifest.topology, manifest.buckets, manifest.kv_cache,
                                             manifest.runtime)
    positive = {
        "model.vocab_size": model.vocab_size, "model.cache_layers": model.cache_layers,
        "model.kv_cache_dim": model.kv_cache_dim,
        "buckets.context_limit": buckets.context_limit, "kv_cache.block_size": kv.block_size,
        "kv_cache.num_blocks": kv.num_blocks, "runtime.max_num_prefilling_tokens": runtime.max_num_prefilling_tokens,
        "runtime.max_new_tokens": runtime.max_new_tokens,
        **{f"buckets.prefill[{i}]": s for i, s in enumerate(buckets.prefill)},
        **{f"buckets.decode[{i}]": s for i, s in enumerate(buckets.decode)},
    }
    for key, value in positive.items():
        if value < 1:
            raise error(f"{key}: {value} must be a positive integer")
    if not buckets.prefill or not buckets.decode or buckets.prompt_as_decode < 0 or buckets.draft_tokens < 0:
        raise error(f"buckets: {dataclasses.asdict(buckets)} needs prefill and decode sizes, and prompt_as_decode "
                    "and draft_tokens >= 0")
    if kv.blocks_per_row != blocks_per_row(buckets.context_limit, kv.block_size):
        raise error(f"kv_cache.blocks_per_row: {kv.blocks_per_row} is not context_limit {buckets.context_limit} "
                    f"over block_size {kv.block_size}")
    if any(not 0 <= token < model.vocab_size for token in model.eos_token_id):
        raise error(f"model.eos_token_id: {model.eos_token_id} lies outside the vocabulary of {model.vocab_size}")
    for name in SAMPLING_RULES:
        problem = sampling_error(name, getattr(runtime.sampling, name))
        if problem:
            raise error(f"runtime.sampling.{name}: {problem}")
    if sorted(r.rank for r in manifest.ranks) != list(range(topology.world)):
        raise error(f"ranks: {[r.rank for r in manifest.ranks]} are not the ranks 0..{topology.world - 1}")
    table = sorted(all_buckets(buckets.prefill, buckets.decode, buckets.prompt_as_decode, buckets.draft_tokens,
                               buckets.prompt_logprobs),
                   key=lambda b: b.name)
    for rank in manifest.ranks:
        hashes = [rank.weights_sha256, *(g.sha256 for g in rank.graphs)]
        if not all(SHA256.fullmatch(h) for h in hashes):
            raise error(f"ranks[{rank.rank}]: a sha256 is not 64 lowercase hex digits")
        graphs = sorted((g.bucket for g in rank.graphs), key=lambda b: b.name)
        if graphs != table:
            raise error(f"ranks[{rank.rank}].graphs: buckets {[b.name for b in graphs]} are not the bucket table's "
                        f"{[b.name for b in table]}")
        for graph in rank.graphs:
            if tuple(graph.inputs) != STEP_INPUTS:
                raise error(f"ranks[{rank.rank}]: graph {graph.file}: inputs {list(graph.inputs)} are not the step's "
                            f"{list(STEP_INPUTS)}")
            dtypes = {spec.dtype for spec in graph.inputs.values()}
            if not dtypes <= INPUT_DTYPES:
                raise error(f"ranks[{rank.rank}]: graph {graph.file}: input dtypes {sorted(dtypes)} are not all of "
                            f"{', '.join(sorted(INPUT_DTYPES))}")
            if graph.moe_form not in MOE_FORMS:
                raise error(f"ranks[{rank.rank}]: graph {graph.file}: moe_form {graph.moe_form!r} is not one of "
                            f"{', '.join(MOE_FORMS)}")
            if graph.moe_exchange not in MOE_EXCHANGES:
                raise error(f"ranks[{rank.rank}]: graph {graph.file}: moe_exchange {graph.moe_exchange!r} is not one of "
                            f"{', '.join(MOE_EXCHANGES)}")
        expected = topology.coordinates(rank.rank)
        if rank.samples != bool(expected[2]):
            raise error(f"ranks[{rank.rank}].samples: {rank.samples}; the first rank of each replica samples")
        if rank.coordinates != expected:
            raise error(f"ranks[{rank.rank}].coordinates: {rank.coordinates} are not this topology's "
                        f"{expected} (cp rank, ep rank, samples)")
