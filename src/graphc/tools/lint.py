"""`graphc inspect --lint`: structural checks of compiled artifacts, after the fact (on a host
they were copied to, or before a hand-off).

Every backend: each bucket's programs are at most two files whatever the world (the leader's and
the followers' or one for every rank): every rank that samples (the first of each attention
replica) names the leader's file, and every follower the same file. Then the
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
    leader = manifest.ranks[0]
    for index, graph in enumerate(leader.graphs):
        sampling = {rank.graphs[index].file for rank in manifest.ranks if rank.samples}
        files = {rank.graphs[index].file for rank in manifest.ranks if not rank.samples}
        if sampling != {graph.file}:
            problems.append(f"{graph.bucket.name}: the ranks that sample run {len(sampling)} different files; "
                            "every replica's first rank runs the leader's program")
        if len(files) > 1:
            problems.append(f"{graph.bucket.name}: the followers run {len(files)} different files; "
                            "one program must serve every follower")
        if not backend(manifest.backend).follower_programs and files and files != {graph.file}:
            problems.append(f"{graph.bucket.name}: ranks run different files; {manifest.backend} has one program "
                            "for every rank")
    return problems + backend(manifest.backend).lint(artifacts, manifest)
