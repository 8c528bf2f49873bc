"""`graphc inspect --lint`: structural checks of compiled artifacts, after the fact (on a host
they were copied to, or before a hand-off).

Every backend: each bucket is one file that every rank runs (`graphc.backends`). Then the
backend's own checks (`Backend.linter`; neuron's: each program's Neuron HLO passes
`backends/xla/lint.py` against the manifest's topology).
"""

from __future__ import annotations

from pathlib import Path

from graphc.artifacts.manifest import Manifest
from graphc.backends import backend


def lint_artifacts(artifacts: Path, manifest: Manifest) -> list[str]:
    """Every problem found, one line each (empty: clean)."""
    problems = []
    for index, graph in enumerate(manifest.ranks[0].graphs):
        files = {rank.graphs[index].file for rank in manifest.ranks}
        if len(files) > 1:
            problems.append(f"{graph.bucket.name}: the ranks run {len(files)} different files; one program serves "
                            "every rank")
    return problems + backend(manifest.backend).lint(artifacts, manifest)
