"""`graphc neuron-finish`: NEFFs for neuron artifacts compiled on a host without neuronx-cc.

On a Neuron host, each distinct program archive's Neuron HLO goes through neuronx-cc (the
command for its phase, `neuron_archive.neuronx_cc_command`, at this run's `--target` and
`--lnc`), `--jobs` at a time; the NEFF joins the archive, the compiler's log is kept beside it
(`graphs/<archive>.neuronx-cc.log`, hashed in the manifest), and a new artifacts directory is
written with the manifest's hashes updated and the target and LNC recorded (signed again with a
key, if given). The input directory is verified first (its signature too, under a trusted key)
and never modified.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
from pathlib import Path

import psutil

from graphc.artifacts.directory import atomic_directory, read_manifest, sha256_file
from graphc.artifacts.manifest import MANIFEST, GraphContext
from graphc.artifacts.signing import SIGNATURE, sign
from graphc.backends import backend
from graphc.backends.neuron_archive import (MODULES, NEFF, NEURON_HLO, NEURON_TARGET, available, check_flags,
                                            manifest_extras, neff_of, neuronx_cc_command, phase, program_contexts,
                                            read_archive, write_archive)
from graphc.errors import GraphcError

JOB_BYTES = 32 * 2**30
"""Host memory one neuronx-cc run is budgeted (an estimate, not a measurement: the compiler's
peak grows with the program, and a full-model step program's is tens of GiB; a trn2.48xlarge
has 2 TiB and 192 vCPUs). `--jobs` overrides the default it bounds (`default_jobs`)."""
LOG_SUFFIX = ".neuronx-cc.log"


def default_jobs(programs: int) -> int:
    """neuronx-cc runs at once by default: one a CPU, as many as the available host memory holds
    at JOB_BYTES each, at least one, at most one a program."""
    return max(1, min(os.cpu_count() or 1, available_memory() // JOB_BYTES, programs))


def available_memory() -> int:
    """The host memory available to new processes."""
    return psutil.virtual_memory().available


def log_of(archive: str) -> str:
    """The compiler log's file, beside its archive in the finished artifacts."""
    return archive + LOG_SUFFIX


def finish(artifacts: Path, out: Path, target: str = NEURON_TARGET, lnc: int | None = None, force: bool = False,
           sign_key: Path | None = None, trusted_key: Path | None = None, jobs: int | None = None) -> int:
    """Write `out`: `artifacts` with a NEFF in every program archive; returns the NEFFs compiled."""
    check_flags(target, lnc)
    if jobs is not None and jobs < 1:
        raise GraphcError(f"--jobs {jobs}: at least 1")
    manifest = read_manifest(artifacts, trusted_key)
    if not backend(manifest.backend).neuron_finish:
        raise GraphcError(f"{artifacts}: backend {manifest.backend!r}; neuron-finish takes neuron artifacts")
    if not available():
        raise GraphcError("neuronx-cc is not on PATH: run neuron-finish on a Neuron host with the Neuron SDK installed")
    contexts = program_contexts(manifest)
    with atomic_directory(out, force) as staging:
        shutil.copytree(artifacts, staging, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(MANIFEST, SIGNATURE, ".graphc-*"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or default_jobs(len(contexts))) as pool:
            list(pool.map(lambda name: _add_neff(staging, name, contexts[name], target, lnc), contexts))
        hashes = {name: sha256_file(staging / name) for name in contexts}
        ranks = [dataclasses.replace(rank, graphs=[dataclasses.replace(g, sha256=hashes[g.file]) for g in rank.graphs])
                 for rank in manifest.ranks]
        extras = manifest_extras(target, lnc)
        extras["neuronx_cc"]["logs"] = {log_of(name): sha256_file(staging / log_of(name)) for name in contexts}
        finished = dataclasses.replace(manifest, ranks=ranks, extra={**manifest.extra, **extras})
        (staging / MANIFEST).write_text(finished.to_yaml())
        if sign_key is not None:
            (staging / SIGNATURE).write_bytes(sign((staging / MANIFEST).read_bytes(), sign_key))
    return len(contexts)


def _add_neff(staging: Path, name: str, context: GraphContext, target: str, lnc: int | None) -> None:
    # A NEFF already there is replaced, so never read.
    description, files = read_archive(staging / name, context, MODULES)
    command = neuronx_cc_command(target, lnc, phase(description.signature))
    files[NEFF], log = neff_of(files[NEURON_HLO], command)
    write_archive(staging / name, dataclasses.replace(description, neuronx_cc=command), files)
    (staging / log_of(name)).write_text(log)
