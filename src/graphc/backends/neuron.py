"""`neuron` backend: per-program XLA HLO for neuronx-cc, and NEFFs where neuronx-cc is installed.

A compiled program is a zip archive (stored, no compression: it is hashed and shipped as one
file) of:

    program.json     the parameter / result names, shapes and dtypes (`ProgramSignature`), the
                     world size, and the neuronx-cc command that makes (or made) the NEFF
    neuron.hlo.pb    the HloModuleProto for neuronx-cc (`variants.NEURON`)
    cpu.hlo.pb       the same module in the form XLA:CPU runs (`variants.CPU`): what `graphc run`
                     serves here, to validate the graphs token for token
    neuron.neff      only where `neuronx-cc` was on PATH at compile time (or after `graphc
                     neuron-finish` on a Neuron host)

The Neuron variant is linted (`xla/lint.py`) before anything is written: a construct neuronx-cc
refuses fails the compile here, not on the Neuron host.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import torch

import graphc.ops  # noqa: F401  (graphs call graphc:: ops: register them before loading)
from graphc.backends.xla.lint import check_neuron_module
from graphc.backends.xla.lower import lower_to_hlo
from graphc.backends.xla.variants import CPU, NEURON
from graphc.errors import GraphcError
from graphc.topology import Topology

PROGRAM_JSON, NEURON_HLO, CPU_HLO, NEFF = "program.json", "neuron.hlo.pb", "cpu.hlo.pb", "neuron.neff"
NEURONX_CC = "neuronx-cc"
NEURON_TARGET = "trn1"
"""The Neuron generation NEFFs are compiled for (`neuronx-cc --target`)."""


def neuronx_cc_command(hlo: str, neff: str, target: str = NEURON_TARGET) -> list[str]:
    """neuronx-cc's documented invocation for an XLA HLO module, with numerics kept as compiled
    (`--auto-cast none`: graphc's dtypes are the model's)."""
    return [NEURONX_CC, "compile", hlo, "--framework", "XLA", "--target", target, "--model-type", "transformer",
            "--auto-cast", "none", "-O1", "--output", neff]


def compile_program(program: Path, out: Path, topology: Topology) -> None:
    exported = torch.export.load(str(program))
    neuron_hlo, signature = lower_to_hlo(exported, topology, NEURON)
    check_neuron_module(neuron_hlo, topology, signature.parameters.index("kv_pool"))
    cpu_hlo, _ = lower_to_hlo(exported, topology, CPU)
    command = neuronx_cc_command(NEURON_HLO, NEFF)
    description = {"signature": signature.to_json(), "world": topology.world, "neuronx_cc": command}
    with tempfile.TemporaryDirectory(prefix="graphc-neuron-") as scratch:
        folder = Path(scratch)
        (folder / NEURON_HLO).write_bytes(neuron_hlo)
        if shutil.which(NEURONX_CC):
            run_neuronx_cc(folder, command)
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
            archive.writestr(PROGRAM_JSON, json.dumps(description, indent=1))
            archive.writestr(NEURON_HLO, neuron_hlo)
            archive.writestr(CPU_HLO, cpu_hlo)
            if (folder / NEFF).is_file():
                archive.write(folder / NEFF, NEFF)


def run_neuronx_cc(folder: Path, command: list[str]) -> None:
    """Run neuronx-cc in `folder` (which holds the HLO); its output on failure names the reason."""
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if done.returncode != 0 or not (folder / NEFF).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise GraphcError(f"{' '.join(command)} failed (exit {done.returncode}): " + " | ".join(tail))
