"""The Neuron hand-off: with neuronx-cc on PATH (here a stand-in that records its arguments and
writes a NEFF), `graphc compile` puts a NEFF in every program archive, and `graphc neuron-finish`
turns HLO-only artifacts into verified, re-hashed ones with NEFFs. The real compiler is not
installable here; what is tested is the command graphc runs and what it does with the result."""

from __future__ import annotations

import os
import stat
import zipfile

import pytest
from click.testing import CliRunner

from graphc.artifacts.directory import read_manifest
from graphc.backends.neuron_archive import neuronx_cc_command
from graphc.cli import cli
from graphc.errors import GraphcError
from graphc.runtime import Engine, Request

pytestmark = [pytest.mark.compiles]

FAKE_NEURONX_CC = """#!/bin/sh
# Stand-in for neuronx-cc: record the arguments, check the HLO is there, write the NEFF.
echo "$@" >> "{log}"
[ -s neuron.hlo.pb ] || exit 3
printf 'NEFF:' > neuron.neff && cat neuron.hlo.pb >> neuron.neff
"""


def _install_fake_neuronx_cc(folder, monkeypatch):
    """Put the stand-in first on PATH; returns the log of its calls."""
    (folder / "bin").mkdir()
    script = folder / "bin" / "neuronx-cc"
    script.write_text(FAKE_NEURONX_CC.format(log=folder / "calls.log"))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder / 'bin'}:{os.environ['PATH']}")
    return folder / "calls.log"


def test_neuron_finish_adds_a_neff_to_every_program_and_rehashes(compiled, tmp_path, monkeypatch):
    artifacts = compiled("lora-groups", "neuron", "prompt_as_decode_small")  # compiled without neuronx-cc
    calls_log = _install_fake_neuronx_cc(tmp_path, monkeypatch)
    before = read_manifest(artifacts)
    assert before.extra["neuronx_cc"] == " ".join(neuronx_cc_command())
    result = CliRunner().invoke(cli, ["neuron-finish", str(artifacts), "-o", str(tmp_path / "finished"),
                                      "--target", "trn2"])
    assert result.exit_code == 0, result.output
    finished = read_manifest(tmp_path / "finished")  # every hash verified
    files = sorted({g.file for r in finished.ranks for g in r.graphs})
    calls = calls_log.read_text().splitlines()
    assert len(calls) == len(files) == 3
    assert all(call == " ".join(neuronx_cc_command("trn2")[1:]) for call in calls)
    for name in files:
        with zipfile.ZipFile(tmp_path / "finished" / name) as archive, \
                zipfile.ZipFile(artifacts / name) as original:
            assert archive.read("neuron.neff") == b"NEFF:" + archive.read("neuron.hlo.pb")
            assert "neuron.neff" not in original.namelist()  # the input is never modified
    assert finished.extra["neuronx_cc"] == " ".join(neuronx_cc_command("trn2"))
    # The finished artifacts still serve here (their CPU variant), with the same tokens.
    request = [Request([5, 6, 7, 8], 4, stop_at_eos=False)]
    assert Engine(tmp_path / "finished").generate(request)[0].output_ids == \
        Engine(artifacts).generate(request)[0].output_ids
    # The Neuron device runner refuses clearly: a NEFF is needed, and the Neuron runtime (absent here).
    monkeypatch.setenv("GRAPHC_NEURON_DEVICE", "1")
    with pytest.raises(GraphcError, match="no NEFF; run `graphc neuron-finish` on a Neuron host first"):
        Engine(artifacts)
    with pytest.raises(GraphcError, match=r"GRAPHC_NEURON_DEVICE=1: the Neuron runtime \(libnrt.so.1\) is not "
                                          "installed on this host"):
        Engine(tmp_path / "finished")


def test_neuron_finish_refuses_other_backends_and_a_host_without_neuronx_cc(compiled, tmp_path, monkeypatch):
    result = CliRunner().invoke(cli, ["neuron-finish", str(compiled("lora-groups", "export", "prompt_as_decode_small")),
                                      "-o", str(tmp_path / "out")])
    assert result.exit_code != 0 and "neuron-finish takes neuron artifacts" in result.output
    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(cli, ["neuron-finish", str(compiled("lora-groups", "neuron", "prompt_as_decode_small")),
                                      "-o", str(tmp_path / "out")])
    assert result.exit_code != 0 and "neuronx-cc is not on PATH" in result.output
    assert not (tmp_path / "out").exists()


def test_compile_with_neuronx_cc_on_path_writes_the_neffs(tmp_path, monkeypatch, tiny_checkpoints):
    import yaml

    from support import TEST_BUCKETS, model_yaml

    calls_log = _install_fake_neuronx_cc(tmp_path, monkeypatch)
    config = model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["small"], "neuron")
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["compile", str(tmp_path / "model.yaml"), "-o", str(tmp_path / "art")])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "art")
    files = sorted({g.file for r in manifest.ranks for g in r.graphs})
    assert calls_log.read_text().splitlines() == [" ".join(neuronx_cc_command()[1:])] * len(files) == \
        [" ".join(neuronx_cc_command()[1:])] * 2
    for name in files:
        with zipfile.ZipFile(tmp_path / "art" / name) as archive:
            assert archive.read("neuron.neff") == b"NEFF:" + archive.read("neuron.hlo.pb")
