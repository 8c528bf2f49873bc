"""A compiled program's cache key (`emit.program_key`) covers graphc's own sources: a lowering
changed without a version bump (a checkout) compiles again instead of reusing a cached program."""

from __future__ import annotations

from pathlib import Path

from graphc.buckets.selection import Bucket
from graphc.compiler import emit
from graphc.compiler.capture import capture_bucket
from graphc.models.checkpoint import load_model
from graphc.topology import Topology
from support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS


def test_the_sources_digest_follows_every_files_name_and_content(tmp_path):
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "aten.py").write_text("A = 1\n")
    (tmp_path / "notes.txt").write_text("not a source")
    first = emit.sources_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a source")
    assert emit.sources_digest(tmp_path) == first
    (tmp_path / "rules" / "aten.py").write_text("A = 2\n")
    changed = emit.sources_digest(tmp_path)
    (tmp_path / "rules" / "aten.py").rename(tmp_path / "rules" / "other.py")
    assert len({first, changed, emit.sources_digest(tmp_path)}) == 3


def test_every_programs_key_changes_with_graphcs_sources(tiny_checkpoints, monkeypatch):
    program = capture_bucket(load_model(tiny_checkpoints["lora-groups"]), Bucket("decode", 2), BLOCKS_PER_ROW,
                             NUM_BLOCKS, BLOCK_SIZE)
    key = emit.program_key(program, "neuron", Topology(1, 1))
    assert emit.source_digest() == emit.sources_digest(Path(emit.__file__).parents[1])  # graphc's package
    monkeypatch.setattr(emit, "source_digest", lambda: "0" * 64)
    assert emit.program_key(program, "neuron", Topology(1, 1)) != key
