"""`graphc neuron-finish`: NEFFs for neuron artifacts compiled on a host without neuronx-cc.

On a Neuron host, each distinct program archive's Neuron HLO goes through neuronx-cc (the
command in its program.json, with this run's `--target`), the NEFF joins the archive, and a new
artifacts directory is written with the manifest's hashes updated (signed again with a key, if
given). The input directory is verified first (its signature too, under a trusted key) and never
modified.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
from pathlib import Path

from graphc.artifacts.directory import atomic_directory, read_manifest, sha256_file
from graphc.artifacts.manifest import MANIFEST, GraphContext
from graphc.artifacts.signing import SIGNATURE, sign
from graphc.backends import backend
from graphc.backends.neuron_archive import (MODULES, NEFF, NEURON_HLO, NEURON_TARGET, available, manifest_extras,
                                            neff_of, neuronx_cc_command, program_contexts, read_archive,
                                            write_archive)
from graphc.errors import GraphcError


def finish(artifacts: Path, out: Path, target: str = NEURON_TARGET, force: bool = False, sign_key: Path | None = None,
           trusted_key: Path | None = None, workers: int = os.cpu_count() or 1) -> int:
    """Write `out`: `artifacts` with a NEFF in every program archive; returns the NEFFs compiled."""
    manifest = read_manifest(artifacts, trusted_key)
    if not backend(manifest.backend).neuron_finish:
        raise GraphcError(f"{artifacts}: backend {manifest.backend!r}; neuron-finish takes neuron artifacts")
    if not available():
        raise GraphcError("neuronx-cc is not on PATH: run neuron-finish on a Neuron host with the Neuron SDK installed")
    contexts = program_contexts(manifest)
    command = neuronx_cc_command(target)
    with atomic_directory(out, force) as staging:
        shutil.copytree(artifacts, staging, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(MANIFEST, SIGNATURE, ".graphc-*"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(lambda name: _add_neff(staging / name, contexts[name], command), contexts))
        hashes = {name: sha256_file(staging / name) for name in contexts}
        ranks = [dataclasses.replace(rank, graphs=[dataclasses.replace(g, sha256=hashes[g.file]) for g in rank.graphs])
                 for rank in manifest.ranks]
        finished = dataclasses.replace(manifest, ranks=ranks, extra={**manifest.extra, **manifest_extras(target)})
        (staging / MANIFEST).write_text(finished.to_yaml())
        if sign_key is not None:
            (staging / SIGNATURE).write_bytes(sign((staging / MANIFEST).read_bytes(), sign_key))
    return len(contexts)


def _add_neff(archive: Path, context: GraphContext, command: list[str]) -> None:
    # A NEFF already there is replaced, so never read.
    description, files = read_archive(archive, context, MODULES)
    files[NEFF] = neff_of(files[NEURON_HLO], command)
    write_archive(archive, dataclasses.replace(description, neuronx_cc=command), files)
