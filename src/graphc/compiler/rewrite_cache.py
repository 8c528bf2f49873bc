"""Rewritten programs (capture, then passes), cached: a recompile that changes nothing they depend on
skips both, the larger part of a compile (a tiny preset's 8 programs: ~33 s of capture and ~21 s
of passes against seconds of emit).

An entry's key hashes what determines the rewritten program: graphc's and torch's versions, the
sources that capture and passes run (`sources.frontend_sources_digest`), the model (its args, dtype,
the weights' names, shapes and dtypes and how they are kept; not their values, which are graph
inputs), the bucket and the shapes fixed with it, the topology and the MoE choices, and the passes
that run. The entry is the program saved (`<key>.pt2`, what emit compiles from) and what the
manifest reads of it (`<key>.json`: the program's content digest, its pass log, its op counts and its
step inputs), each recorded with its sha256 like every cache entry (`emit`).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram

from graphc import __version__
from graphc.artifacts.manifest import TensorSpec
from graphc.compiler.emit import cache_dir, is_intact, program_digest, store_entry
from graphc.compiler.sources import frontend_sources_digest


@dataclass(frozen=True)
class Rewritten:
    """One bucket's rewritten program, as the cache holds it."""

    program: Path
    """The saved program (`torch.export.save`)."""
    digest: str
    """Its content (`emit.program_digest`): what the compiled file's key hashes."""
    passes: list[str]
    """What each pass changed (`PassLog.changes`)."""
    op_counts: dict[str, int]
    inputs: dict[str, TensorSpec]
    """Its step inputs, as the manifest records them."""


def rewrite_key(**determinants) -> str:
    """The cache key of a rewritten program from what determines it (reprs of args, bucket, ...)
    and the sources and versions every entry depends on."""
    parts = {"graphc": __version__, "torch": torch.__version__, "sources": frontend_sources_digest(),
             **{name: repr(value) for name, value in determinants.items()}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def weight_specs(weights: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    """The weights as a program sees them: names, shapes and dtypes (values are graph inputs)."""
    return [(name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in weights.items()]


def _folder() -> Path:
    folder = cache_dir() / "rewritten"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cached(key: str) -> Rewritten | None:
    """The entry of `key`, if the cache holds it whole."""
    program, summary = _folder() / f"{key}.pt2", _folder() / f"{key}.json"
    if not (is_intact(program) and is_intact(summary)):
        return None
    fields = json.loads(summary.read_text())
    inputs = {name: TensorSpec(list(shape), dtype) for name, (shape, dtype) in fields["inputs"].items()}
    return Rewritten(program, fields["digest"], fields["passes"], fields["op_counts"], inputs)


def store(key: str, program: ExportedProgram, passes: list[str], op_counts: dict[str, int],
          inputs: dict[str, TensorSpec]) -> Rewritten:
    """Save `program` and its summary as the entry of `key` (the program first: an entry is whole
    only once its summary is in place)."""
    from graphc.program_io import save_exported_program

    folder = _folder()
    entry = Rewritten(folder / f"{key}.pt2", program_digest(program), passes, op_counts, inputs)
    with tempfile.TemporaryDirectory(prefix=".graphc-rewrite-", dir=folder) as scratch:
        partial = Path(scratch) / "program.pt2"
        save_exported_program(program, partial)
        store_entry(partial, entry.program)
        summary = Path(scratch) / "summary.json"
        summary.write_text(json.dumps({"digest": entry.digest, "passes": passes, "op_counts": op_counts,
                                       "inputs": {name: [spec.shape, spec.dtype] for name, spec in inputs.items()}}))
        store_entry(summary, folder / f"{key}.json")
    return entry

