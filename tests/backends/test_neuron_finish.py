"""The Neuron hand-off: with neuronx-cc on PATH (here a stand-in that records its arguments and
writes a NEFF), `graphc compile` puts a NEFF in every program archive, and `graphc neuron-finish`
turns HLO-only artifacts into verified, re-hashed ones with NEFFs. The real compiler is not
installable here; what is tested is the command graphc runs and what it does with the result."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner

from graphc.artifacts.directory import read_manifest, sha256_file
from graphc.backends.neuron_archive import (NEURON_HLO, manifest_extras, neuronx_cc_command, phase, program_contexts,
                                           read_archive)
from graphc.cli import cli
from graphc.errors import GraphcError
from graphc.runtime import Engine, Request
from graphc.tools import neuron_finish
from graphc.tools.neuron_finish import log_of

pytestmark = [pytest.mark.compiles]

FAKE_NEURONX_CC = """#!{python}
# Stand-in for neuronx-cc, to its CLI reference ("Neuron Compiler CLI Reference Guide"): the compile
# command's documented options (--lnc as NxD Inference spells --logical-nc-config) and the internal
# ones NxD Inference passes; an unknown option, a target it does not name or an LNC on trn1 (whose
# cores do not pair: NCC_EARG001) is refused with exit 2, as argparse refuses. Records its argument
# line, checks the HLO is there, writes a log and the NEFF.
import argparse, pathlib, sys
with open({log!r}, "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
parser = argparse.ArgumentParser(prog="neuronx-cc", allow_abbrev=False)
commands = parser.add_subparsers(dest="command", required=True)
compile = commands.add_parser("compile", allow_abbrev=False)
compile.add_argument("model_files", nargs="+")
compile.add_argument("--framework", required=True, choices=["XLA", "TENSORFLOW", "PYTORCH"])
compile.add_argument("--target", required=True, choices=["inf2", "trn1", "trn1n", "trn2", "trn3"])
compile.add_argument("--lnc", "-lnc", "--logical-nc-config", dest="lnc", type=int, choices=[1, 2])
compile.add_argument("-O", "--optlevel", dest="optlevel", type=int, choices=[1, 2, 3], default=2)
compile.add_argument("--model-type", choices=["generic", "transformer", "unet-inference"])
compile.add_argument("--auto-cast", choices=["none", "matmult", "all"])
compile.add_argument("--auto-cast-type", choices=["bf16", "fp16", "tf32", "fp8_e4m3"])
for flag in ("--distribution-strategy", "--native-int64", "--implicit-integer-downcast", "--logfile", "--verbose",
             "--tensorizer-options", "--internal-hlo2tensorizer-options"):
    compile.add_argument(flag)
for flag in ("--enable-mixed-precision-accumulation", "--enable-saturate-infinity", "--enable-fast-context-switch",
             "--enable-fast-loading-neuron-binaries"):
    compile.add_argument(flag, action="store_true")
compile.add_argument("--output", default="file.neff")
options = parser.parse_args()
if options.lnc is not None and options.target not in ("trn2", "trn3"):
    parser.exit(2, f"[NCC_EARG001] Unsupported Logical Neuron Core (LNC) configuration {{options.lnc}} for "
                   f"{{options.target}}\\n")
hlo = pathlib.Path(options.model_files[0])
if not hlo.is_file() or hlo.stat().st_size == 0:
    parser.exit(3, f"{{hlo}}: no HLO\\n")
print(f"Compiler status PASS (-O{{options.optlevel}})")
pathlib.Path(options.logfile or "log-neuron-cc.txt").write_text(f"compiled {{hlo}} for {{options.target}}\\n")
pathlib.Path(options.output).write_bytes(b"NEFF:" + hlo.read_bytes())
"""


def _install_fake_neuronx_cc(folder, monkeypatch):
    """Put the stand-in first on PATH; returns the log of its calls."""
    (folder / "bin").mkdir()
    script = folder / "bin" / "neuronx-cc"
    script.write_text(FAKE_NEURONX_CC.format(python=sys.executable, log=str(folder / "calls.log")))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder / 'bin'}:{os.environ['PATH']}")
    return folder / "calls.log"


def _phases(artifacts):
    """Each program archive's phase, from its program.json."""
    manifest = read_manifest(artifacts)
    return {name: phase(read_archive(artifacts / name, context, ())[0].signature)
            for name, context in program_contexts(manifest).items()}


def test_the_stand_in_refuses_what_neuronx_cc_refuses(tmp_path, monkeypatch):
    """Unknown options, an LNC on trn1, an unknown target: exit 2, as the real CLI's parser."""
    _install_fake_neuronx_cc(tmp_path, monkeypatch)
    (tmp_path / NEURON_HLO).write_bytes(b"hlo")

    def run(*flags):
        return subprocess.run(["neuronx-cc", "compile", NEURON_HLO, "--framework", "XLA", *flags], cwd=tmp_path,
                              capture_output=True, text=True)

    assert run("--target", "trn2", "--lnc", "2", "-O2").returncode == 0
    assert run(*neuronx_cc_command("trn1", step="context_encoding")[5:]).returncode == 0
    for flags in (["--target", "trn2", "--fast-everything"], ["--target", "trn1", "--lnc", "2"],
                  ["--target", "trn9"], ["--target", "trn2", "--lnc", "4"]):
        assert run(*flags).returncode == 2, flags


def test_neuron_finish_adds_a_neff_to_every_program_and_rehashes(compiled, tmp_path, monkeypatch):
    artifacts = compiled("lora-groups", "neuron", "prompt_as_decode_small")  # compiled without neuronx-cc
    calls_log = _install_fake_neuronx_cc(tmp_path, monkeypatch)
    before = read_manifest(artifacts)
    assert before.extra["neuronx_cc"] == manifest_extras()["neuronx_cc"]
    # The default target, trn2, and its default LNC, 2.
    result = CliRunner().invoke(cli, ["neuron-finish", str(artifacts), "-o", str(tmp_path / "finished"), "--jobs", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.endswith("3 NEFF(s) for --target trn2 --lnc 2\n")
    finished = read_manifest(tmp_path / "finished")  # every hash verified
    files = sorted({g.file for r in finished.ranks for g in r.graphs})
    phases = _phases(artifacts)
    # prefill-32 is a context encoding; decode-4 and the prompt-as-decode decode-4x4 generate tokens.
    assert sorted(phases.values()) == ["context_encoding", "token_generation", "token_generation"]
    calls = calls_log.read_text().splitlines()
    assert len(calls) == len(files) == 3
    assert sorted(calls) == sorted(" ".join(neuronx_cc_command("trn2", 2, phases[name])[1:]) for name in files)
    for call in calls:
        level = "-O1" if "cc-pipeline-tiling-factor" not in call else "-O2"
        assert f"--target trn2 --lnc 2 {level}" in call and "--verify-hlo=true" in call
    assert sum("--target trn2 --lnc 2 -O2 " in call for call in calls) == 2
    record = finished.extra["neuronx_cc"]
    assert (record["target"], record["lnc"]) == ("trn2", 2)
    assert {key: value for key, value in record.items() if key != "logs"} == manifest_extras("trn2", 2)["neuronx_cc"]
    for name in files:
        with zipfile.ZipFile(tmp_path / "finished" / name) as archive, \
                zipfile.ZipFile(artifacts / name) as original:
            assert archive.read("neuron.neff") == b"NEFF:" + archive.read("neuron.hlo.pb")
            assert "neuron.neff" not in original.namelist()  # the input is never modified
            assert json.loads(archive.read("program.json"))["neuronx_cc"] == neuronx_cc_command("trn2", 2, phases[name])
        # The compiler's log beside its archive, hashed in the manifest.
        log = tmp_path / "finished" / log_of(name)
        assert record["logs"][log_of(name)] == sha256_file(log)
        assert "Compiler status PASS" in log.read_text() and "compiled neuron.hlo.pb for trn2" in log.read_text()
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
    assert not [key for key in os.environ if key.startswith("NEURON_")]  # the refusal left the environment alone


def test_neuron_finish_for_trn1_passes_no_lnc_and_refuses_one(compiled, tmp_path, monkeypatch):
    artifacts = compiled("lora-groups", "neuron", "prompt_as_decode_small")
    calls_log = _install_fake_neuronx_cc(tmp_path, monkeypatch)
    refused = CliRunner().invoke(cli, ["neuron-finish", str(artifacts), "-o", str(tmp_path / "out"), "--target", "trn1",
                                       "--lnc", "2"])
    assert refused.exit_code == 2 and refused.output == (
        "error: --lnc 2 with --target trn1: logical NeuronCores are trn2 and trn3 only; leave --lnc out for trn1\n")
    assert not calls_log.exists() and not (tmp_path / "out").exists()
    result = CliRunner().invoke(cli, ["neuron-finish", str(artifacts), "-o", str(tmp_path / "out"), "--target", "trn1",
                                      "--jobs", "1"])
    assert result.exit_code == 0 and result.output.endswith("3 NEFF(s) for --target trn1\n"), result.output
    calls = calls_log.read_text().splitlines()
    assert len(calls) == 3 and all("--target trn1 -O" in call and "--lnc" not in call for call in calls)
    record = read_manifest(tmp_path / "out").extra["neuronx_cc"]
    assert (record["target"], record["lnc"]) == ("trn1", None)


def test_the_default_jobs_are_bounded_by_cpus_memory_and_programs(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(neuron_finish, "available_memory", lambda: 100 * 2**30)
    assert neuron_finish.default_jobs(10) == 100 // 32  # memory: 3 at 32 GiB each
    assert neuron_finish.default_jobs(2) == 2  # no more than the programs
    monkeypatch.setattr(neuron_finish, "available_memory", lambda: 2**30)
    assert neuron_finish.default_jobs(10) == 1  # at least one


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
    phases = _phases(tmp_path / "art")
    assert sorted(calls_log.read_text().splitlines()) == sorted(
        " ".join(neuronx_cc_command(step=phases[name])[1:]) for name in files)
    assert len(files) == 2 and sorted(phases.values()) == ["context_encoding", "token_generation"]
    for name in files:
        with zipfile.ZipFile(tmp_path / "art" / name) as archive:
            assert archive.read("neuron.neff") == b"NEFF:" + archive.read("neuron.hlo.pb")
