"""Emit: content-hash specialised programs, compile each distinct one once, cache the results.

A graph's key is the sha256 of what determines its compiled form: the backend, the graphc and
torch versions, the graph code, its signature, its constants and the shapes and dtypes of every
node. Weights are graph inputs, so they are not part of the key. Compiled files live in a content-addressed
cache (`GRAPHC_CACHE_DIR`, default `~/.cache/graphc`), so an unchanged graph is never compiled
twice, across buckets, ranks and runs. Misses compile in parallel worker processes.
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
from graphc.backends import EXTENSIONS, compile_program


@dataclass(frozen=True)
class CompileJob:
    label: str
    """What the progress bar shows, e.g. `decode-4 rank 0`."""
    key: str
    """Content hash of the program (see `program_key`)."""
    program: ExportedProgram


def cache_dir() -> Path:
    return Path(os.environ.get("GRAPHC_CACHE_DIR") or Path.home() / ".cache" / "graphc")


def program_key(program: ExportedProgram, backend: str) -> str:
    digest = hashlib.sha256()
    for part in (backend, __version__, torch.__version__, program.graph_module.code,
                 str(program.graph_signature), str(program.range_constraints)):
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


def compile_all(jobs: list[CompileJob], backend: str, workers: int, show_progress: bool = True) -> dict[str, Path]:
    """Compile every distinct job (by key) not already cached; return key -> cached file."""
    folder = cache_dir() / backend
    folder.mkdir(parents=True, exist_ok=True)
    extension = EXTENSIONS[backend]
    results = {job.key: folder / f"{job.key}.{extension}" for job in jobs}
    labels: dict[str, list[str]] = {}
    for job in jobs:
        labels.setdefault(job.key, []).append(job.label)
    todo = {job.key: job for job in jobs if not results[job.key].is_file()}
    if not todo:
        return results
    with tempfile.TemporaryDirectory(prefix="graphc-programs-") as scratch, Progress(
        TextColumn("[bold]compiling[/] {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), disable=not show_progress, transient=False,
    ) as progress:
        task = progress.add_task(backend, total=len(todo))
        programs = {}
        # Same extension as the cache entry: AOTInductor insists on package paths ending in .pt2.
        partials = {key: Path(scratch) / f"{key}.partial.{extension}" for key in todo}
        for key, job in todo.items():
            programs[key] = Path(scratch) / f"{key}.pt2"
            torch.export.save(job.program, str(programs[key]))

        def compiled(key: str, partial: Path) -> None:
            os.replace(partial, results[key])  # atomic: a cache entry is whole or absent
            progress.advance(task)

        if backend == "export" or workers <= 1 or len(todo) == 1:
            for key in todo:
                progress.update(task, description=f"{backend}: {', '.join(labels[key])}")
                compile_program(backend, programs[key], partials[key])
                compiled(key, partials[key])
            return results
        context = multiprocessing.get_context("spawn")  # fork would inherit the parent's threads and locks
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=context) as pool:
            futures = {pool.submit(compile_program, backend, programs[key], partials[key]): key for key in todo}
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
