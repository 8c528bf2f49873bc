"""Artifacts are input (they travel between hosts): loading them never runs code they carry, and
nothing a manifest names is read from outside its directory.

Everything here uses the `export` backend; each test tampers with a private copy.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from graphc.artifact import MANIFEST, ArtifactError, read_manifest, sha256_file
from graphc.runtime import Engine
from graphc.runtime.archive_check import check_export_archive

PRESET = "lora-groups"  # its checkpoint has a tokenizer


class _Marker:
    """Unpickling this creates the marker file: proof that code from the archive ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture
def artifacts(compiled, tmp_path) -> Path:
    return Path(shutil.copytree(compiled(PRESET, "export"), tmp_path / "artifacts"))


def _rewrite_archive(path: Path, change) -> None:
    """Rewrite the zip at `path`: change(entries) edits the {name: bytes} dict in place."""
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    change(entries)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


def _rehash(artifacts: Path, relative: str, key: str = "sha256") -> None:
    """Record the tampered file's new hash, as an attacker who controls the manifest would."""
    data = yaml.safe_load((artifacts / MANIFEST).read_text())
    digest = sha256_file(artifacts / relative)
    for rank in data["ranks"]:
        for graph in rank["graphs"]:
            if graph["file"] == relative:
                graph[key] = digest
    if data.get("tokenizer") == relative:
        data["tokenizer_sha256"] = digest
    (artifacts / MANIFEST).write_text(yaml.safe_dump(data, sort_keys=False))


def _pickled_constant(marker: Path):
    def change(entries):
        config_name = next(n for n in entries if n.endswith("_constants_config.json"))
        config = json.loads(entries[config_name])
        fqn, payload = next(iter(config["config"].items()))
        payload["use_pickle"] = True
        entries[config_name] = json.dumps(config).encode()
        entries[config_name.rsplit("/", 1)[0] + "/" + payload["path_name"]] = pickle.dumps(_Marker(marker))
    return change


def _pickled_sample_inputs(marker: Path):
    def change(entries):
        prefix = next(iter(entries)).split("/", 1)[0]
        entries[f"{prefix}/data/sample_inputs/model.pt"] = pickle.dumps(_Marker(marker))
    return change


@pytest.mark.parametrize("tamper", [_pickled_constant, _pickled_sample_inputs])
def test_a_graph_that_asks_for_pickle_is_refused_and_its_payload_never_runs(artifacts, tmp_path, tamper):
    marker = tmp_path / "payload-ran"
    graph = read_manifest(artifacts).ranks[0].graphs[0].file
    _rewrite_archive(artifacts / graph, tamper(marker))
    _rehash(artifacts, graph)
    read_manifest(artifacts)  # every hash matches: only the archive check stands in the way
    with pytest.raises(ArtifactError, match="unpickle"):
        Engine(artifacts)
    assert not marker.exists()
    # The control: torch itself would have run the payload.
    with pytest.raises(Exception):
        torch.export.load(str(artifacts / graph))
    assert marker.exists()


def test_every_compiled_graph_passes_the_archive_check(artifacts):
    for graph in read_manifest(artifacts).ranks[0].graphs:
        check_export_archive(artifacts / graph.file)


@pytest.mark.parametrize("path", ["graphs/../../elsewhere/x.pt2", "/etc/passwd", "", "graphs/../manifest.yaml"])
def test_a_graph_path_outside_the_directory_is_refused(artifacts, path):
    data = yaml.safe_load((artifacts / MANIFEST).read_text())
    data["ranks"][0]["graphs"][0]["file"] = path
    (artifacts / MANIFEST).write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ArtifactError, match="inside the artifacts directory"):
        read_manifest(artifacts)


def test_a_symlink_leaving_the_directory_is_refused(artifacts, tmp_path):
    graph = read_manifest(artifacts).ranks[0].graphs[0].file
    outside = tmp_path / "outside.pt2"
    shutil.move(artifacts / graph, outside)
    (artifacts / graph).symlink_to(outside)  # same bytes, same hash: only the location is wrong
    with pytest.raises(ArtifactError, match="outside the artifacts directory"):
        read_manifest(artifacts)


def test_the_tokenizer_is_hashed_and_confined(artifacts):
    manifest = read_manifest(artifacts)
    assert manifest.tokenizer == "tokenizer.json" and manifest.tokenizer_sha256 == sha256_file(artifacts / "tokenizer.json")
    original = (artifacts / "tokenizer.json").read_text()
    (artifacts / "tokenizer.json").write_text(original.replace('"!"', '"?"', 1))
    with pytest.raises(ArtifactError, match=r"tokenizer.json \(tokenizer\) does not match its sha256"):
        read_manifest(artifacts)
    (artifacts / "tokenizer.json").write_text(original)
    data = yaml.safe_load((artifacts / MANIFEST).read_text())
    data["tokenizer"] = "../../../../etc/passwd"
    (artifacts / MANIFEST).write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ArtifactError, match="tokenizer file '../../../../etc/passwd' is not a path inside"):
        read_manifest(artifacts)
