"""The compiler's side of the artifacts: weights files, the model fingerprint, the manifest.

Everything here writes into the staging directory of `graphc.artifacts.directory.atomic_directory`;
the runtime never imports it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphc import __version__
from graphc.artifacts.directory import sha256_file
from graphc.artifacts.manifest import (MANIFEST, BucketTable, ChatTemplate, GraphEntry, KVCacheInfo, Manifest,
                                       ModelInfo, RankEntry, RuntimeInfo, TensorSpec)
from graphc.artifacts.signing import SIGNATURE, sign
from graphc.buckets.selection import Bucket
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.models.step_model import ModelArgs
from graphc.step import blocks_per_row
from graphc.topology import Topology


@dataclass(frozen=True)
class WeightsFile:
    path: str
    """Relative to the artifacts directory."""
    sha256: str
    names: list[str]
    """The tensors in the order the graphs take them."""


@dataclass(frozen=True)
class CompiledGraph:
    """One bucket's graph (every rank's program) for one rank, as the emitter left it."""

    bucket: Bucket
    file: Path
    """The compiled file (in the compile cache)."""
    inputs: dict[str, TensorSpec]
    moe_form: str
    moe_exchange: str


def write_weights(tensors: dict[str, torch.Tensor], staging: Path) -> WeightsFile:
    """Write one rank's weights once under `weights/`, named by content."""
    folder = staging / "weights"
    folder.mkdir(exist_ok=True)
    partial = folder / "weights.partial"
    save_file({name: t.detach().contiguous() for name, t in tensors.items()}, partial, metadata={"format": "pt"})
    digest = sha256_file(partial)
    final = folder / f"{digest}.safetensors"
    partial.rename(final)
    return WeightsFile(f"weights/{final.name}", digest, list(tensors))


def write_weight_shapes(tensors: dict[str, torch.Tensor], staging: Path) -> WeightsFile:
    """For shapes-only artifacts: the names, shapes and dtypes of a rank's weights (no data), under
    `weights/`, named by content."""
    folder = staging / "weights"
    folder.mkdir(exist_ok=True)
    text = json.dumps([{"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for name, t in tensors.items()], indent=1)
    digest = hashlib.sha256(text.encode()).hexdigest()
    (folder / f"{digest}.shapes.json").write_text(text)
    return WeightsFile(f"weights/{digest}.shapes.json", digest, list(tensors))


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


def read_chat_template(checkpoint: Path) -> ChatTemplate | None:
    """The chat template of the checkpoint's tokenizer_config.json (its "default" one when it
    names several), with the bos / eos token strings templates use; None without one."""
    path = checkpoint / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphcError(f"{path}: not valid JSON ({e})") from None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is None:
        return None
    if not isinstance(template, str):
        raise GraphcError(f"{path}: chat_template must be a string or a list of named templates")

    def token(name: str) -> str:
        value = data.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else ""

    return ChatTemplate(template, token("bos_token"), token("eos_token"))


def write_manifest(staging: Path, config: GraphcConfig, backend: str, args: ModelArgs, sparse_probabilities: str | None,
                   topology: Topology, graphs: dict[int, list[CompiledGraph]], weights: dict[int, WeightsFile],
                   extra: dict, sign_key: Path | None, shapes_only: bool = False) -> Manifest:
    """Copy each distinct graph file and the tokenizer into `staging`, then write (and with
    `sign_key` sign) the manifest describing them. `graphs` and `weights` are by rank."""
    (staging / "graphs").mkdir(exist_ok=True)
    ranks = []
    for rank, compiled in graphs.items():
        entries = []
        for graph in compiled:
            name = f"graphs/{graph.file.name}"
            if not (staging / name).exists():
                shutil.copyfile(graph.file, staging / name)
            entries.append(GraphEntry(graph.bucket.kind, graph.bucket.size, graph.bucket.tokens_per_row, name,
                                      sha256_file(staging / name), graph.inputs, graph.moe_form,
                                      graph.moe_exchange))
        shard = weights[rank]
        coordinates = topology.coordinates(rank)
        ranks.append(RankEntry(rank, shard.path, shard.sha256, shard.names, entries, samples=bool(coordinates[2]),
                               coordinates=coordinates))
    tokenizer = config.model.checkpoint / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, staging / "tokenizer.json")
    b, kv, runtime = config.buckets, config.kv_cache, config.runtime
    manifest = Manifest(
        graphc_version=__version__,
        torch_version=str(torch.__version__),
        backend=backend,
        model_fingerprint=model_fingerprint(config.model.checkpoint),
        model=ModelInfo(args.architecture, args.vocab_size, list(args.eos_token_id), args.cache_layers, args.kv_cache_dim,
                        config.model.dtype, sparse_probabilities,
                        read_chat_template(config.model.checkpoint)),
        topology=topology,
        buckets=BucketTable(list(b.prefill), list(b.decode), b.prompt_as_decode, b.context_limit,
                            config.draft_tokens, runtime.prompt_logprobs),
        kv_cache=KVCacheInfo(kv.block_size, kv.num_blocks, blocks_per_row(b.context_limit, kv.block_size)),
        runtime=RuntimeInfo(runtime.max_num_prefilling_tokens, runtime.max_new_tokens, runtime.sampling,
                            runtime.prefix_caching),
        ranks=ranks,
        tokenizer="tokenizer.json" if tokenizer.is_file() else None,
        tokenizer_sha256=sha256_file(staging / "tokenizer.json") if tokenizer.is_file() else None,
        extra=extra,
        shapes_only=shapes_only,
    )
    (staging / MANIFEST).write_text(manifest.to_yaml())
    if sign_key is not None:
        (staging / SIGNATURE).write_bytes(sign((staging / MANIFEST).read_bytes(), sign_key))
    return manifest
