"""Emit: compile each distinct rewritten program once, cache the results.

A compiled file's key is the sha256 of what determines it: the backend, the graphc and torch
versions and the sources its compiler runs (`sources.emit_sources_digest`: a lowering changed
without a version bump, as in a checkout, compiles again; an edit elsewhere does not), the topology
(a backend may name its groups' ranks in the program: neuron's replica groups), the backend's
toolchain (neuron's: whether programs get NEFFs) and the program's content (`program_digest`: its
code, signature, constants and the shapes and dtypes of every node). Weights are graph inputs, so
they are not part of the key. Compiled files live in a content-addressed cache (`GRAPHC_CACHE_DIR`,
default `~/.cache/graphc`), beside the rewritten programs they are compiled from
(`rewrite_cache`), so an unchanged graph is never compiled twice, across buckets, ranks and runs.
Misses compile in parallel worker processes.

The cache is written atomically inside itself (temporary files in the cache directory, then a
rename: never across filesystems) and each entry's sha256 is recorded beside it when written; an
entry is reused only while its content still has that hash, else it is compiled again. That
catches corruption and files dropped into the cache, not a writer who also forges the record:
the cache directory must be writable only by those trusted to compile (docs/security.md).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.export import ExportedProgram

from graphc import __version__
from graphc.artifacts.directory import sha256_file
from graphc.backends import backend as backend_named, compile_program
from graphc.compiler.sources import emit_sources_digest
from graphc.errors import GraphcError
from graphc.topology import Topology


@dataclass(frozen=True)
class CompileJob:
    label: str
    """What the progress bar shows, e.g. `decode-4 rank 0`."""
    key: str
    """The compiled file's key (`program_key`)."""
    program: Path
    """The rewritten program, saved (`rewrite_cache`)."""


def cache_dir() -> Path:
    folder = Path(os.environ.get("GRAPHC_CACHE_DIR") or Path.home() / ".cache" / "graphc")
    if folder.exists() and not folder.is_dir():
        raise GraphcError(f"GRAPHC_CACHE_DIR={str(folder)!r} is not a directory; point it at a directory "
                          "(it is created if missing)")
    return folder


def record_of(entry: Path) -> Path:
    return entry.with_name(entry.name + ".sha256")


def is_intact(entry: Path) -> bool:
    """Whether a cache entry exists and still has the hash recorded when it was written."""
    record = record_of(entry)
    return entry.is_file() and record.is_file() and record.read_text().strip() == sha256_file(entry)


def store_entry(partial: Path, entry: Path) -> None:
    """Move a compiled file (written inside the cache directory) into place, then record its hash:
    an entry whose record is missing or stale counts as absent."""
    digest = sha256_file(partial)
    os.replace(partial, entry)  # atomic: an entry is whole or absent
    with tempfile.NamedTemporaryFile("w", dir=entry.parent, prefix=".record-", delete=False) as record:
        record.write(digest + "\n")
    os.replace(record.name, record_of(entry))


def program_digest(program: ExportedProgram) -> str:
    """The sha256 of a program's content: its code, signature, constants and every node's shape
    and dtype (programs that compute the same get the same digest, whatever rank they came from)."""
    digest = hashlib.sha256()
    for part in (program.graph_module.code, str(program.graph_signature), str(program.range_constraints)):
        digest.update(part.encode())
        digest.update(b"\0")
    for name, constant in sorted(program.constants.items()):
        digest.update(name.encode())
        digest.update(constant.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            digest.update(f"{node.name}:{tuple(value.shape)}:{value.dtype}\0".encode())
    return digest.hexdigest()


def program_key(digest: str, backend: str, topology: Topology) -> str:
    """The compiled file's key of the program whose `program_digest` is `digest`."""
    record = backend_named(backend)
    parts = (backend, __version__, emit_sources_digest(record.compiler.partition(":")[0]), torch.__version__,
             repr(topology), record.cache_toolchain(), digest)  # toolchain: neuron's, with or without NEFFs
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compile_all(jobs: list[CompileJob], backend: str, topology: Topology, workers: int,
                show_progress: bool = True) -> dict[str, Path]:
    """Compile every distinct job (by key) not already cached; return key -> cached file."""
    folder = cache_dir() / backend
    folder.mkdir(parents=True, exist_ok=True)
    extension = backend_named(backend).extension
    results = {job.key: folder / f"{job.key}.{extension}" for job in jobs}
    labels: dict[str, list[str]] = {}
    for job in jobs:
        labels.setdefault(job.key, []).append(job.label)
    todo = {job.key: job for job in jobs if not is_intact(results[job.key])}
    if not todo:
        return results
    # Scratch space inside the cache directory: compiled files move into place by rename.
    with tempfile.TemporaryDirectory(prefix=".graphc-programs-", dir=folder) as scratch, Progress(
        TextColumn("[bold]compiling[/] {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), disable=not show_progress, transient=False,
    ) as progress:
        task = progress.add_task(backend, total=len(todo))
        # Same extension as the cache entry: AOTInductor insists on package paths ending in .pt2.
        partials = {key: Path(scratch) / f"{key}.partial.{extension}" for key in todo}

        def compiled(key: str, partial: Path) -> None:
            store_entry(partial, results[key])
            progress.advance(task)

        if not backend_named(backend).parallel_compile or workers <= 1 or len(todo) == 1:
            for key, job in todo.items():
                progress.update(task, description=f"{backend}: {', '.join(labels[key])}")
                compile_program(backend, job.program, partials[key], topology)
                compiled(key, partials[key])
            return results
        context = multiprocessing.get_context("spawn")  # fork would inherit the parent's threads and locks
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=context) as pool:
            futures = {}
            for key, job in todo.items():
                futures[pool.submit(compile_program, backend, job.program, partials[key], topology)] = key
            running = set(futures.values())
            progress.update(task, description=f"{backend}: {len(running)} graphs")
            for future in concurrent.futures.as_completed(futures):
                key = futures[future]
                future.result()
                running.discard(key)
                compiled(key, partials[key])
                in_flight = ", ".join(sorted(label for k in running for label in labels[k]))
                progress.update(task, description=f"{backend}: {in_flight or 'done'}")
    return results
