"""The artifacts directory: verified before anything loads, written atomically, compiled once
(content-addressed cache), and served with the pool size and input shapes it was built for.

Everything here uses the `export` backend; artifacts that a test modifies are private copies.
"""

from __future__ import annotations

import errno
import filecmp
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from graphc import __version__
from graphc.artifacts.directory import read_manifest, sha256_file
from graphc.artifacts.manifest import FORMAT_VERSION, MANIFEST, ArtifactError
import graphc.artifacts.writer
from graphc.buckets.selection import Bucket
import graphc.compiler.emit
import graphc.compiler.pipeline
import graphc.compiler.rewrite_cache
from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.errors import GraphcError
from graphc.runtime import Engine, Request
import graphc.runtime.graph_loaders
import graphc.runtime.loader

from support import TEST_BUCKETS, model_yaml

pytestmark = pytest.mark.compiles

PRESET = "lora-groups"
NUM_BLOCKS_ENV = "GRAPHC_NUM_KV_BLOCKS"
QUIET = CompileOptions(show_progress=False, workers=1)


@pytest.fixture
def artifacts(compiled, tmp_path) -> Path:
    """A private copy of the session's standard export artifacts, safe to tamper with."""
    return Path(shutil.copytree(compiled(PRESET, "export"), tmp_path / "artifacts"))


@pytest.fixture(scope="module")
def engine(compiled) -> Engine:
    """An engine on the (untouched) session artifacts, with the manifest's pool size."""
    return Engine(compiled(PRESET, "export"))


def write_model_yaml(folder: Path, checkpoint: Path, **top_level) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = model_yaml(checkpoint, TEST_BUCKETS["standard"])
    data.update(top_level)
    path = folder / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def manifest_data(artifacts: Path) -> dict:
    return yaml.safe_load((artifacts / MANIFEST).read_text())


def write_manifest_data(artifacts: Path, data: dict) -> None:
    (artifacts / MANIFEST).write_text(yaml.safe_dump(data, sort_keys=False))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def first_graph(artifacts: Path) -> str:
    return manifest_data(artifacts)["ranks"][0]["graphs"][0]["file"]


def weights_file(artifacts: Path) -> str:
    return manifest_data(artifacts)["ranks"][0]["weights"]


def leftovers(parent: Path, name: str) -> list[str]:
    """Staging or retired directories that a compile into `parent / name` left behind."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((f".{name}.staging-", f".{name}.old-")))


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int = 8) -> list[list[int]]:
    results = engine.generate([Request(p, new_tokens, stop_at_eos=False) for p in prompts])
    assert all(r.error is None for r in results), results
    return [r.output_ids for r in results]


PROMPTS = [[5], [(3 * i) % 250 + 2 for i in range(20)], [(11 * i) % 250 + 2 for i in range(45)]]


# --- tampering is refused before anything loads ----------------------------------------------------

def _flip_graph(a: Path) -> str:
    name = first_graph(a)
    flip_byte(a / name)
    return name


def _flip_weights(a: Path) -> str:
    name = weights_file(a)
    flip_byte(a / name)
    return name


def _delete_graph(a: Path) -> str:
    name = first_graph(a)
    (a / name).unlink()
    return name


def _delete_weights(a: Path) -> str:
    name = weights_file(a)
    (a / name).unlink()
    return name


@pytest.mark.parametrize("tamper, says", [
    (_flip_graph, "does not match its sha256"),
    (_flip_weights, "does not match its sha256"),
    (_delete_graph, "is missing"),
    (_delete_weights, "is missing"),
], ids=["flipped-graph-byte", "flipped-weights-byte", "missing-graph", "missing-weights"])
def test_read_manifest_refuses_modified_or_missing_files(artifacts, tamper, says):
    name = tamper(artifacts)
    with pytest.raises(ArtifactError) as info:
        read_manifest(artifacts)
    message = str(info.value)
    assert name in message and says in message and "recompile" in message, message


def test_engine_refuses_a_flipped_graph_byte_before_loading_anything(artifacts, monkeypatch):
    name = _flip_graph(artifacts)

    def must_not_load(*args, **kwargs):
        raise AssertionError("loaded a file from artifacts that failed verification")

    monkeypatch.setattr(graphc.runtime.loader, "load_file", must_not_load)
    monkeypatch.setattr(graphc.runtime.graph_loaders, "load_export", must_not_load)
    with pytest.raises(ArtifactError) as info:
        Engine(artifacts)
    message = str(info.value)
    assert name in message and "sha256" in message and "recompile" in message, message


def test_an_untampered_copy_verifies(artifacts):
    """The control for the tampering tests: copying alone changes nothing."""
    manifest = read_manifest(artifacts)
    assert manifest.graphc_version == __version__
    assert manifest.torch_version == str(torch.__version__)


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 1, 0, None, str(FORMAT_VERSION)])
def test_read_manifest_refuses_another_format_version(artifacts, version):
    data = manifest_data(artifacts)
    if version is None:
        del data["format_version"]
    else:
        data["format_version"] = version
    write_manifest_data(artifacts, data)
    with pytest.raises(ArtifactError) as info:
        read_manifest(artifacts)
    message = str(info.value)
    assert MANIFEST in message and "format version" in message and "recompile" in message, message
    assert repr(version) in message, message


OTHER_GRAPHC, OTHER_TORCH = "0.0.1-other", "1.0.0+other"


@pytest.mark.parametrize("claimed", [
    "graphc",
    "torch",
    "both",
])
def test_read_manifest_refuses_another_graphc_or_torch_version(artifacts, claimed):
    data = manifest_data(artifacts)
    expected = []
    if claimed in ("graphc", "both"):
        data["graphc_version"] = OTHER_GRAPHC
        expected += [f"graphc {OTHER_GRAPHC}", f"graphc {__version__}"]
    if claimed in ("torch", "both"):
        data["torch_version"] = OTHER_TORCH
        expected += [f"torch {OTHER_TORCH}", f"torch {torch.__version__}"]
    write_manifest_data(artifacts, data)
    with pytest.raises(ArtifactError) as info:
        read_manifest(artifacts)
    message = str(info.value)
    assert MANIFEST in message and "recompile" in message, message
    for version in expected:
        assert version in message, (version, message)


@pytest.mark.parametrize("text", ["ranks: [unclosed\n", "a: b: c\n", "key: [1, 2\nother: }\n"])
def test_read_manifest_refuses_a_manifest_that_is_not_yaml(artifacts, text):
    (artifacts / MANIFEST).write_text(text)
    with pytest.raises(ArtifactError) as info:
        read_manifest(artifacts)
    message = str(info.value)
    assert MANIFEST in message and "YAML" in message and "recompile" in message, message
    assert len(message.splitlines()) == 1, message


def test_read_manifest_refuses_a_manifest_missing_keys(artifacts):
    data = manifest_data(artifacts)
    del data["ranks"]
    write_manifest_data(artifacts, data)
    with pytest.raises(ArtifactError) as info:
        read_manifest(artifacts)
    message = str(info.value)
    assert MANIFEST in message and "ranks" in message and "recompile" in message, message


def test_read_manifest_refuses_a_directory_without_manifest(tmp_path):
    folder = tmp_path / "not-artifacts"
    folder.mkdir()
    (folder / "graphs").mkdir()
    with pytest.raises(ArtifactError) as info:
        read_manifest(folder)
    message = str(info.value)
    assert str(folder) in message and MANIFEST in message and "graphc compile" in message, message
    with pytest.raises(ArtifactError):
        Engine(folder)


# --- atomic compile ---------------------------------------------------------------------------------

def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("module, where", [(graphc.compiler.pipeline, "compile_all"),
                                           (graphc.artifacts.writer, "model_fingerprint")])
def test_an_interrupted_compile_leaves_nothing_behind(tiny_checkpoints, tmp_path, monkeypatch, module, where):
    """Interrupted after capture (no graphs yet) or after graphs and weights are staged."""
    config = load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET]))
    out = tmp_path / "site" / "artifacts"
    monkeypatch.setattr(module, where, _interrupt)
    with pytest.raises(KeyboardInterrupt):
        compile(config, out, QUIET)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


def test_an_interrupted_forced_compile_keeps_the_previous_artifacts(artifacts, tiny_checkpoints, tmp_path,
                                                                  monkeypatch):
    config = load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET]))
    before = {p.relative_to(artifacts): p.read_bytes() for p in artifacts.rglob("*") if p.is_file()}
    monkeypatch.setattr(graphc.artifacts.writer, "model_fingerprint", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        compile(config, artifacts, CompileOptions(show_progress=False, workers=1, force=True))
    after = {p.relative_to(artifacts): p.read_bytes() for p in artifacts.rglob("*") if p.is_file()}
    assert after == before
    assert leftovers(artifacts.parent, artifacts.name) == []


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "weights-0.safetensors")


def test_a_full_disk_is_one_line_and_a_forced_compile_keeps_the_previous_artifacts(artifacts, tiny_checkpoints,
                                                                                  tmp_path, monkeypatch):
    from click.testing import CliRunner

    from graphc.cli import cli

    config = write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET])
    before = {p.relative_to(artifacts): p.read_bytes() for p in artifacts.rglob("*") if p.is_file()}
    monkeypatch.setattr(graphc.compiler.pipeline, "write_weights", _full_disk)
    result = CliRunner().invoke(cli, ["compile", str(config), "-o", str(artifacts), "--force"])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (f"error: {artifacts}: writing the artifacts failed: No space left on "
                                              "device (weights-0.safetensors); nothing was written and the old "
                                              "artifacts are kept")
    assert {p.relative_to(artifacts): p.read_bytes() for p in artifacts.rglob("*") if p.is_file()} == before
    assert leftovers(artifacts.parent, artifacts.name) == []


def test_compile_into_an_existing_directory_needs_force(artifacts, tiny_checkpoints, tmp_path):
    config = load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET]))
    (artifacts / "keep-me.txt").write_text("mine")
    before = sorted(p.relative_to(artifacts) for p in artifacts.rglob("*"))
    with pytest.raises(ArtifactError) as info:
        compile(config, artifacts, QUIET)
    message = str(info.value)
    assert str(artifacts) in message and "--force" in message, message
    assert sorted(p.relative_to(artifacts) for p in artifacts.rglob("*")) == before
    assert (artifacts / "keep-me.txt").read_text() == "mine"
    assert leftovers(artifacts.parent, artifacts.name) == []


def test_compile_with_force_replaces_the_directory(artifacts, tiny_checkpoints, tmp_path):
    config = load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET]))
    (artifacts / "graphs" / "stale.pt2").write_text("from before")  # inside what graphc writes: replaced
    manifest = compile(config, artifacts, CompileOptions(show_progress=False, workers=1, force=True))
    assert not (artifacts / "graphs" / "stale.pt2").exists()
    assert read_manifest(artifacts) == manifest
    assert leftovers(artifacts.parent, artifacts.name) == []


# --- the compile cache ------------------------------------------------------------------------------

GRAPH_NAME = re.compile(r"graphs/[0-9a-f]{64}\.pt2")


def test_the_same_yaml_compiles_once(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "fresh-cache"))  # a cold cache: the first compile compiles
    config = load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET]))
    real = graphc.compiler.emit.compile_program
    calls = []

    def counting(backend, program, out, topology):
        calls.append(backend)
        real(backend, program, out, topology)

    monkeypatch.setattr(graphc.compiler.emit, "compile_program", counting)
    first = compile(config, tmp_path / "first", QUIET)
    distinct = {g.file for r in first.ranks for g in r.graphs}
    assert len(calls) == len(distinct) == 4  # prefill 8, 32 and decode 1, 4

    def refuse(backend, program, out):
        raise AssertionError("compiled a program the cache already held")

    monkeypatch.setattr(graphc.compiler.emit, "compile_program", refuse)
    second = compile(config, tmp_path / "second", QUIET)
    assert [g.file for r in second.ranks for g in r.graphs] == [g.file for r in first.ranks for g in r.graphs]
    for name in distinct:
        assert filecmp.cmp(tmp_path / "first" / name, tmp_path / "second" / name, shallow=False), name
    entries = sorted(Path(name).name for name in distinct)
    assert sorted(p.name for p in (tmp_path / "fresh-cache" / "export").iterdir()) == \
        sorted([*entries, *(f"{e}.sha256" for e in entries)])  # each entry with its recorded hash
    assert read_manifest(tmp_path / "second").ranks == first.ranks


def _cold_compile(tmp_path, monkeypatch, checkpoint, out: str):
    """Compile the standard buckets with a fresh cache; returns (manifest, compiled program count)."""
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = graphc.compiler.emit.compile_program
    monkeypatch.setattr(graphc.compiler.emit, "compile_program", lambda *a: (calls.append(a[0]), real(*a)))
    manifest = compile(load_config(write_model_yaml(tmp_path / "cfg", checkpoint)), tmp_path / out, QUIET)
    return manifest, len(calls)


@pytest.fixture(scope="module")
def cold_compiled(tiny_checkpoints, tmp_path_factory):
    """One cold compile of the standard buckets: (its folder, manifest); the cache it filled is the
    folder's `cache`, for tests to copy and tamper with."""
    root = tmp_path_factory.mktemp("cold")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRAPHC_CACHE_DIR", str(root / "cache"))
        manifest = compile(load_config(write_model_yaml(root / "cfg", tiny_checkpoints[PRESET])), root / "first", QUIET)
    return root, manifest


@pytest.mark.parametrize("tamper", ["planted", "corrupted", "record removed"])
def test_a_cache_entry_that_lost_its_recorded_hash_is_compiled_again(cold_compiled, tmp_path, monkeypatch, tamper):
    root, first = cold_compiled
    shutil.copytree(root / "cache", tmp_path / "cache")
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "export" / Path(first.ranks[0].graphs[0].file).name
    if tamper == "planted":  # a file dropped in under an entry's name, with no record of its own
        entry.with_name(entry.name + ".sha256").unlink()
        entry.write_bytes(b"not a graph")
    elif tamper == "corrupted":
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0x01
        entry.write_bytes(bytes(data))
    else:
        entry.with_name(entry.name + ".sha256").unlink()
    calls = []
    real = graphc.compiler.emit.compile_program
    monkeypatch.setattr(graphc.compiler.emit, "compile_program", lambda *a: (calls.append(a[0]), real(*a)))
    second = compile(load_config(root / "cfg" / "model.yaml"), tmp_path / "second", QUIET)
    assert len(calls) == 1  # only the tampered entry
    assert second.ranks == first.ranks  # the same content, hashes included
    read_manifest(tmp_path / "second")


def _recompile(cold_compiled, tmp_path, monkeypatch, tamper=lambda cache: None):
    """Compile `cold_compiled`'s config again over a copy of its cache (`tamper`ed with); returns
    (manifest, buckets captured, programs compiled)."""
    root, _ = cold_compiled
    shutil.copytree(root / "cache", tmp_path / "cache")
    tamper(tmp_path / "cache")
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "cache"))
    captured, compiled_programs = [], []
    capture, real = graphc.compiler.pipeline.capture_bucket, graphc.compiler.emit.compile_program
    monkeypatch.setattr(graphc.compiler.pipeline, "capture_bucket",
                        lambda model, bucket, *a: (captured.append(bucket.name), capture(model, bucket, *a))[1])
    monkeypatch.setattr(graphc.compiler.emit, "compile_program",
                        lambda *a: (compiled_programs.append(a[0]), real(*a)))
    manifest = compile(load_config(root / "cfg" / "model.yaml"), tmp_path / "again", QUIET)
    return manifest, captured, compiled_programs


def test_a_recompile_captures_rewrites_and_compiles_nothing_the_cache_holds(cold_compiled, tmp_path, monkeypatch):
    def refuse(*args):
        raise AssertionError("ran the passes on a program the cache held")

    monkeypatch.setattr(graphc.compiler.pipeline.PassManager, "run", refuse)
    manifest, captured, compiled_programs = _recompile(cold_compiled, tmp_path, monkeypatch)
    assert captured == [] and compiled_programs == []
    first = cold_compiled[1]
    assert manifest.ranks == first.ranks and manifest.extra == first.extra  # pass logs and op counts too


def test_an_edited_lowering_compiles_again_from_the_cached_rewrites(cold_compiled, tmp_path, monkeypatch):
    monkeypatch.setattr(graphc.compiler.emit, "emit_sources_digest", lambda module: "edited")
    manifest, captured, compiled_programs = _recompile(cold_compiled, tmp_path, monkeypatch)
    assert captured == [] and len(compiled_programs) == 4
    first = cold_compiled[1]
    for old, new in zip(first.ranks[0].graphs, manifest.ranks[0].graphs):
        assert old.file != new.file  # another key, the same program (export files are the program)
        assert filecmp.cmp(cold_compiled[0] / "first" / old.file, tmp_path / "again" / new.file, shallow=False)


def test_an_edit_before_emit_captures_again_and_reuses_what_compiles_the_same(cold_compiled, tmp_path, monkeypatch):
    monkeypatch.setattr(graphc.compiler.rewrite_cache, "frontend_sources_digest", lambda: "edited")
    manifest, captured, compiled_programs = _recompile(cold_compiled, tmp_path, monkeypatch)
    assert sorted(captured) == ["decode-1", "decode-4", "prefill-32", "prefill-8"]
    assert compiled_programs == [] and manifest.ranks == cold_compiled[1].ranks  # the same programs came out


def test_a_corrupted_rewritten_program_is_captured_again(cold_compiled, tmp_path, monkeypatch):
    def corrupt(cache):
        rewritten = next((cache / "rewritten").glob("*.pt2"))
        data = bytearray(rewritten.read_bytes())
        data[len(data) // 2] ^= 0x01
        rewritten.write_bytes(bytes(data))

    manifest, captured, compiled_programs = _recompile(cold_compiled, tmp_path, monkeypatch, corrupt)
    assert len(captured) == 1 and compiled_programs == [] and manifest.ranks == cold_compiled[1].ranks


def test_a_cache_on_another_filesystem_than_tmpdir_works(tiny_checkpoints, tmp_path, monkeypatch):
    """/dev/shm is a tmpfs and the cache is on disk: compiled files must never be renamed across."""
    scratch = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        monkeypatch.setenv("TMPDIR", str(scratch))
        monkeypatch.setattr(tempfile, "tempdir", None)
        assert os.stat(scratch).st_dev != os.stat(tmp_path).st_dev
        manifest, compiled_count = _cold_compile(tmp_path, monkeypatch, tiny_checkpoints[PRESET], "out")
        assert compiled_count == 4 and read_manifest(tmp_path / "out").ranks == manifest.ranks
    finally:
        shutil.rmtree(scratch)


def test_a_cache_dir_that_is_a_file_is_a_clear_error(tiny_checkpoints, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(GraphcError, match="GRAPHC_CACHE_DIR=.* is not a directory"):
        compile(load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET])), tmp_path / "out", QUIET)
    assert not (tmp_path / "out").exists()


def test_graph_files_are_named_by_content(compiled, tiny_checkpoints, tmp_path):
    """A compile whose programs are identical (only the pool size differs: it is the graphs'
    symbolic dim) reuses the same graph and weight files; every name is a sha256 and every
    recorded hash is the file's."""
    single = read_manifest(compiled(PRESET, "export"))
    config = load_config(write_model_yaml(tmp_path / "cfg", tiny_checkpoints[PRESET],
                                          kv_cache={"block_size": 8, "num_blocks": 100}))
    out = tmp_path / "bigger-pool"
    other = compile(config, out, QUIET)
    files = [g.file for g in other.ranks[0].graphs]
    assert files == [g.file for g in single.ranks[0].graphs]
    assert len(set(files)) == 4
    assert sorted(f"graphs/{p.name}" for p in (out / "graphs").iterdir()) == sorted(files)
    assert other.ranks[0].weights == single.ranks[0].weights
    for g in other.ranks[0].graphs:
        assert GRAPH_NAME.fullmatch(g.file), g.file
        assert g.sha256 == sha256_file(out / g.file)
    assert other.ranks[0].weights == f"weights/{other.ranks[0].weights_sha256}.safetensors"


# --- GRAPHC_NUM_KV_BLOCKS ---------------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [200, 16])
def test_kv_block_override_sizes_the_pool_and_keeps_tokens(compiled, engine, monkeypatch, blocks):
    """200: more than the manifest's 64. 16: exactly one context_limit (128) sequence of 8-token
    blocks, so the three requests are admitted one after another."""
    assert engine.manifest.kv_cache.num_blocks == 64 and engine.kv_pool.shape[1] == 64
    monkeypatch.setenv(NUM_BLOCKS_ENV, str(blocks))
    overridden = Engine(compiled(PRESET, "export"))
    assert overridden.kv_pool.shape[1] == blocks
    assert greedy(overridden, PROMPTS) == greedy(engine, PROMPTS)


@pytest.mark.parametrize("value, says", [
    ("15", "context_limit"),  # one 128-token sequence needs 16 blocks of 8
    ("0", "context_limit"),
    ("-4", "context_limit"),
    ("lots", "not an integer"),
    ("64.5", "not an integer"),
    ("", "not an integer"),
])
def test_kv_block_override_that_cannot_serve_is_an_error(compiled, monkeypatch, value, says):
    monkeypatch.setenv(NUM_BLOCKS_ENV, value)
    with pytest.raises(GraphcError) as info:
        Engine(compiled(PRESET, "export"))
    message = str(info.value)
    assert NUM_BLOCKS_ENV in message and says in message, message


# --- the runtime's shape check ----------------------------------------------------------------------

def _valid_inputs(runner) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=runner.dtypes[name]) for name, shape in runner.shapes.items()}


def test_graph_runner_accepts_the_compiled_shapes(engine):
    runner = engine.loaded.runners[Bucket("decode", 4)]
    tokens, _ = runner(engine.loaded.weights, _valid_inputs(runner))
    assert tokens.shape[0] == 4


@pytest.mark.parametrize("bucket, name, wrong", [
    (Bucket("decode", 4), "input_ids", (3, 1)),
    (Bucket("prefill", 8), "input_ids", (1, 9)),
    (Bucket("prefill", 32), "block_table", (1, 15)),
    (Bucket("decode", 1), "kv_pool", (3, 63, 8, 40)),
    (Bucket("decode", 4), "seed", (1,)),
])
def test_graph_runner_refuses_a_wrong_shape(engine, bucket, name, wrong):
    runner = engine.loaded.runners[bucket]
    inputs = _valid_inputs(runner)
    expected = runner.shapes[name]
    inputs[name] = torch.zeros(wrong, dtype=runner.dtypes[name])
    with pytest.raises(GraphcError) as info:
        runner(engine.loaded.weights, inputs)
    message = str(info.value)
    assert name in message and str(tuple(wrong)) in message and str(tuple(expected)) in message, message
    assert bucket.name in message, message


def test_graph_runner_refuses_a_wrong_dtype(engine):
    runner = engine.loaded.runners[Bucket("decode", 1)]
    inputs = _valid_inputs(runner)
    inputs["positions"] = inputs["positions"].to(torch.int32)
    with pytest.raises(GraphcError) as info:
        runner(engine.loaded.weights, inputs)
    message = str(info.value)
    assert "positions" in message and "torch.int32" in message and "torch.int64" in message, message


def test_served_weights_are_mapped_from_the_file_not_copied(engine):
    """The weights stay file-backed pages (safetensors maps the file): a host serving several
    ranks or restarting shares them through the page cache instead of holding copies."""
    weights_file = Path(engine.loaded.rank.weights).name  # named by its sha256: unique
    assert weights_file in Path("/proc/self/maps").read_text()
