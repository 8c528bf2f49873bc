"""Cache keys follow graphc's own sources: a compiled program's key (`emit.program_key`) follows
its backend's compiler and what that imports, a rewritten program's (`rewrite_cache`) every source
that runs before emit; a change elsewhere (a checkout, no version bump) keeps the entry."""

from __future__ import annotations

from graphc.buckets.selection import Bucket
from graphc.compiler import emit, sources
from graphc.compiler.capture import capture_bucket
from graphc.weights.checkpoint import load_model
from graphc.topology import Topology
from support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS


def test_the_sources_digest_follows_every_files_name_and_content(tmp_path):
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "aten.py").write_text("A = 1\n")
    (tmp_path / "notes.txt").write_text("not a source")
    first = sources.sources_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a source")
    assert sources.sources_digest(tmp_path) == first
    (tmp_path / "rules" / "aten.py").write_text("A = 2\n")
    changed = sources.sources_digest(tmp_path)
    (tmp_path / "rules" / "aten.py").rename(tmp_path / "rules" / "other.py")
    assert len({first, changed, sources.sources_digest(tmp_path)}) == 3
    assert sources.sources_digest(tmp_path, ["elsewhere.py"]) != sources.sources_digest(tmp_path)


def test_a_backends_compiler_sources_are_its_imports_not_the_other_backends():
    export = sources.module_closure(["graphc.backends.export", "graphc.program_io"])
    neuron = sources.module_closure(["graphc.backends.neuron", "graphc.program_io"])
    assert {"backends/export.py", "program_io.py", "__init__.py", "backends/__init__.py"} <= export
    assert not any(name.startswith("backends/xla/") for name in export) and "backends/neuron.py" not in export
    # neuron's lowering, the ops it lowers, and what its lowering imports inside functions
    assert {"backends/neuron.py", "backends/xla/lower.py", "backends/xla/aten.py", "ops/sampler.py"} <= neuron
    assert not any(name.startswith(("runtime/", "server/", "passes/")) for name in neuron | export)


def test_the_sources_before_emit_leave_out_lowerings_and_serving(tmp_path):
    for name in ("models/layers.py", "passes/dce.py", "backends/__init__.py", "backends/neuron.py",
                 "backends/xla/lower.py", "runtime/engine.py", "compiler/capture.py", "compiler/emit.py", "cli.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert sorted(sources.frontend_sources(tmp_path)) == ["backends/__init__.py", "compiler/capture.py",
                                                         "models/layers.py", "passes/dce.py"]


def test_every_programs_key_changes_with_its_backends_sources(tiny_checkpoints, monkeypatch):
    program = capture_bucket(load_model(tiny_checkpoints["lora-groups"]), Bucket("decode", 2), BLOCKS_PER_ROW,
                             NUM_BLOCKS, BLOCK_SIZE)
    digest = emit.program_digest(program)
    key = emit.program_key(digest, "neuron", Topology(1, 1))
    assert emit.program_key(digest, "export", Topology(1, 1)) != key
    monkeypatch.setattr(emit, "emit_sources_digest", lambda module: "0" * 64)
    assert emit.program_key(digest, "neuron", Topology(1, 1)) != key
